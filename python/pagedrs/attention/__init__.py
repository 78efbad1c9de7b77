"""Attention backends over the paged KV cache; ``get_backend`` picks one for a device."""

from __future__ import annotations

import importlib.util
import os

import torch

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]


def get_backend(device: str | torch.device) -> AttentionBackend:
    """CUDA kernels on a CUDA device when CuPy is importable, unless PAGEDRS_ATTENTION_BACKEND=torch;
    the PyTorch reference everywhere else."""
    device = torch.device(device)
    wants_torch = os.environ.get("PAGEDRS_ATTENTION_BACKEND", "").lower() == "torch"
    if device.type == "cuda" and not wants_torch and importlib.util.find_spec("cupy") is not None:
        from pagedrs.attention.cuda_backend import CudaAttentionBackend

        return CudaAttentionBackend()
    return TorchAttentionBackend()
