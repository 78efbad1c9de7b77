"""The one value that crosses from the scheduler to the executor each step.

The scheduler (Rust, ``pagedrs._core.Scheduler``) decides; the executor runs.
Everything here is plain integers in NumPy arrays, batched for the whole step.
``StepInput`` is the Python twin of the core's ``StepPlan`` (rust/src/py/scheduler.rs):
the same fields (but ``CORE_FILLED``, which the Python core sets), converted once by
:meth:`StepInput.from_plan`; ``tests/test_step_codec.py``
fails when the two sides name different fields.

Token layout of one step (S scheduled sequences, T tokens in all)::

    input_ids      | seq 0: prompt chunk ....... | seq 1: 1 decode token | seq 2: chunk ... |
    query_start_loc  0                           q1                      q2                 T

A sequence's new tokens sit at positions ``seq_lens[i] - (q[i+1] - q[i]) .. seq_lens[i] - 1``:
everything before them is already in its KV pages (cached prefix or earlier chunks).

Order of work in a step: every ``transfers`` entry in list order (all device→host copies
come before any host→device copy, because blocks a swap-out frees may be handed to other
sequences in the same step), then ``copies`` (copy-on-write), then the forward pass.
After a transfer's copy has finished, its id goes back to the core
(``Scheduler.complete_transfers``) so the host pages it pinned can be reused.

A copy to the disk tier carries what each destination slot will hold beside the page (its
chained hash, its parent's hash, its tokens), taken from the core when the copy is handed out
(:func:`transfers_from`): the runner writes it later, on the executor's worker thread with
asynchronous scheduling, while the core plans the next step, so it must never ask the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np

TIERS = ("gpu", "cpu", "disk")  # the tier names the core uses; the executor maps each to its storage
# fields the Python core fills after the plan (core/prompt_logprobs.py); the core's StepPlan has none of them
CORE_FILLED = frozenset({"logit_rows"})


# (hashes uint64 [N], parents uint64 [N], tokens uint32 [N, block_size]) of N disk slots
DiskPageMeta = tuple[np.ndarray, np.ndarray, np.ndarray]
# slots uint32 [N] -> their DiskPageMeta (the core's ``Scheduler.disk_pages``)
PageMeta = Callable[[np.ndarray], DiskPageMeta]


def _empty_pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int64)


@dataclass(frozen=True)
class Transfer:
    """One batch of page copies between tiers, handed out by the core."""

    id: int  # report it to Scheduler.complete_transfers once the copy has finished
    src: str  # a name in TIERS
    dst: str  # a name in TIERS
    pairs: np.ndarray  # int64 [N, 2] (src block, dst block)
    # a copy to the disk tier: what each destination slot holds beside its page (see the module docs)
    meta: Optional[DiskPageMeta] = None


def transfers_from(core_transfers: Iterable[tuple[Any, Any, Any, np.ndarray]],
                   page_meta: Optional[PageMeta]) -> tuple[Transfer, ...]:
    """The core's ``(id, src, dst, pairs)`` batches as ``Transfer``s, each copy to the disk tier
    with its slots' meta from ``page_meta`` (asked now, while the core is not planning; None only
    where no batch goes to disk, else a ValueError)."""
    out = []
    for i, s, d, p in core_transfers:
        dst = str(d)
        meta = None
        if dst == "disk" and len(p):
            if page_meta is None:
                raise ValueError(f"transfer {int(i)} copies pages to the disk tier: page_meta (the core's "
                                 "Scheduler.disk_pages) must give their slots' hash, parent and tokens")
            meta = page_meta(np.ascontiguousarray(p[:, 1], dtype=np.uint32))
        out.append(Transfer(int(i), str(s), dst, p, meta))
    return tuple(out)


@dataclass(frozen=True)
class StepInput:
    input_ids: np.ndarray  # int64 [T]  tokens computed this step, sequences back to back
    positions: np.ndarray  # int64 [T]  position of each token inside its sequence
    slot_mapping: np.ndarray  # int64 [T]  slot receiving each token's K/V: block * block_size + offset
    query_start_loc: np.ndarray  # int32 [S+1]  cumulative new-token counts; seq i owns [q[i], q[i+1])
    seq_lens: np.ndarray  # int32 [S]  context length after this step (cached + new tokens)
    block_tables: np.ndarray  # int32 [S, max_blocks]  physical block ids, padded with 0 past seq_lens
    seq_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # uint64 [S]
    do_sample: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # bool [S] sample after the step
    # int32 [S]  draft tokens (speculative decoding) among each sequence's last new tokens (core/spec_step.py)
    num_draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    transfers: tuple[Transfer, ...] = ()  # tier copies, run first and in order
    copies: np.ndarray = field(default_factory=_empty_pairs)  # int64 [N, 2] (src_block, dst_block) on the device
    step_id: int = 0  # the core's id of this step: Scheduler.complete_step(step_id, ok) once it ran or failed
    # int64 [E]  token rows whose logits come back too, after the S last rows: the prompt rows of
    # requests with prompt_logprobs (core/prompt_logprobs.py); empty for every other step
    logit_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def from_plan(cls, plan: Any, page_meta: Optional[PageMeta] = None) -> StepInput:
        """The single conversion from the core's ``StepPlan``; ``page_meta`` (the core's
        ``Scheduler.disk_pages``) gives copies to the disk tier their slots' meta (needed only when
        the plan has such copies: a ValueError then)."""
        values = {name: getattr(plan, name) for name in _PLAN_FIELDS}
        transfers = plan.transfers
        values["transfers"] = transfers_from(transfers, page_meta) if transfers else ()
        return cls(**values)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# the fields the core's StepPlan has, named once (``dataclasses.fields`` per step cost a few us)
_PLAN_FIELDS = tuple(f.name for f in fields(StepInput) if f.name not in CORE_FILLED)


def value_bounds(a: np.ndarray) -> tuple[int, int]:
    """``a``'s minimum and maximum as ints ((0, 0) when empty); a decode step's few values through
    Python's own min and max (NumPy's reductions cost more than the work at that size, and run
    cold in a batch-1 step on the fused CPU decode)."""
    if a.size == 0:
        return 0, 0
    if a.size <= 64:
        values = a.tolist()
        return min(values), max(values)
    return int(a.min()), int(a.max())
