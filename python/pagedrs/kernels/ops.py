"""The kernels as functions of torch tensors: argument checks, grids, launches.

Host code plans (work items, split-K) and checks shapes; the kernels compute.
Every function launches on torch's current stream and returns without syncing.
``runtime`` runs the kernels (``loader.CUPY`` on a GPU; the tests pass the CPU emulator).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedrs.kernels import loader
from pagedrs.kernels.dispatch import COPY_BLOCKS, FP8_CACHE_TYPES, KernelEntry, dtype_name, lookup
from pagedrs.kernels.planning import MAX_PARTS, SplitPlan

_ATTN_THREADS = 128  # kThreads in cuda/paged_attention.cu
_MAX_PITCH = 2**31 - 1  # conservative cudaMemcpy2D pitch limit
# part_tokens of a single pass: more than any sequence's keys, and a block's first key
# plus it still fits the kernel's int (its first key is a position below 2**30)
_ONE_PASS_TOKENS = 2**30


def _rows_ok(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` with contiguous 16-byte-aligned rows (token stride may be larger, e.g. a slice of fused qkv)."""
    vec = 16 // t.element_size()
    heads_packed = t.dim() < 3 or t.stride(-2) == t.shape[-1]
    aligned = t.stride(-1) == 1 and heads_packed and t.stride(0) % vec == 0 and t.data_ptr() % 16 == 0
    if not aligned:
        t = t.contiguous()
    if t.data_ptr() % 16 or t.shape[-1] % vec:
        raise ValueError(f"{what}: head_dim {t.shape[-1]} of {t.dtype} is not a whole number of 16-byte vectors")
    return t


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}  # device -> float32 [1] holding 1.0 (16-bit caches)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is an 8-bit cache the kernels convert (dispatch.FP8_CACHE_TYPES)."""
    return dtype_name(dtype) in FP8_CACHE_TYPES


def _entry(x: torch.Tensor, cache: torch.Tensor, head_size: int, block_size: int) -> tuple[KernelEntry, torch.dtype]:
    """The dispatch entry for inputs ``x`` (queries, or new K/V) over ``cache``, and the dtype ``x`` is passed in:
    the cache's own for a 16-bit or float32 cache (converted as before), ``x``'s for an fp8 cache."""
    if is_fp8(cache.dtype):
        return lookup(x.dtype, head_size, block_size, cache_dtype=cache.dtype), x.dtype
    return lookup(cache.dtype, head_size, block_size), cache.dtype


