"""``CudaAttentionBackend``: the paged-attention CUDA kernels of ``cuda/`` behind the backend interface.

One kernel serves both phases (see cuda/paged_attention.cu): a decode-only step
puts the ``group`` query heads of one KV head in a thread block and may split
long contexts (split-K + reduce, by ``pagedrs.kernels.planning.plan_split``); a
step with prefill chunks gives each chunk ``q_len × group`` causal rows over its
cached prefix pages plus itself. The plan is made once per step (the metadata
object is shared by every layer) and reused by each layer.

``runtime`` (``pagedrs.kernels.loader.KernelRuntime``) runs the kernels: CuPy on a
GPU by default; the tests pass the CPU emulator of ``tests/cuda_emu``, which runs
this very class, its planning and ``ops`` on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.kernels import loader, ops
from pagedrs.kernels.planning import SplitPlan, plan_split, work_items


@dataclass(frozen=True)
class _StepPlan:
    meta: AttentionMetadata  # the step this plan belongs to
    owner: Any  # the backend that made it (plans depend on its SM count)
    group: int
    work_items: torch.Tensor  # int32 [num_items, 2] on the device
    split: SplitPlan


class CudaAttentionBackend(AttentionBackend):
    name = "cuda"

    def __init__(self, num_sms: int | None = None, runtime: loader.KernelRuntime | None = None) -> None:
        self._num_sms = num_sms  # None: read from the device on first use
        self._runtime = runtime if runtime is not None else loader.CUPY
        self._swap_streams: dict[torch.device, Any] = {}  # device -> the runtime's side stream for swaps

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, self._runtime)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # refused: the kernels have no window mask
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim] of the cache dtype; allocated when None
    ) -> torch.Tensor:
        if sliding_window is not None:
            raise _no_window(sliding_window)
        group = query.shape[1] // key_cache.shape[2]
        plan = meta.plan  # planned once by the runner; direct callers plan here
        if not (isinstance(plan, _StepPlan) and plan.group == group and plan.owner is self):
            plan = self.plan(meta, key_cache.shape[1], query.shape[1], key_cache.shape[2])
        if out is None:
            out = torch.empty(query.shape, dtype=key_cache.dtype, device=query.device)
        ops.paged_attention(
            out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            plan.work_items, scale, plan.split, self._runtime,
        )  # fmt: skip
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def check_model(self, config: Any) -> None:
        window = config.sliding_window if config.layer_types is None or "sliding_attention" in config.layer_types else None
        if window is not None:
            raise _no_window(window)

    def plan(self, meta: AttentionMetadata, block_size: int, num_heads: int, num_kv_heads: int) -> _StepPlan:
        """The step's work items and split-K plan, made once and kept on ``meta.plan``."""
        group = num_heads // num_kv_heads
        if isinstance(meta.plan, _StepPlan) and meta.plan.group == group and meta.plan.owner is self:
            return meta.plan
        device = meta.block_tables.device
        starts = meta.query_start_loc_cpu
        items = work_items([starts[i + 1] - starts[i] for i in range(meta.num_seqs)], group)
        if self._num_sms is None:
            self._num_sms = self._runtime.num_sms(device)
        # Split-K only pays off for decode; prefill chunks already bring many rows per sequence.
        split = (
            plan_split(len(items) * num_kv_heads, meta.max_seq_len, self._num_sms)
            if meta.is_decode_only
            else SplitPlan(num_parts=1, part_tokens=meta.max_seq_len)
        )
        meta.plan = _StepPlan(meta, self, group, torch.from_numpy(items).to(device), split)
        return meta.plan

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        ops.copy_blocks(kv_cache, pairs, self._runtime)

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        device = src_cache.device if src_cache.is_cuda else dst_cache.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._swap_streams.get(device)
        if stream is None:
            stream = self._swap_streams[device] = self._runtime.new_stream(device)
        ops.swap_blocks(src_cache, dst_cache, pairs, stream, self._runtime)


def _no_window(window: int) -> ValueError:
    # The kernels attend to every key of the context; a window needs a mask in the kernel
    # (and then its planning could skip the pages before the window).
    return ValueError(
        f"the CUDA attention kernels do not apply a sliding window (this model has sliding_window={window}); "
        "set PAGEDRS_ATTENTION_BACKEND=torch to run it with the PyTorch backend"
    )
