"""``CudaAttentionBackend``: the paged-attention CUDA kernels of ``cuda/`` behind the backend interface.

One kernel serves both phases (see cuda/paged_attention.cu): a decode-only step
puts the ``group`` query heads of one KV head in a thread block and may split
long contexts (split-K + reduce, by ``pagedrs.kernels.planning.plan_split``); a
step with prefill chunks gives each chunk ``q_len × group`` causal rows over its
cached prefix pages plus itself. The plan is made once per step (the metadata
object is shared by every layer) and reused by each layer.

A layer with a sliding window passes it to the kernel, which starts each thread
block at the first key its first row sees: pages wholly before a sequence's window
are never read (the core may release them), and a decode token reads at most W
keys. The split-K plan then covers ``planning.visible_keys``, not the context; it
is made once per step for each window the layers use.

Two attention kernels serve the same contract (``pagedrs.kernels.dispatch.VARIANTS``):
``v1`` (16 rows a block, tiles through shared memory) for everything, and ``v2``
(4 rows a block, independent warps with pipelined loads; built for decode). With
``variant="v2"`` the decode tokens (sequences with one new token) go to v2 and the
prefill chunks of the same step to v1, in two launches writing disjoint rows: v2's
four-row blocks would read a chunk's prefix once per new token where v1 reads it once
per four tokens of group 4. ``variant`` defaults to ``$PAGEDRS_ATTENTION_KERNEL``, else
``DEFAULT_VARIANT``; v2's L2 prefetch distance ``v2_prefetch`` to ``$PAGEDRS_V2_PREFETCH``,
else ``DEFAULT_V2_PREFETCH``.

An fp8 cache (``attention.kv_quant``): the kernels take the cache's type beside the queries'
(``dispatch.FP8_CACHE_TYPES``) and the backend's (k_scale, v_scale) as device pointers; the
write quantizes, the attention converts on load (in software on sm_80, see cuda/dtype.cuh).

``runtime`` (``pagedrs.kernels.loader.KernelRuntime``) runs the kernels: CuPy on a
GPU by default; the tests pass the CPU emulator of ``tests/cuda_emu``, which runs
this very class, its planning and ``ops`` on CPU tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.attention.kv_quant import KvScales, is_fp8
from pagedrs.kernels import loader, ops
from pagedrs.kernels.dispatch import VARIANTS
from pagedrs.kernels.planning import (
    ROWS_PER_ITEM,
    RULES,
    SplitPlan,
    SplitRule,
    plan_fixed_split,
    plan_split,
    visible_keys,
    work_items,
)

# v2 for decode rows: on an H200 (2026-11-30, benches/gpu_kernels.py) it read KV at 60% of copy bandwidth
# at 64 x 4096 against v1's 28% (2.16x; 2.44x at 64 x 16384, 1.5-3.1x elsewhere), outputs within bf16
# rounding of v1 and SDPA. Prefill chunks stay on v1 in either case.
DEFAULT_VARIANT = "v2"
# v2's L2 prefetch distance in chunks past the next one (0: none); the same run measured 1, 2 and 4
# chunks 3-34% slower than none at every size, so none it is
DEFAULT_V2_PREFETCH = 0


@dataclass(frozen=True)
class _StepPlan:
    meta: AttentionMetadata  # the step this plan belongs to
    owner: Any  # the backend that made it (plans depend on its SM count)
    group: int
    # (variant, int32 [num_items, 2] work items on the device) per launch of the step, in order
    launches: tuple[tuple[str, torch.Tensor], ...]
    num_blocks: int  # thread blocks of a single pass of the first launch: work items x KV heads
    num_sms: int
    rule: SplitRule
    # sliding window (None: full causal) -> split-K plan over the keys a block reads;
    # filled by the first layer of the step that attends with that window
    splits: dict[int | None, SplitPlan] = field(default_factory=dict)
    # A padded decode plan (plan_padded_decode): the split covers this many keys whatever the
    # step's contexts, and its split-K partials live in buffers kept here (by num_parts), so a
    # CUDA graph captured with this plan finds the same grid, arguments and buffers at replay.
    fixed_keys: int | None = None
    split_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def static_split_buffers(self, split: SplitPlan, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fixed plan's split-K partials for ``split`` (shared by every layer: they run one after
        another on one stream); None for a per-step plan, whose launches allocate their own."""
        if self.fixed_keys is None or split.num_parts == 1:
            return None
        buffers = self.split_buffers.get(split.num_parts)
        if buffers is None:
            tokens, heads, head_size = query.shape
            buffers = self.split_buffers[split.num_parts] = ops.split_buffers_for(
                tokens, heads, split.num_parts, head_size, query.device)
        return buffers

    @property
    def work_items(self) -> torch.Tensor:
        """The first launch's work items (the only launch of a decode-only step)."""
        return self.launches[0][1]

    @property
    def split(self) -> SplitPlan:
        """The plan of full causal attention."""
        return self.split_for(None)

    def split_for(self, sliding_window: int | None) -> SplitPlan:
        split = self.splits.get(sliding_window)
        if split is None and self.fixed_keys is not None:
            split = plan_fixed_split(self.num_blocks, self.fixed_keys, self.num_sms, self.rule, sliding_window)
            self.splits[sliding_window] = split
        elif split is None:
            meta = self.meta
            starts = meta.query_start_loc_cpu
            q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
            keys = visible_keys(meta.seq_lens_cpu, q_lens, sliding_window)
            # Split-K only pays off for decode; prefill chunks already bring many rows per sequence.
            split = (
                plan_split(self.num_blocks, keys, self.num_sms, self.rule)
                if meta.is_decode_only
                else SplitPlan(num_parts=1, part_tokens=keys)
            )
            self.splits[sliding_window] = split
        return split