def _scale_args(entry: KernelEntry, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                device: torch.device) -> tuple[np.uint64, np.uint64]:
    """Pointers to the per-tensor K and V scales: an fp8 cache needs both (float32, one element, on the
    cache's device); any other cache takes none and gets 1.0 (an exact multiply)."""
    if not entry.is_fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for an fp8 cache; this cache is {entry.cache}")
        unit = _UNIT_SCALES.get(device)
        if unit is None:
            unit = _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
        return loader.ptr(unit), loader.ptr(unit)
    ptrs = []
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
            got = "None" if t is None else f"{t.dtype} of {t.numel()} elements on {t.device}"
            raise ValueError(f"{name} of a {entry.cache} cache must be a float32 tensor of one element on {device}; got {got}")
        ptrs.append(loader.ptr(t))
    return ptrs[0], ptrs[1]


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], fully written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    work_items: torch.Tensor,  # int32 [num_items, 2] from planning.work_items, on the device
    scale: float,
    plan: SplitPlan,
    runtime: loader.KernelRuntime = loader.CUPY,
    sliding_window: int | None = None,  # the token at position p sees keys (p - W, p]; None: all
    variant: str = "v1",  # the attention kernel (dispatch.VARIANTS)
    prefetch_chunks: int = 0,  # v2: L2 prefetch distance in chunks past the next (0: none); ignored by v1
    k_scale: torch.Tensor | None = None,  # float32 [1]: an fp8 cache's per-tensor scales (stored x = x / scale)
    v_scale: torch.Tensor | None = None,
    # split-K partials (float32 [num_tokens, num_heads, num_parts, head_size], [..., 2]) to reuse; None:
    # allocated here. A CUDA graph needs the same buffers at every replay (split_buffers below).
    split_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Causal attention of every new token over its pages; split-K when ``plan.num_parts > 1``.

    ``work_items`` must be chunked by the variant's rows per block
    (``planning.work_items(..., rows=planning.ROWS_PER_ITEM[variant])``): a kernel serves
    at most its own number of rows from an item and would leave the rest unwritten.
    Rows of sequences no item names are not written either (a step may launch twice,
    one variant for its decode tokens and the other for its prefill chunks).

    With ``sliding_window`` the kernel reads no page wholly before the window of a
    thread block's first row, so ``plan`` must come from ``planning.visible_keys`` of the
    same window (its partitions count keys from there, not from position 0).
    """
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int (positions a token sees) or None")
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_tokens, num_heads, _ = query.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not (1 <= plan.num_parts <= MAX_PARTS):
        raise ValueError(f"plan.num_parts={plan.num_parts} must be in [1, {MAX_PARTS}]")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("work_items", work_items)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor, got {t.dtype} contiguous={t.is_contiguous()}")
    entry, io_dtype = _entry(query, key_cache, head_size, block_size)
    if not (out.is_contiguous() and out.shape == query.shape and out.dtype == io_dtype):
        raise ValueError(f"out must be contiguous {tuple(query.shape)} {io_dtype}, got {tuple(out.shape)} {out.dtype}")
    if block_tables.shape[1] * block_size > _ONE_PASS_TOKENS:
        raise ValueError(f"block_tables of {block_tables.shape[1]} pages of {block_size} tokens exceed the kernels' "
                         f"{_ONE_PASS_TOKENS} positions per sequence")  # fmt: skip
    device = query.device
    scales = _scale_args(entry, k_scale, v_scale, key_cache.device)
    query = _rows_ok(query.to(io_dtype), "query")
    group = num_heads // num_kv_heads
    grid = (num_kv_heads, work_items.shape[0], plan.num_parts)
    if work_items.shape[0] == 0:
        return
    if plan.num_parts > 1 and split_buffers is not None:
        part_out, part_ml = split_buffers
        want = ((num_tokens, num_heads, plan.num_parts, head_size), (num_tokens, num_heads, plan.num_parts, 2))
        got = (tuple(part_out.shape), tuple(part_ml.shape))
        if got != want or part_out.dtype != torch.float32 or part_ml.dtype != torch.float32 or not (
            part_out.is_contiguous() and part_ml.is_contiguous()
        ):
            raise ValueError(f"split_buffers must be contiguous float32 of shapes {want}, got {got} "
                             f"{part_out.dtype}/{part_ml.dtype}")  # fmt: skip
    elif plan.num_parts > 1:
        part_out, part_ml = split_buffers_for(num_tokens, num_heads, plan.num_parts, head_size, device)
    else:
        part_out = part_ml = out  # never touched by the single-pass kernel
    fn = runtime.kernel(entry, entry.attention_kernel(variant), device)
    args: tuple[Any, ...] = (
        loader.ptr(out), loader.ptr(part_out), loader.ptr(part_ml), loader.ptr(query),
        loader.ptr(key_cache), loader.ptr(value_cache), loader.ptr(block_tables), loader.ptr(seq_lens),
        loader.ptr(query_start_loc), loader.ptr(work_items), loader.i32(block_tables.shape[1]),
        loader.i32(num_kv_heads), loader.i32(group), loader.i64(query.stride(0)), loader.f32(scale),
        loader.i32(plan.part_tokens if plan.num_parts > 1 else _ONE_PASS_TOKENS),
        loader.i32(0 if sliding_window is None else min(sliding_window, 2**31 - 1)),  # 0: no window
        *scales,
    )  # fmt: skip
    if variant == "v2":
        if isinstance(prefetch_chunks, bool) or not isinstance(prefetch_chunks, int) or not 0 <= prefetch_chunks <= 64:
            raise ValueError(f"prefetch_chunks={prefetch_chunks!r} must be an int in [0, 64]")
        args = (*args, loader.i32(prefetch_chunks))
    runtime.launch(fn, grid, (_ATTN_THREADS,), args, device)
    if plan.num_parts > 1:
        reduce = runtime.kernel(entry, entry.reduce, device)
        reduce_args = (loader.ptr(out), loader.ptr(part_out), loader.ptr(part_ml), loader.i32(plan.num_parts), loader.i32(head_size))
        runtime.launch(reduce, (num_heads, num_tokens), (128,), reduce_args, device)


def split_buffers_for(
    num_tokens: int, num_heads: int, num_parts: int, head_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh split-K partials for one launch: (part_out, part_ml) as ``paged_attention`` reads them."""
    part_out = torch.empty((num_tokens, num_heads, num_parts, head_size), dtype=torch.float32, device=device)
    part_ml = torch.empty((num_tokens, num_heads, num_parts, 2), dtype=torch.float32, device=device)
    return part_out, part_ml


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative slots are skipped
    runtime: loader.KernelRuntime = loader.CUPY,
    k_scale: torch.Tensor | None = None,  # float32 [1]: an fp8 cache stores key / k_scale (saturated)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatters the step's new K/V rows into their cache slots (an fp8 cache: quantized, see cuda/dtype.cuh)."""
    if key.shape[0] == 0:
        return
    _, block_size, num_kv_heads, head_size = key_cache.shape
    entry, io_dtype = _entry(key, key_cache, head_size, block_size)
    scales = _scale_args(entry, k_scale, v_scale, key_cache.device)
    key = _rows_ok(key.to(io_dtype).reshape(key.shape[0], -1), "key")
    value = _rows_ok(value.to(io_dtype).reshape(value.shape[0], -1), "value")
    slot_mapping = slot_mapping.to(device=key.device, dtype=torch.int64).contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    fn = runtime.kernel(entry, entry.reshape_and_cache, key.device)
    args = (
        loader.ptr(key_cache), loader.ptr(value_cache), loader.ptr(key), loader.ptr(value), loader.ptr(slot_mapping),
        loader.i64(key.stride(0)), loader.i64(value.stride(0)), loader.i32(num_kv_heads * head_size), *scales,
    )  # fmt: skip
    runtime.launch(fn, (key.shape[0],), (128,), args, key.device)


