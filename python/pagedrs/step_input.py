"""The one value that crosses from the scheduler to the model runner each step.

The scheduler (Rust, ``pagedrs._core.Scheduler``) decides; the runner executes.
Everything here is plain integers in NumPy arrays, batched for the whole step.

Token layout of one step (S scheduled sequences, T tokens in all)::

    input_ids      | seq 0: prompt chunk ....... | seq 1: 1 decode token | seq 2: chunk ... |
    query_start_loc  0                           q1                      q2                 T

A sequence's new tokens sit at positions ``seq_lens[i] - (q[i+1] - q[i]) .. seq_lens[i] - 1``:
everything before them is already in its KV pages (cached prefix or earlier chunks).

Order of work in a step: ``swap_out``, then ``swap_in``, then ``copies``
(copy-on-write), then the forward pass. Swap-out comes first because the
blocks it frees may be handed to other sequences in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _empty_pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int64)


@dataclass(frozen=True)
class StepInput:
    input_ids: np.ndarray  # int64 [T]  tokens computed this step, sequences back to back
    positions: np.ndarray  # int64 [T]  position of each token inside its sequence
    slot_mapping: np.ndarray  # int64 [T]  slot receiving each token's K/V: block * block_size + offset
    query_start_loc: np.ndarray  # int32 [S+1]  cumulative new-token counts; seq i owns [q[i], q[i+1])
    seq_lens: np.ndarray  # int32 [S]  context length after this step (cached + new tokens)
    block_tables: np.ndarray  # int32 [S, max_blocks]  physical block ids, padded with 0 past seq_lens
    swap_out: np.ndarray = field(default_factory=_empty_pairs)  # int64 [N, 2] (gpu_block, cpu_block)
    swap_in: np.ndarray = field(default_factory=_empty_pairs)  # int64 [N, 2] (cpu_block, gpu_block)
    copies: np.ndarray = field(default_factory=_empty_pairs)  # int64 [N, 2] (src_block, dst_block) on the device

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
