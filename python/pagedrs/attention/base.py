"""The attention backend interface: write new K/V into their slots, attend over block tables.

KV cache layout (one tensor for all layers, so that a block copy or a swap of
every layer is a single indexed copy)::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
               layer      K/V  physical   slot in     kv head       contiguous
                                block      block

    key_cache   = kv_cache[layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = kv_cache[layer, 1]

Slot ``s`` is ``(s // block_size, s % block_size)``. The host tier mirrors the
same layout with ``num_cpu_blocks`` blocks (pinned memory on CUDA).

The cache may hold the model dtype or an 8-bit type (``EngineArgs.kv_cache_dtype``; see
``pagedrs.attention.kv_quant``): a backend that reads fp8 pages says so (``reads_fp8``) and
quantizes in ``write_kv`` and dequantizes in ``forward`` with its per-tensor scales.

Backends: ``TorchAttentionBackend`` (CPU and CUDA; the reference) and
``CudaAttentionBackend`` (CuPy raw kernels from ``cuda/``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pagedrs.attention.kv_quant import KvScales, is_fp8, unit_scales


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer; tensors live on the model's device."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [S+1]
    seq_lens: torch.Tensor  # int32 [S]  context length including this step's tokens
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    max_query_len: int  # largest new-token count of one sequence (1 = decode only)
    max_seq_len: int  # largest context length
    query_start_loc_cpu: list[int]  # host copy, for loops that plan on the host
    seq_lens_cpu: list[int]  # host copy
    # The backend's plan of this step (work lists, buckets, masks), made once by
    # AttentionBackend.plan before the forward pass and read by every layer.
    plan: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """What a model layer needs from attention; one instance per runner."""

    name: str
    # Whether a decode forward planned by plan_padded_decode launches the same work at every
    # step of a capture size, so that a CUDA graph of it may be replayed (the CUDA kernels: yes;
    # the PyTorch reference plans buckets and masks from the step's lengths on the host: no).
    supports_decode_graphs: bool = False
    reads_fp8: bool = False  # whether write_kv and forward handle an fp8 cache (kv_quant)

    def __init__(self, kv_scales: KvScales | None = None) -> None:
        # (k_scale, v_scale) of an fp8 cache, float32 [1] each on the cache's device; None: 1.0 (vLLM's default)
        self._kv_scales = kv_scales

    def kv_scales(self, device: torch.device) -> KvScales:
        """The fp8 cache's (k_scale, v_scale) on ``device``."""
        return self._kv_scales if self._kv_scales is not None else unit_scales(device)

    def check_kv_cache_dtype(self, dtype: torch.dtype, model_dtype: torch.dtype | None = None) -> None:
        """Raises ValueError when this backend cannot store pages in ``dtype`` (for a model computing
        in ``model_dtype``): an fp8 cache is never handed to a backend that would read its bytes as
        something else."""
        if is_fp8(dtype) and not self.reads_fp8:
            raise ValueError(f"kv_cache_dtype: the {self.name!r} attention backend cannot read a {dtype} KV cache; "
                             "use kv_cache_dtype='auto' or a backend that reads fp8 pages (torch, cuda)")

    def plan(self, meta: AttentionMetadata, block_size: int, num_heads: int, num_kv_heads: int) -> Any:
        """Plans the step once, before the forward pass, and keeps the plan on ``meta.plan``.

        The executor calls it once per step with the KV geometry of this rank; backends
        that need no plan keep the default.
        """
        return None

    def plan_padded_decode(self, meta: AttentionMetadata, block_size: int, num_heads: int, num_kv_heads: int,
                           max_keys: int) -> Any:
        """Plans a padded decode step (``pagedrs.decode_graphs``): ``meta.num_seqs`` is a
        capture size, every block table is ``max_keys / block_size`` pages wide, and a CUDA graph may
        replay what the forward pass launches with this plan. A backend whose launches depend on
        the step's contexts must make them depend on ``meta.num_seqs`` and ``max_keys`` only here;
        one that launches nothing context-dependent plans as usual."""
        return self.plan(meta, block_size, num_heads, num_kv_heads)

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> None:
        """Scatter the step's new K/V into ``meta.slot_mapping``."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of each new token over its sequence's pages (written first by write_kv);
        with ``sliding_window`` W, over its last W positions only (its own included), as transformers."""

    def check_model(self, config: Any) -> None:
        """Raises ValueError when this backend cannot run a model of ``config`` (a ModelConfig);
        called when a runner is built, so that a model is refused before any request."""
        return None

    @abstractmethod
    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """Copy-on-write: ``kv_cache[:, :, dst] = kv_cache[:, :, src]`` for pairs int64 [N, 2] (src, dst)."""

    @abstractmethod
    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """Between tiers: ``dst_cache[:, :, d] = src_cache[:, :, s]`` for pairs int64 [N, 2] (s, d)."""
