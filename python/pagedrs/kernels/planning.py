"""Host-side planning of one attention launch: work items and the split-K decision.

The rule (single pass or split-K):

* One thread block serves up to ``MAX_ROWS`` query rows of one KV head, so the
  single-pass grid has ``work_items × num_kv_heads`` blocks.
* If that grid already holds ``SINGLE_PASS_WAVES × num_sms`` blocks, or the
  longest context is at most ``SPLIT_MIN_CONTEXT`` tokens, run one pass: every
  SM has work and splitting would only add the reduce kernel's traffic.
* Otherwise cut the context into partitions so the grid reaches about
  ``TARGET_BLOCKS_PER_SM × num_sms`` blocks (a full wave at the kernel's
  occupancy), with no partition shorter than ``MIN_PART_TOKENS``.

Example (H100, 132 SMs; Llama-3-8B: 8 KV heads): batch 1 × 16384 tokens has 8
blocks -> split into 64 partitions of 256 tokens (512 blocks); batch 64 × 4096
has 512 blocks -> one pass.

With a sliding window W the kernel starts each block at the first key its first
row sees, so the key range to split is not the context but ``visible_keys``: at
most W for a decode token (Mistral's W = 4096 at 32k tokens of context: 4096
keys in 16 partitions of 256, not 32768 in 64 of 512).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_ROWS = 16  # kMaxRows in cuda/paged_attention.cu
MAX_PARTS = 1024  # kMaxParts in cuda/paged_attention.cu
SINGLE_PASS_WAVES = 2
SPLIT_MIN_CONTEXT = 1024
MIN_PART_TOKENS = 256  # a multiple of every kernel tile (16..128 tokens)
TARGET_BLOCKS_PER_SM = 4  # kMinBlocksPerSm in cuda/paged_attention.cu


@dataclass(frozen=True)
class SplitPlan:
    """How the key range is partitioned; ``num_parts == 1`` means the single-pass kernel."""

    num_parts: int
    part_tokens: int  # keys per partition (a multiple of MIN_PART_TOKENS when split)


def plan_split(num_blocks: int, max_context: int, num_sms: int) -> SplitPlan:
    """Applies the module's rule to a single-pass grid of ``num_blocks`` thread blocks."""
    if num_blocks <= 0 or max_context <= 0 or num_sms <= 0:
        raise ValueError(
            f"plan_split needs positive values, got num_blocks={num_blocks}, "
            f"max_context={max_context}, num_sms={num_sms}"
        )
    if num_blocks >= SINGLE_PASS_WAVES * num_sms or max_context <= SPLIT_MIN_CONTEXT:
        return SplitPlan(num_parts=1, part_tokens=max_context)
    by_length = -(-max_context // MIN_PART_TOKENS)
    by_occupancy = -(-TARGET_BLOCKS_PER_SM * num_sms // num_blocks)
    parts = max(2, min(by_length, by_occupancy, MAX_PARTS))
    part_tokens = -(-max_context // parts)
    part_tokens = -(-part_tokens // MIN_PART_TOKENS) * MIN_PART_TOKENS
    return SplitPlan(num_parts=-(-max_context // part_tokens), part_tokens=part_tokens)


def visible_keys(seq_lens: list[int], query_lens: list[int], sliding_window: int | None) -> int:
    """The longest key range one thread block reads: the context, or with a window W, the
    W keys of a sequence's first new token and the keys its later new tokens add."""
    if sliding_window is None:
        return max(seq_lens)
    if sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be a positive number of positions or None")
    return max(min(n, sliding_window + q - 1) for n, q in zip(seq_lens, query_lens, strict=True))


def work_items(query_lens: list[int] | np.ndarray, group: int) -> np.ndarray:
    """int32 [num_items, 2] (seq, first row): each sequence's ``q_len × group`` rows in chunks of MAX_ROWS.

    Row ``r`` of a sequence is new token ``r // group``, query head ``r % group`` of the KV head.
    """
    lens = np.asarray(query_lens, dtype=np.int64)
    if lens.ndim != 1 or (lens <= 0).any():
        raise ValueError(f"query_lens must be positive per sequence, got {lens.tolist()}")
    chunks = -(-lens * group // MAX_ROWS)
    seqs = np.repeat(np.arange(len(lens)), chunks)
    starts = np.concatenate([np.arange(c) for c in chunks]) * MAX_ROWS if len(lens) else np.zeros(0, np.int64)
    return np.stack([seqs, starts], axis=1).astype(np.int32)
