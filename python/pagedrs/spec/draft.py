"""The ``draft_model`` proposer on the core's side: which sequences the draft runs for, from
which position, and the drafts handed to the core (the forward passes: spec/draft_runner.py).

    propose  ──► a proposal of k reserved tokens per sequence that may speculate (before the plan)
    schedule ──► the core keeps as many as its budget, max_tokens and pages allow: k_i slots each
    plan     ──► the draft runs on those slots: k_i greedy tokens, batched across sequences;
                 Scheduler.set_draft_tokens puts them in the core, they replace the step's input ids
    verify   ──► exactly as for prompt lookup (core/spec_step.py): the proposal is deterministic

Guessing after the plan, not before it, is what lets the draft write its K/V where the target
writes its own: the positions past a sequence's last token have no slots until the core
reserves them, and once reserved they belong to that sequence alone.

What the draft has written, per sequence: ``written[seq]`` = W, the draft's K/V holds positions
0 .. W - 1 (of this sequence's life: a new sequence, a fork's child included, starts at 0 and
the draft first feeds its whole context, prefix-cache hits too). Its first step feeds W .. L - 1
(L: the length before the drafts), each next one the previous draft. After verification with
``a`` of its k drafts accepted, the draft's K/V holds the sequence's own tokens up to position
L - 1 + a (the drafts d_1 .. d_a are those tokens; d_k itself was never fed): W = min(L + a,
L + k - 1). Pages the core moves keep the draft's layers (copies and host swaps are mirrored);
when the draft K/V may be missing or stale the rule is to re-feed from 0: a sequence that
runs a prefill chunk (its first admission, or a recompute after preemption or a failed step),
and every sequence absent from a step in which a recompute preemption happened. Stale draft
K/V could only lower acceptance (the target verifies every token), never change an output;
re-feeding costs a draft prefill of the context, at most ``max_num_batched_tokens`` tokens of
each sequence per draft forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from pagedrs.core.spec_step import SpecRows, Speculator
from pagedrs.spec.draft_runner import DraftFeed, DraftRunner
from pagedrs.step_input import StepInput

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore

logger = logging.getLogger("pagedrs.engine")

RESERVED_TOKEN = 0  # what the reserved proposal holds until the draft's tokens replace it (never verified)


@dataclass
class DraftSpeculator(Speculator):
    """``Speculator`` whose proposals come from a draft model after the plan (see the module docs)."""

    core: EngineCore | None = None
    runner: DraftRunner | None = None
    written: dict[int, int] = field(default_factory=dict)  # seq id -> W: draft K/V holds positions 0 .. W - 1
    _verifying: dict[int, int] = field(default_factory=dict)  # seq id -> L, of the step being verified
    _recomputes: int = 0  # the core's recompute preemptions seen at the last plan

    def guess(self, tokens: np.ndarray) -> np.ndarray:
        """k reserved positions; the draft fills them once the plan has given them slots."""
        return np.full(self.config.num_speculative_tokens, RESERVED_TOKEN, dtype=np.uint32)

    def plan(self, step: StepInput) -> tuple[StepInput, SpecRows | None]:
        core, runner = self.core, self.runner
        assert core is not None and runner is not None, "DraftSpeculator needs its core and the executor's draft"
        self._forget_stale(core, step)
        counts = step.num_draft_tokens
        if counts.any():
            step = self._fill(core, runner, step)
        return super().plan(step)

    def _forget_stale(self, core: EngineCore, step: StepInput) -> None:
        """Re-feed from 0 where the draft's K/V may be missing (the module docs' rule)."""
        q = step.query_start_loc
        seq_ids = step.seq_ids.tolist()
        for i, seq_id in enumerate(seq_ids):
            if int(q[i + 1] - q[i]) > 1 + int(step.num_draft_tokens[i]):  # a prefill chunk
                self.written.pop(seq_id, None)
        recomputes = core.scheduler.core_stats().num_recompute_preemptions
        if recomputes != self._recomputes:
            self._recomputes = recomputes
            present = set(seq_ids)
            for seq_id in [s for s in self.written if s not in present]:
                del self.written[seq_id]

    def _fill(self, core: EngineCore, runner: DraftRunner, step: StepInput) -> StepInput:
        """The draft's tokens in place of the reserved ones, in the step and in the core."""
        q = step.query_start_loc.tolist()
        seq_ids = step.seq_ids.tolist()
        index, feeds = [], []
        self._verifying.clear()
        for i in np.flatnonzero(step.num_draft_tokens).tolist():
            k = int(step.num_draft_tokens[i])
            entry = core.sequence(seq_ids[i])
            if entry is None:
                continue
            request, sample = entry
            tokens = request.prompt_token_ids + sample.token_ids
            length = int(step.seq_lens[i]) - k  # L: the sequence before its drafts
            if len(tokens) != length:  # not the state the plan was made from: leave the reserved tokens (rejected)
                continue
            start = min(self.written.get(seq_ids[i], 0), length - 1)
            feeds.append(DraftFeed(step.block_tables[i], start, tokens[start:], k))
            index.append(i)
            self._verifying[seq_ids[i]] = length
        try:
            runner.mirror(step)  # pages this step copies or swaps in hold the draft's layers first
            drafts = runner.propose(feeds, chunk=max(1, core.args.max_num_batched_tokens)) if feeds else []
        except Exception:  # noqa: BLE001 - a failed guess costs acceptance, never the step
            # The reserved tokens stay: the target verifies them like any draft (the output is
            # unchanged). What the draft's pages hold is unknown now: every sequence re-feeds.
            logger.warning("the draft model failed to propose; this step verifies the reserved tokens", exc_info=True)
            self.written.clear()
            self._verifying.clear()  # nor does this step's verification tell what it wrote
            return step
        if not feeds:
            return step
        input_ids = step.input_ids.copy()
        for i, tokens in zip(index, drafts):
            end = q[i + 1]
            input_ids[end - len(tokens):end] = tokens
            core.scheduler.set_draft_tokens(seq_ids[i], np.asarray(tokens, dtype=np.uint32))
        return replace(step, input_ids=input_ids)

    def note(self, core: EngineCore, seq_id: int, k: int, accepted: int) -> None:
        length = self._verifying.pop(seq_id, None)
        if length is not None:
            self.written[seq_id] = min(length + accepted, length + k - 1)
        super().note(core, seq_id, k, accepted)

    def forget(self, seq_id: int) -> None:
        self.written.pop(seq_id, None)
        self._verifying.pop(seq_id, None)
        super().forget(seq_id)