def _block_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """(planes = layers * 2, num_blocks, bytes per block) of ``[num_layers, 2, num_blocks, ...]``."""
    if cache.dim() < 3 or cache.shape[1] != 2 or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [num_layers, 2, num_blocks, ...] tensor, got {tuple(cache.shape)}")
    block_bytes = cache[0, 0, 0].numel() * cache.element_size()
    return cache.shape[0] * 2, cache.shape[2], block_bytes


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor, runtime: loader.KernelRuntime = loader.CUPY) -> None:
    """``kv_cache[:, :, dst] = kv_cache[:, :, src]`` for every (src, dst) pair, all layers in one launch."""
    if pairs.numel() == 0:
        return
    planes, num_blocks, block_bytes = _block_geometry(kv_cache)
    if block_bytes % 16:
        raise ValueError(f"a cache block is {block_bytes} bytes; copy_blocks needs a multiple of 16")
    pairs = pairs.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    fn = runtime.standalone_kernel(COPY_BLOCKS, kv_cache.device)
    args = (loader.ptr(kv_cache), loader.ptr(kv_cache), loader.ptr(pairs), loader.i64(block_bytes // 16),
            loader.i64(num_blocks), loader.i64(num_blocks))  # fmt: skip
    runtime.launch(fn, (pairs.shape[0], planes), (256,), args, kv_cache.device)


def contiguous_runs(pairs: np.ndarray) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs where both ids advance by one; sorted by src. Fewer, larger copies."""
    order = np.argsort(pairs[:, 0], kind="stable")
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs[order].tolist():
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def swap_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    pairs: torch.Tensor,
    side_stream: Any,  # a torch.cuda.Stream, or the runtime's own (runtime.new_stream)
    runtime: loader.KernelRuntime = loader.CUPY,
) -> None:
    """Blocks between the device cache and its pinned host mirror, on the copy engines.

    One cudaMemcpy2DAsync per run of consecutive blocks moves that run for every
    layer and K/V (rows = layers * 2, row pitch = a tier's plane). The copies run on
    ``side_stream``: it first waits for the compute stream's work so far (event),
    and the compute stream waits for the copies (event) before its next kernel.
    """
    if pairs.numel() == 0:
        return
    s_planes, s_blocks, block_bytes = _block_geometry(src_cache)
    d_planes, d_blocks, d_block_bytes = _block_geometry(dst_cache)
    if (s_planes, block_bytes) != (d_planes, d_block_bytes) or src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"swap between mismatched caches {tuple(src_cache.shape)} {src_cache.dtype} and {tuple(dst_cache.shape)} {dst_cache.dtype}")
    device = src_cache.device if src_cache.is_cuda else dst_cache.device
    compute = runtime.current_stream(device)
    side_stream.wait_stream(compute)
    s_pitch, d_pitch = s_blocks * block_bytes, d_blocks * block_bytes
    for src, dst, n in contiguous_runs(pairs.cpu().numpy()):
        s_ptr, d_ptr = src_cache.data_ptr() + src * block_bytes, dst_cache.data_ptr() + dst * block_bytes
        if max(s_pitch, d_pitch) <= _MAX_PITCH:
            runtime.memcpy_2d_async(d_ptr, d_pitch, s_ptr, s_pitch, n * block_bytes, s_planes, side_stream)
        else:  # one plane at a time
            for plane in range(s_planes):
                runtime.memcpy_2d_async(d_ptr + plane * d_pitch, n * block_bytes, s_ptr + plane * s_pitch, n * block_bytes, n * block_bytes, 1, side_stream)
    compute.wait_stream(side_stream)