class CudaAttentionBackend(AttentionBackend):
    name = "cuda"
    reads_fp8 = True
    supports_decode_graphs = True

    def __init__(
        self,
        num_sms: int | None = None,
        runtime: loader.KernelRuntime | None = None,
        variant: str | None = None,
        split_rule: SplitRule | None = None,  # the split-K rule's numbers; None: the variant's (planning.RULES)
        v2_prefetch: int | None = None,  # None: $PAGEDRS_V2_PREFETCH, else DEFAULT_V2_PREFETCH
        kv_scales: KvScales | None = None,  # an fp8 cache's (k_scale, v_scale); None: 1.0 (kv_quant)
    ) -> None:
        super().__init__(kv_scales)
        variant = variant if variant is not None else os.environ.get("PAGEDRS_ATTENTION_KERNEL") or DEFAULT_VARIANT
        if variant not in VARIANTS:
            raise ValueError(
                f"attention kernel variant={variant!r} (argument or PAGEDRS_ATTENTION_KERNEL); expected one of {list(VARIANTS)}"
            )
        self.variant = variant
        self._split_rule = split_rule if split_rule is not None else RULES[variant]
        if v2_prefetch is None:
            env = os.environ.get("PAGEDRS_V2_PREFETCH", "")
            if env and not env.isdigit():
                raise ValueError(f"PAGEDRS_V2_PREFETCH={env!r} must be a non-negative number of chunks")
            v2_prefetch = int(env) if env else DEFAULT_V2_PREFETCH
        self.v2_prefetch = v2_prefetch
        self._num_sms = num_sms  # None: read from the device on first use
        self._runtime = runtime if runtime is not None else loader.CUPY
        self._swap_streams: dict[torch.device, Any] = {}  # device -> the runtime's side stream for swaps
        self._padded_plans: dict[tuple[Any, ...], _StepPlan] = {}  # plan_padded_decode's, one per capture size

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        k_scale, v_scale = self._scales(key_cache)
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, self._runtime, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # attend to the last W positions only (Mistral); None = all
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim] of the kernels' dtype; allocated when None
    ) -> torch.Tensor:
        group = query.shape[1] // key_cache.shape[2]
        plan = meta.plan  # planned once by the runner; direct callers plan here
        if not (isinstance(plan, _StepPlan) and plan.group == group and plan.owner is self):
            plan = self.plan(meta, key_cache.shape[1], query.shape[1], key_cache.shape[2])
        if out is None:  # the cache's dtype; with an fp8 cache the queries'
            out = torch.empty(query.shape, dtype=query.dtype if is_fp8(key_cache.dtype) else key_cache.dtype,
                              device=query.device)  # fmt: skip
        split = plan.split_for(sliding_window)
        k_scale, v_scale = self._scales(key_cache)
        buffers = plan.static_split_buffers(split, query)
        for variant, items in plan.launches:
            ops.paged_attention(
                out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                items, scale, split, self._runtime, sliding_window, variant, self.v2_prefetch, k_scale, v_scale, buffers,
            )  # fmt: skip
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def check_kv_cache_dtype(self, dtype: torch.dtype, model_dtype: torch.dtype | None = None) -> None:
        """The kernels read pages in the model's dtype or fp8: 16-bit pages of another dtype's model
        (kv_cache_dtype="bfloat16" with a float16 or float32 model) are refused before any request,
        never read as what they are not (no GPU run has checked such a mix)."""
        super().check_kv_cache_dtype(dtype, model_dtype)
        if not is_fp8(dtype) and model_dtype is not None and dtype != model_dtype:
            raise ValueError(f"kv_cache_dtype: the CUDA kernels read pages in the model's dtype ({model_dtype}) or fp8, "
                             f"not {dtype} pages of a {model_dtype} model; use kv_cache_dtype='auto' (or dtype='bfloat16' "
                             "for bfloat16 pages)")

    def plan(self, meta: AttentionMetadata, block_size: int, num_heads: int, num_kv_heads: int) -> _StepPlan:
        """The step's work items, made once and kept on ``meta.plan`` (its split-K plan for
        each window is made by the first layer that attends with it: ``split_for``)."""
        group = num_heads // num_kv_heads
        if isinstance(meta.plan, _StepPlan) and meta.plan.group == group and meta.plan.owner is self:
            return meta.plan
        device = meta.block_tables.device
        starts = meta.query_start_loc_cpu
        q_lens = np.array([starts[i + 1] - starts[i] for i in range(meta.num_seqs)], dtype=np.int64)
        if self.variant == "v1" or meta.is_decode_only:
            groups = [(self.variant, np.arange(meta.num_seqs))]
        else:  # decode tokens to v2, prefill chunks to v1
            groups = [("v2", np.flatnonzero(q_lens == 1)), ("v1", np.flatnonzero(q_lens > 1))]
        launches = []
        for variant, seqs in groups:
            if len(seqs):
                items = work_items(q_lens[seqs], group, ROWS_PER_ITEM[variant], seqs)
                launches.append((variant, torch.from_numpy(items).to(device)))
        if self._num_sms is None:
            self._num_sms = self._runtime.num_sms(device)
        num_blocks = launches[0][1].shape[0] * num_kv_heads
        meta.plan = _StepPlan(meta, self, group, tuple(launches), num_blocks, self._num_sms, self._split_rule)
        return meta.plan

    def _scales(self, cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scale tensors ``ops`` takes: the backend's for an fp8 cache, none for any other."""
        return self.kv_scales(cache.device) if is_fp8(cache.dtype) else (None, None)

    def plan_padded_decode(self, meta: AttentionMetadata, block_size: int, num_heads: int, num_kv_heads: int,
                           max_keys: int) -> _StepPlan:
        """The plan of a padded decode step of ``meta.num_seqs`` rows (a capture size), the same object
        for every step of that size: its work items (on the device), its split over ``max_keys``
        (``planning.plan_fixed_split``) and its split-K buffers do not depend on the step's contexts."""
        group = num_heads // num_kv_heads
        key = (meta.num_seqs, group, num_kv_heads, max_keys, meta.block_tables.device)
        plan = self._padded_plans.get(key)
        if plan is None:
            if not meta.is_decode_only:
                raise ValueError(f"plan_padded_decode needs a decode-only step; max_query_len={meta.max_query_len}")
            items = work_items(np.ones(meta.num_seqs, dtype=np.int64), group, ROWS_PER_ITEM[self.variant])
            if self._num_sms is None:
                self._num_sms = self._runtime.num_sms(meta.block_tables.device)
            launches = ((self.variant, torch.from_numpy(items).to(meta.block_tables.device)),)
            plan = self._padded_plans[key] = _StepPlan(
                meta, self, group, launches, items.shape[0] * num_kv_heads, self._num_sms, self._split_rule,
                fixed_keys=max_keys)
        meta.plan = plan
        return plan

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

