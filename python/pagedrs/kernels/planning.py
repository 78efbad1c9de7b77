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

The v2 kernel (``paged_attention_v2_kernel``: 4 rows a block, 12 resident warps per
SM) splits by the same rule with its own numbers (``V2``): it needs several waves of
blocks in flight rather than one, because a single wave of equal blocks leaves a
tail where few warps, and so few loads, are resident (Llama-3-8B at batch 64 x 4096:
512 blocks over 132 x 3 slots is 1.3 waves). Its partials cost little at decode
(``num_heads × head_size`` floats per partition and sequence, written and read once:
under 1% of the KV bytes of a 1024-key partition at 8 KV heads and group 4), so it
splits that case into 4 partitions of 1024 keys (2048 blocks).

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
ROWS_V2 = 4  # kRowsV2 in cuda/paged_attention.cu
BLOCKS_PER_SM_V2 = 3  # kMinBlocksPerSmV2 in cuda/paged_attention.cu


@dataclass(frozen=True)
class SplitRule:
    """The numbers of the split rule for one kernel, in thread blocks per SM (see the module docstring)."""

    single_pass_per_sm: int  # no split when the single-pass grid holds this many blocks per SM
    target_per_sm: int  # otherwise split until the grid holds about this many


V1 = SplitRule(single_pass_per_sm=SINGLE_PASS_WAVES, target_per_sm=TARGET_BLOCKS_PER_SM)
V2 = SplitRule(single_pass_per_sm=4 * BLOCKS_PER_SM_V2, target_per_sm=4 * BLOCKS_PER_SM_V2)  # four waves
RULES: dict[str, SplitRule] = {"v1": V1, "v2": V2}
# rows of one work item (thread block) per kernel variant
ROWS_PER_ITEM: dict[str, int] = {"v1": MAX_ROWS, "v2": ROWS_V2}


@dataclass(frozen=True)
class SplitPlan:
    """How the key range is partitioned; ``num_parts == 1`` means the single-pass kernel."""

    num_parts: int
    part_tokens: int  # keys per partition (a multiple of MIN_PART_TOKENS when split)


def plan_split(num_blocks: int, max_context: int, num_sms: int, rule: SplitRule = V1) -> SplitPlan:
    """Applies the module's rule (``rule``: V1's numbers by default) to a single-pass grid of ``num_blocks`` blocks."""
    if num_blocks <= 0 or max_context <= 0 or num_sms <= 0:
        raise ValueError(
            f"plan_split needs positive values, got num_blocks={num_blocks}, "
            f"max_context={max_context}, num_sms={num_sms}"
        )
    if num_blocks >= rule.single_pass_per_sm * num_sms or max_context <= SPLIT_MIN_CONTEXT:
        return SplitPlan(num_parts=1, part_tokens=max_context)
    by_length = -(-max_context // MIN_PART_TOKENS)
    by_occupancy = -(-rule.target_per_sm * num_sms // num_blocks)
    parts = max(2, min(by_length, by_occupancy, MAX_PARTS))
    part_tokens = -(-max_context // parts)
    part_tokens = -(-part_tokens // MIN_PART_TOKENS) * MIN_PART_TOKENS
    return SplitPlan(num_parts=-(-max_context // part_tokens), part_tokens=part_tokens)


def plan_fixed_split(num_blocks: int, max_keys: int, num_sms: int, rule: SplitRule = V1,
                     sliding_window: int | None = None) -> SplitPlan:
    """The split of a decode launch that must not change from step to step (a CUDA graph bakes
    ``num_parts`` into its grid and ``part_tokens`` into its arguments): the rule applied to the
    longest key range any decode token of the pool can read, ``max_keys`` (the block tables'
    fixed width in tokens), or the window when it is shorter.

    Shorter contexts leave trailing partitions empty; both kernels mark an empty partition
    (``mark_empty_partition`` in cuda/paged_attention.cu) and the reduce kernel skips it, so the
    result is the attention over the real keys, only summed in another order than the per-step
    split's."""
    if max_keys <= 0:
        raise ValueError(f"plan_fixed_split needs max_keys > 0, got {max_keys}")
    keys = max_keys if sliding_window is None else min(max_keys, sliding_window)
    return plan_split(num_blocks, keys, num_sms, rule)


def visible_keys(seq_lens: list[int], query_lens: list[int], sliding_window: int | None) -> int:
    """The longest key range one thread block reads: the context, or with a window W, the
    W keys of a sequence's first new token and the keys its later new tokens add."""
    if sliding_window is None:
        return max(seq_lens)
    if sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be a positive number of positions or None")
    return max(min(n, sliding_window + q - 1) for n, q in zip(seq_lens, query_lens, strict=True))


def work_items(query_lens: list[int] | np.ndarray, group: int, rows: int = MAX_ROWS, seqs: np.ndarray | None = None) -> np.ndarray:
    """int32 [num_items, 2] (seq, first row): each sequence's ``q_len × group`` rows in chunks of
    ``rows`` (the kernel's rows per block: ``ROWS_PER_ITEM``).

    Row ``r`` of a sequence is new token ``r // group``, query head ``r % group`` of the KV head.
    ``seqs``: the sequence ids of ``query_lens`` (a subset of the step's); default 0, 1, ...
    """
    lens = np.asarray(query_lens, dtype=np.int64)
    if lens.ndim != 1 or (lens <= 0).any():
        raise ValueError(f"query_lens must be positive per sequence, got {lens.tolist()}")
    ids = np.arange(len(lens)) if seqs is None else np.asarray(seqs, dtype=np.int64)
    if ids.shape != lens.shape:
        raise ValueError(f"seqs has {ids.shape[0]} ids for {lens.shape[0]} query_lens")
    chunks = -(-lens * group // rows)
    owner = np.repeat(ids, chunks)
    starts = np.concatenate([np.arange(c) for c in chunks]) * rows if len(lens) else np.zeros(0, np.int64)
    return np.stack([owner, starts], axis=1).astype(np.int32)
