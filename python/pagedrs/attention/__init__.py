"""Attention backends over the paged KV cache; ``get_backend`` picks one for a device."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]

logger = logging.getLogger(__name__)


BACKEND_CHOICES = ("auto", "torch", "cuda")


def get_backend(
    device: str | torch.device,
    *,
    dtype: torch.dtype | None = None,
    head_size: int | None = None,
    block_size: int | None = None,
    kv_cache_dtype: torch.dtype | None = None,  # the pages' dtype when not ``dtype`` (an fp8 cache)
) -> AttentionBackend:
    """The attention backend for a device and, when given, a KV-cache geometry.

    ``PAGEDRS_ATTENTION_BACKEND`` (``auto`` when unset) chooses: ``torch`` is the PyTorch
    reference everywhere; ``cuda`` insists on the CUDA kernels and raises, naming the
    geometry and what is built, when they cannot run it; ``auto`` takes the kernels on a CUDA
    device when CuPy is importable and the (dtype, head size, block size) is in their
    dispatch table, and otherwise the reference, with a warning on a CUDA device (as vLLM
    falls back between attention backends), so an unsupported geometry is found when the
    runner is built, never by every request failing in its first forward pass.
    """
    device = torch.device(device)
    raw = os.environ.get("PAGEDRS_ATTENTION_BACKEND", "")
    choice = raw.strip().lower() or "auto"
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"PAGEDRS_ATTENTION_BACKEND={raw!r} is not a backend; allowed: {', '.join(BACKEND_CHOICES)}")
    if choice == "torch":
        return TorchAttentionBackend()
    if device.type != "cuda":
        if choice == "cuda":
            raise ValueError(f"PAGEDRS_ATTENTION_BACKEND=cuda needs a CUDA device; the model runs on {device}")
        return TorchAttentionBackend()
    reason = None
    if importlib.util.find_spec("cupy") is None:
        reason = "CuPy is not installed (pip install 'pagedrs[cuda]')"
    elif None not in (dtype, head_size, block_size):
        from pagedrs.kernels.dispatch import lookup

        try:
            lookup(dtype, int(head_size), int(block_size), cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
        except ValueError as exc:
            reason = str(exc)
    if reason is None:
        from pagedrs.attention.cuda_backend import CudaAttentionBackend

        return CudaAttentionBackend()
    if choice == "cuda":
        raise ValueError(f"PAGEDRS_ATTENTION_BACKEND=cuda cannot run here: {reason}")
    logger.warning("attention: the PyTorch backend on %s, not the CUDA kernels: %s", device, reason)
    return TorchAttentionBackend()
