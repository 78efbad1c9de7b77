"""A tiny greedy generation loop over ModelRunner that plays the scheduler's part by hand.

It assigns physical blocks itself (optionally in a shuffled order), builds each
``StepInput`` from scratch and can split prompts into chunks, so model tests can
check that tokens do not depend on the block size, on which physical blocks hold
a sequence, or on how its prompt was chunked. Engine tests reuse it as a reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedrs.step_input import StepInput


@dataclass
class PagedSeq:
    token_ids: list[int]  # prompt + generated so far
    num_computed: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)


class BlockPool:
    """Hands out physical block ids, in a shuffled order when ``seed`` is given."""

    def __init__(self, num_blocks: int, seed: int | None = None) -> None:
        self.free = list(range(num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(self.free)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("paged_driver: out of blocks; give the runner more num_gpu_blocks")
        return self.free.pop(0)


def build_step(seqs: list[PagedSeq], chunks: list[int], block_size: int, pool: BlockPool) -> StepInput:
    """A step computing ``chunks[i]`` new tokens of ``seqs[i]``, growing block tables as needed."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q = [0]
    seq_lens = []
    for seq, n in zip(seqs, chunks, strict=True):
        start, end = seq.num_computed, seq.num_computed + n
        while len(seq.block_table) * block_size < end:
            seq.block_table.append(pool.take())
        for p in range(start, end):
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        q.append(q[-1] + n)
        seq_lens.append(end)
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    return StepInput(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        query_start_loc=np.array(q, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=tables,
    )


def greedy_generate(
    runner,  # pagedrs.model_runner.ModelRunner
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    shuffle_seed: int | None = None,
    chunk_size: int | None = None,
) -> list[list[int]]:
    """Greedy continuations of every prompt, all sequences batched in each step.

    Prompts are prefilled ``chunk_size`` tokens per step (whole when None), in the same
    batch as the decode tokens of sequences that are already generating.
    """
    num_blocks = runner.kv_cache.shape[2]
    pool = BlockPool(num_blocks, shuffle_seed)
    seqs = [PagedSeq(list(p)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in outputs):
        active = [i for i, o in enumerate(outputs) if len(o) < max_new_tokens]
        chunks = []
        for i in active:
            remaining = len(seqs[i].token_ids) - seqs[i].num_computed
            chunks.append(remaining if chunk_size is None else min(chunk_size, remaining))
        step = build_step([seqs[i] for i in active], chunks, runner.block_size, pool)
        logits = runner.execute(step)
        next_ids = torch.argmax(logits, dim=-1).tolist()
        for row, (i, n) in enumerate(zip(active, chunks, strict=True)):
            seq = seqs[i]
            seq.num_computed += n
            if seq.num_computed == len(seq.token_ids):  # prompt done (or a decode step): sample
                seq.token_ids.append(next_ids[row])
                outputs[i].append(next_ids[row])
    return outputs
