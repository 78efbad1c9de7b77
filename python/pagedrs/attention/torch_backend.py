"""TorchAttentionBackend: paged attention in plain PyTorch, on the CPU and on CUDA.

This is the reference the CUDA kernels are compared with, and the CPU path. K/V are
scattered into their slots with one ``index_copy_``. Attention runs as a few padded,
masked ``scaled_dot_product_attention`` calls per layer, never one per sequence: the
step's sequences are grouped into buckets of similar query length and context length
(within 2x), and each bucket gathers its queries into ``[S, max_q]`` and its pages into
``[S, max_kv]`` and attends in one call. Decode tokens (q = 1) and prefill chunks
(varlen q) go through the same code. Which rows go where, and the masks, depend only on
the step, so they are planned once per step (``plan``) and reused by every layer.

Bucket of S sequences, query rows padded to ``max_q`` by repeating the last real row
(a padded row attends to something, so it never produces NaN; its output is dropped)::

    rows  [S, max_q]   seq 0: q0 q1 q2 q2      keys [S, max_kv]: pages of each sequence, in order
                       seq 1: q0 q0 q0 q0      mask [S, 1, max_q, max_kv]: causal at each row's position,
                                                and nothing past the sequence's length

Keys past a sequence's length (a page's unwritten tail, a bucket's padding pages) are masked and, in
the gathered copies, zeroed (``stale_keys``: a NaN a page's last owner left there, times its zero
weight, was NaN).

Short multi-row queries (``1 < max_q <= ROWWISE_MAX_Q``: a speculative verification's k + 1 rows,
a small prefill remainder) attend row by row with decode's numerics: SDPA's CPU kernel computes a
row differently alone than in a block of rows (its GEMMs change with the row count), and greedy
decoding with speculation must pick what sequential decode picks, even at a bf16 tie of two
logits. Each row becomes its own query head of length 1 (GQA maps the heads of one KV head
together), so the bucket's pages are still gathered once (``_attend_rowwise``).

A sliding window ``W`` (Mistral) narrows each row to transformers' rule, the last
``W`` positions including its own: key ``k`` is visible to query ``q`` when
``q - W < k <= q``. Pages wholly before every row's window are not gathered.

An fp8 cache (``kv_quant``): ``write_kv`` quantizes the new rows (``kv_quant.quantize``, the
kernels' bits) and scatters their bytes; attention dequantizes only the pages it gathers, into
the query's dtype. Copies and swaps move bytes (CPU torch has no ``index_copy_`` for fp8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.attention.cascade import Cascade, attend_cascade, plan_cascade
from pagedrs.attention.kv_quant import KvScales, dequantize, is_fp8, quantize
from pagedrs.attention.stale_keys import stale_rows, zero_stale


@dataclass(frozen=True)
class _Bucket:
    rows: torch.Tensor  # int64 [S, max_q]  query row of each (sequence, slot); padding repeats the last row
    out_rows: torch.Tensor  # int64 [R]  rows of the step's output this bucket fills (R real rows)
    keep: torch.Tensor | None  # int64 [R]  positions in the flattened [S * max_q] result to keep; None = all
    tables: torch.Tensor  # int64 [S, num_blocks]  pages to gather
    mask: torch.Tensor  # bool [S, 1, max_q, num_blocks * block_size]  True = may attend
    cascade: Cascade | None = None  # decode buckets whose sequences share prefix pages (attention/cascade.py)
    stale: torch.Tensor | None = None  # int64 [N]  gathered key rows past their sequence's end (stale_keys); None: none
    rows_are_all: bool = False  # rows is arange(T) as [T, 1] (the step is this bucket's decode tokens): no gather
    rowwise: bool = False  # short query rows (speculative verification): each attends as a decode row would


@dataclass(frozen=True)
class _StepPlan:
    meta: AttentionMetadata  # the step this plan belongs to
    block_size: int
    buckets: list[_Bucket]  # full causal attention
    # per sliding window: made by the first layer of the step that attends with it
    by_window: dict[int, list[_Bucket]] = field(default_factory=dict)

    def windowed(self, sliding_window: int) -> list[_Bucket]:
        buckets = self.by_window.get(sliding_window)
        if buckets is None:
            buckets = self.by_window[sliding_window] = _plan_buckets(self.meta, self.block_size, sliding_window)
        return buckets


# The longest query a bucket attends row by row: a verification of up to 16 speculative tokens
# (``SpeculativeConfig``'s bound) plus its bonus row. Longer queries (prompts) keep the blocked kernel.
ROWWISE_MAX_Q = 17


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (same bytes), for the indexed copies CPU torch lacks for fp8; others as they are."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    reads_fp8 = True

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        # [num_blocks, block_size, h, d] -> [num_slots, h, d]; slot = block * block_size + offset.
        num_kv_heads, head_dim = key_cache.shape[-2:]
        if is_fp8(key_cache.dtype):
            k_scale, v_scale = self.kv_scales(key_cache.device)
            key = quantize(key, k_scale, key_cache.dtype).view(torch.uint8)
            value = quantize(value, v_scale, value_cache.dtype).view(torch.uint8)
            key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        elif key.dtype != key_cache.dtype:  # (a no-op .to() still costs a call per layer)
            key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    def plan(self, meta: AttentionMetadata, block_size: int, num_heads: int = 0, num_kv_heads: int = 0) -> _StepPlan:
        """Buckets, gather indices and masks of this step (made once, kept on ``meta.plan``; every layer reuses them)."""
        if not (isinstance(meta.plan, _StepPlan) and meta.plan.block_size == block_size):
            meta.plan = _StepPlan(meta, block_size, _plan_buckets(meta, block_size))
        return meta.plan

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # attend to the last W positions only (Mistral); None = all
    ) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        planned = meta.plan if isinstance(meta.plan, _StepPlan) and meta.plan.block_size == block_size else None
        plan = planned or self.plan(meta, block_size)  # planned by the runner; direct callers plan here
        buckets = plan.buckets if sliding_window is None else plan.windowed(sliding_window)
        scales = self.kv_scales(key_cache.device) if is_fp8(key_cache.dtype) else None
        if len(buckets) == 1 and buckets[0].keep is None and buckets[0].rows.shape[0] == query.shape[0]:
            return _attend(query, key_cache, value_cache, buckets[0], scale, scales)  # all decode, one bucket
        out = torch.empty_like(query)
        for b in buckets:
            o = _attend(query, key_cache, value_cache, b, scale, scales)
            out.index_copy_(0, b.out_rows, o if b.keep is None else o.index_select(0, b.keep))
        return out

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        pairs = pairs.to(kv_cache.device)
        kv_cache = _bytes(kv_cache)
        # index_select makes a copy first, so a block that is both a source and a destination is safe.
        kv_cache.index_copy_(2, pairs[:, 1], kv_cache.index_select(2, pairs[:, 0]))

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        # Only a host-to-device copy may be asynchronous: a device-to-host one with
        # non_blocking=True could be read on the host before it has landed.
        if src_cache.dtype != dst_cache.dtype:
            raise ValueError(f"swap between caches of {src_cache.dtype} and {dst_cache.dtype}: pages are moved, never converted")
        src_cache, dst_cache = _bytes(src_cache), _bytes(dst_cache)
        moved = src_cache.index_select(2, pairs[:, 0].to(src_cache.device))
        moved = moved.to(dst_cache.device, non_blocking=dst_cache.device.type == "cuda")
        dst_cache.index_copy_(2, pairs[:, 1].to(dst_cache.device), moved)


def _plan_buckets(meta: AttentionMetadata, block_size: int, sliding_window: int | None = None) -> list[_Bucket]:
    """Groups sequences whose query lengths and context lengths (in blocks) are within 2x of each other.

    Every sequence of a bucket is padded to the bucket's longest query and context; with
    long-tailed lengths one bucket would gather and attend over mostly padding. Doubling
    buckets keep the padded work under about four times the real work (2x in each
    dimension), in a handful of calls per layer.
    """
    decode_only = meta.query_start_loc_cpu == list(range(len(meta.seq_lens_cpu) + 1))
    if sliding_window is None and decode_only and not _may_share_pages(meta):
        return _plan_decode_buckets(meta, block_size)
    return _plan_buckets_loop(meta, block_size, sliding_window)


def _plan_buckets_loop(meta: AttentionMetadata, block_size: int, sliding_window: int | None = None) -> list[_Bucket]:
    """``_plan_buckets`` for any step (prefill chunks, windows, shared pages), one sequence at a time."""
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    device = meta.block_tables.device
    buckets: list[_Bucket] = []
    decode = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    if sliding_window is None and device.type == "cpu" and len(decode) > 1:
        # Decode rows whose pages are shared attend them once (attention/cascade.py): one
        # bucket for all of them, its own pages bucketed inside by own length.
        host_tables = meta.block_tables.tolist()
        tables = [host_tables[i][: -(-seq_lens[i] // block_size)] for i in decode]
        cascade = plan_cascade(tables, [seq_lens[i] for i in decode], block_size, device)
        if cascade is not None:
            decode_rows = torch.tensor([starts[i] for i in decode], device=device)
            nothing = torch.empty(0, device=device)
            buckets.append(_Bucket(rows=decode_rows[:, None], out_rows=decode_rows, keep=None, tables=nothing,
                                   mask=nothing, cascade=cascade))
    planned = set(decode) if buckets else set()
    groups: dict[tuple[int, int], list[int]] = {}
    for i, seq_len in enumerate(seq_lens):
        if i in planned:
            continue
        q_len = starts[i + 1] - starts[i]
        blocks = -(-seq_len // block_size)
        groups.setdefault((q_len.bit_length(), blocks.bit_length()), []).append(i)
    for key in sorted(groups):
        seqs = groups[key]
        q_lens = [starts[i + 1] - starts[i] for i in seqs]
        max_q = max(q_lens)
        num_blocks = -(-max(seq_lens[i] for i in seqs) // block_size)
        # with a window, pages before the earliest visible key of every sequence are not gathered:
        # gathering starts at page `skip` of each table (the same count for the whole bucket)
        skip = 0
        if sliding_window is not None:
            first_visible = [seq_lens[i] - q - sliding_window + 1 for i, q in zip(seqs, q_lens, strict=True)]
            skip = max(min(first_visible), 0) // block_size
        rows = [[starts[i] + min(j, q - 1) for j in range(max_q)] for i, q in zip(seqs, q_lens, strict=True)]
        out_rows = [starts[i] + j for i, q in zip(seqs, q_lens, strict=True) for j in range(q)]
        keep = None
        if any(q != max_q for q in q_lens):
            keep = torch.tensor([s * max_q + j for s, q in enumerate(q_lens) for j in range(q)], device=device)
        index = torch.tensor(seqs, device=device)
        lens = meta.seq_lens[index].long()[:, None, None]  # [S, 1, 1]
        first_pos = lens - torch.tensor(q_lens, device=device)[:, None, None]  # position of each first new token
        q_pos = first_pos + torch.arange(max_q, device=device)[None, :, None]  # [S, max_q, 1]
        k_pos = torch.arange(skip * block_size, num_blocks * block_size, device=device)[None, None, :]
        mask = (k_pos <= q_pos) & (k_pos < lens)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window  # transformers' sliding_window_overlay
        buckets.append(_Bucket(
            rows=torch.tensor(rows, device=device),
            rows_are_all=max_q == 1 and len(seqs) == len(seq_lens) and seqs == list(range(len(seqs))),
            rowwise=1 < max_q <= ROWWISE_MAX_Q,
            out_rows=torch.tensor(out_rows, device=device),
            keep=keep,
            # -1 marks a page the core released out of the window (fully masked here): read page 0
            tables=meta.block_tables[index, skip:num_blocks].long().clamp_min(0),
            mask=mask[:, None],
            stale=stale_rows(mask.any(dim=1)),  # keys no row of the sequence reads (a released page's too)
        ))
    return buckets


def _may_share_pages(meta: AttentionMetadata) -> bool:
    """Whether the cascade path may apply (CPU, two or more sequences whose first pages are the same):
    ``plan_cascade`` groups sequences by their first page, and without a shared one it plans nothing."""
    tables = meta.block_tables
    if tables.device.type != "cpu" or tables.shape[0] < 2 or tables.shape[1] == 0:
        return False
    first = [page for page in tables.numpy()[:, 0].tolist() if page >= 0]  # -1: a page out of a window
    return len(set(first)) < len(first)


def _plan_decode_buckets(meta: AttentionMetadata, block_size: int) -> list[_Bucket]:
    """``_plan_buckets`` of a decode-only step without a window and without shared pages, with
    NumPy instead of a Python loop over the batch: the same buckets (sequences grouped by the
    bit length of their block counts, in ascending order) holding the same tensors.

    Every query length is 1, so row i of the step is sequence i's one token, and the causal
    mask of a bucket is "key position < length"."""
    lens_list = meta.seq_lens_cpu
    device = meta.block_tables.device
    if not lens_list:
        return []
    shortest, longest = -(-min(lens_list) // block_size), -(-max(lens_list) // block_size)
    if shortest.bit_length() == longest.bit_length():  # one bucket, every sequence (a steady batch)
        return [_whole_decode_bucket(meta, block_size, longest)]
    lens = np.asarray(lens_list, dtype=np.int64)
    blocks = -(-lens // block_size)
    keys = np.frexp(blocks.astype(np.float64))[1]  # int.bit_length of each count (exact below 2**53)
    buckets = []
    for key in np.unique(keys):  # ascending, as sorted(groups)
        seqs = np.flatnonzero(keys == key)
        every = len(seqs) == len(lens)  # seqs ascending: then they are arange(S), and nothing is gathered
        num_blocks = int(blocks[seqs].max())
        index = torch.from_numpy(seqs).to(device)
        seq_lens = (meta.seq_lens if every else meta.seq_lens[index]).long()[:, None, None]  # [S, 1, 1]
        tables = meta.block_tables[:, 0:num_blocks] if every else meta.block_tables[index, 0:num_blocks]
        k_pos = torch.arange(0, num_blocks * block_size, device=device)[None, None, :]
        mask = k_pos < seq_lens
        buckets.append(_Bucket(
            rows=index[:, None],
            rows_are_all=every,
            out_rows=index,
            keep=None,
            tables=tables.long().clamp_min(0),
            mask=mask[:, None],
            stale=stale_rows(mask[:, 0]),
        ))
    return buckets


def _whole_decode_bucket(meta: AttentionMetadata, block_size: int, num_blocks: int) -> _Bucket:
    """``_plan_decode_buckets``' one bucket when every sequence falls in it: the same tensors, in the
    fewest ops (a batch-32 step's plan was ~0.1 ms of host time, cold, in ~20 small ops)."""
    num_seqs = len(meta.seq_lens_cpu)
    device = meta.block_tables.device
    index, rows = _arange_rows(num_seqs, device)
    if device.type == "cpu":  # the same tensor from NumPy: a few torch calls fewer, each ~3 us cold
        tables = torch.from_numpy(np.maximum(meta.block_tables.numpy()[:, 0:num_blocks], 0).astype(np.int64))
    else:
        tables = meta.block_tables[:, 0:num_blocks].long().clamp_min(0)
    mask = _key_mask(meta, num_blocks * block_size)
    return _Bucket(rows=rows, rows_are_all=True, out_rows=index, keep=None, tables=tables, mask=mask,
                   stale=stale_rows(mask[:, 0, 0]))


def _key_mask(meta: AttentionMetadata, num_keys: int) -> torch.Tensor:
    """bool [S, 1, 1, num_keys]: key position < the sequence's length (a decode row's causal mask);
    made in NumPy on the CPU (one call instead of a mixed-dtype torch comparison's few)."""
    device = meta.seq_lens.device
    if device.type == "cpu":
        return torch.from_numpy((np.arange(num_keys)[None, :] < meta.seq_lens.numpy()[:, None])[:, None, None, :])
    return (_arange(num_keys, device) < meta.seq_lens[:, None])[:, None, None, :]


# length and device -> (torch.arange(n), the same as a column [n, 1])
_ARANGES: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _arange_rows(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.arange(n)`` (int64) and its column view ``[:, None]``, made once per length and device
    and shared: read-only by every user."""
    key = (n, str(device))
    pair = _ARANGES.get(key)
    if pair is None:
        if len(_ARANGES) > 4096:  # lengths are bounded by max_num_seqs and the longest table; a guard only
            _ARANGES.clear()
        t = torch.arange(n, device=device)
        pair = _ARANGES[key] = (t, t[:, None])
    return pair


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64), shared (``_arange_rows``)."""
    return _arange_rows(n, device)[0]


def _attend(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, bucket: _Bucket, scale: float,
    kv_scales: KvScales | None = None,  # an fp8 cache's (k_scale, v_scale); None: the cache holds real values
) -> torch.Tensor:
    if bucket.cascade is not None:
        return attend_cascade(query, key_cache, value_cache, bucket.rows[:, 0], bucket.cascade, scale, kv_scales)
    return _attend_bucket(query, key_cache, value_cache, bucket, scale, kv_scales)


def _attend_bucket(
    query: torch.Tensor,  # [T, h, d]: the whole step's queries
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    value_cache: torch.Tensor,
    bucket: _Bucket,
    scale: float,
    kv_scales: KvScales | None = None,
) -> torch.Tensor:  # [S * max_q, h, d]: row s * max_q + j is slot j of the bucket's sequence s
    """One padded, masked SDPA over the bucket's sequences and their pages."""
    num_seqs, max_q = bucket.rows.shape
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    keys = bucket.tables.shape[1] * block_size
    q = query.unsqueeze(1) if bucket.rows_are_all else query[bucket.rows]  # [S, max_q, h, d]
    pages = bucket.tables.view(-1)  # index_select over a flat index: about half of advanced indexing's cost
    k = key_cache.index_select(0, pages).view(num_seqs, keys, num_kv_heads, head_dim)
    v = value_cache.index_select(0, pages).view(num_seqs, keys, num_kv_heads, head_dim)
    if kv_scales is not None:  # fp8 pages: only the gathered ones are widened
        k, v = dequantize(k, kv_scales[0], query.dtype), dequantize(v, kv_scales[1], query.dtype)
    elif k.dtype != query.dtype:  # 16-bit pages of a float32 model (kv_cache_dtype="bfloat16"): exact widening
        k, v = k.to(query.dtype), v.to(query.dtype)
    zero_stale(k, v, bucket.stale)
    if bucket.rowwise:
        return _attend_rowwise(q, k, v, bucket.mask, scale)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bucket.mask, scale=scale, enable_gqa=True
    )  # [S, h, max_q, d]
    return o.transpose(1, 2).reshape(num_seqs * max_q, *query.shape[1:])


def _attend_rowwise(
    q: torch.Tensor,  # [S, max_q, h, d]
    k: torch.Tensor,  # [S, keys, kv_heads, d]: the bucket's gathered pages
    v: torch.Tensor,
    mask: torch.Tensor,  # bool [S, 1, max_q, keys]
    scale: float,
) -> torch.Tensor:  # [S * max_q, h, d]
    """Each query row as a one-row query head, so SDPA computes it exactly as a decode step would.

    Heads are ordered (kv head, query head of its group, row): GQA then maps the ``group * max_q``
    heads of one KV head to it, and each (row, head) is a length-1 query with its own mask row.
    Bit-equal to one-row decode of each position (tests/test_spec_exact.py): at one torch thread (the
    engine's default) the kernel's result for a row depends neither on the other heads nor on masked keys
    past the row's context. At more, a row a worker thread computes gets other low bits than on the
    calling thread (measured, torch 2.15 CPU), so no row-by-row scheme is bit-equal there."""
    num_seqs, max_q, num_heads, head_dim = q.shape
    keys = k.shape[1]
    qh = q.permute(0, 2, 1, 3).reshape(num_seqs, num_heads * max_q, 1, head_dim)  # heads (kv, group, row)
    mh = mask.expand(num_seqs, num_heads, max_q, keys).reshape(num_seqs, num_heads * max_q, 1, keys)
    o = F.scaled_dot_product_attention(
        qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mh, scale=scale, enable_gqa=True
    )  # [S, h * max_q, 1, d]
    return o.view(num_seqs, num_heads, max_q, head_dim).transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
