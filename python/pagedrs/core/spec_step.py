"""Speculative decoding in the engine step: drafts proposed before the plan, verified after
the one forward that computes them, the rejected ones rolled back in the core.

    propose ──► Scheduler.set_proposal ──► schedule: a decode carries k drafts (k + 1 query rows)
    forward ──► k + 1 logits rows per speculating sequence: P_0 (after its last token) .. P_k
    verify  ──► round j draws from P_j exactly as a plain decode would (penalties, top-k/p,
                seeds, logprobs, token rules); the draw equals draft j+1: accepted, on to
                round j + 1; otherwise (or j = k: the bonus) it is the sequence's last token
                of the step: Scheduler.accept_drafts(j) cuts the rest, then it is appended.

Why drawing from P_j and accepting iff the draw equals the draft is exact: the proposal is
deterministic (q = one-hot on draft x), so Leviathan et al.'s rule accepts x with probability
min(1, p(x) / q(x)) = p(x) and otherwise samples from (p - q)+ normalized: p with x removed,
renormalized. "Draw y ~ p; accept iff y = x" accepts with probability p(x), and when it
rejects, y is distributed as p(y) / (1 - p(x)) over y != x: the same distribution, token for
token. Greedy (temperature 0) is the special case: accept iff argmax P_j = x. So outputs with
speculation follow the target distribution exactly; with a seed they are even the same draws
(one generator draw per output token, in order): on the CPU the verify rows attend with one-row
decode's numerics (attention/torch_backend.py, rowwise), so even bf16 ties resolve as without drafts.

Structured outputs: a grammar row speculates too. Its proposal is first cut to the prefix its
matcher accepts (``validate_tokens``, which advances nothing), so no verify row is spent on a
token the grammar refuses. Round j's draw is masked by the matcher as it stands after the
tokens accepted in rounds 0 .. j-1 (each accepted draw is consumed by the matcher when it is
recorded, before round j + 1 computes its mask; the drafts themselves are never consumed, so
nothing needs rolling back): the draw is never a token the grammar refuses, and a draft it
refuses can never equal the draw, so it is rejected, and the output is the constrained
distribution's, token for token under greedy.

Interrupted: the step is reported done once round 0 is drawn (core/step.py). An interrupt before
that leaves it open, and it is reported failed (its rows computed again); one in a later round
(or while a round's tokens are recorded) rewinds each speculating sequence to the tokens the
engine recorded, the last one computed again by the next step (``rewind_interrupted``), so no
draft stays unverified and no sequence waits for a token that never comes.

Adaptive rule: each sequence keeps an EMA of its acceptance rate; below
``min_acceptance_rate`` it stops proposing for a while (doubling each time), so a workload
with nothing to look up costs one n-gram search per step and no extra rows. The scheduler
itself speculates less, or not at all, when the budget or the free pages are tight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from pagedrs.core.continuation import IndependentSamples
from pagedrs.core.request import Request
from pagedrs.sampling_params import SamplingParams
from pagedrs.spec.config import SpeculativeConfig
from pagedrs.spec.ngram import propose
from pagedrs.step_input import StepInput

if TYPE_CHECKING:
    import torch

    from pagedrs.core.engine_core import EngineCore

_EMA = 0.3  # weight of the newest step in a sequence's acceptance EMA
_BACKOFF_STEPS = 16  # steps a sequence stays off after its first low EMA (doubles each time, at most 256)


@dataclass
class SpecRows:
    """One step's speculating sequences and where their verify rows are."""

    index: list[int]  # each one's position among the step's sequences
    seq_ids: list[int]
    drafts: list[list[int]]  # its draft tokens d_1 .. d_k
    rows: list[list[int]]  # its logits rows of P_0 .. P_k (k + 1 of them)


@dataclass
class _SeqState:
    ema: float = 1.0
    off_until: int = 0  # core step number before which it proposes nothing
    backoff: int = _BACKOFF_STEPS


@dataclass
class Speculator:
    """The proposer, its per-sequence adaptive state and the counters."""

    config: SpeculativeConfig
    proposed: int = 0  # draft tokens the forward passes verified
    accepted: int = 0  # of those, accepted (each one an output token)
    verifications: int = 0  # (sequence, step) pairs that verified drafts
    _seqs: dict[int, _SeqState] = field(default_factory=dict)

    def propose(self, core: EngineCore) -> None:
        """Hands the core a proposal for every live sequence that decodes and may speculate."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and core.scheduler.num_running > cfg.disable_by_batch_size:
            return
        now = core.num_steps
        for seq_id, (request, s) in core.sequences.items():
            if not s.token_ids or s.finished or not _may_speculate(request):
                continue
            if s.grammar is not None and s.grammar.is_stopped:
                continue
            state = self._seqs.get(seq_id)
            if state is not None and now < state.off_until:
                continue
            tokens = np.asarray(request.prompt_token_ids + s.token_ids, dtype=np.int64)
            drafts = self.guess(tokens)
            if drafts.size and s.grammar is not None:  # only what the grammar accepts is worth a row
                drafts = drafts[: s.grammar.validate_tokens(drafts.tolist())]
            if drafts.size:
                core.scheduler.set_proposal(seq_id, drafts)

    def guess(self, tokens: np.ndarray) -> np.ndarray:
        """The proposal for a sequence of ``tokens`` (uint32; empty: none): prompt lookup here; the
        draft model reserves k positions and guesses after the plan (spec/draft.py)."""
        cfg = self.config
        return propose(tokens, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def plan(self, step: StepInput) -> tuple[StepInput, SpecRows | None]:
        """``step`` with the verify rows of its speculating sequences added to ``logit_rows``."""
        counts = step.num_draft_tokens
        if not counts.any():
            return step, None
        q = step.query_start_loc.tolist()
        input_ids = step.input_ids
        seq_ids = step.seq_ids.tolist()
        first_extra = step.num_seqs + len(step.logit_rows)
        extra: list[int] = []
        spec = SpecRows([], [], [], [])
        for i in np.flatnonzero(counts).tolist():
            k, end = int(counts[i]), q[i + 1]
            rows = list(range(first_extra + len(extra), first_extra + len(extra) + k)) + [i]
            extra.extend(range(end - 1 - k, end - 1))  # token rows of the last sampled token .. d_{k-1}
            spec.index.append(i)
            spec.seq_ids.append(seq_ids[i])
            spec.drafts.append(input_ids[end - k : end].tolist())
            spec.rows.append(rows)
        logit_rows = np.concatenate([step.logit_rows, np.asarray(extra, dtype=np.int64)])
        return replace(step, logit_rows=logit_rows), spec

    def note(self, core: EngineCore, seq_id: int, k: int, accepted: int) -> None:
        """Counts one verification and updates the sequence's adaptive state."""
        self.proposed += k
        self.accepted += accepted
        self.verifications += 1
        state = self._seqs.setdefault(seq_id, _SeqState())
        state.ema = (1 - _EMA) * state.ema + _EMA * (accepted / k)
        if state.ema < self.config.min_acceptance_rate:
            state.off_until = core.num_steps + state.backoff
            state.backoff = min(2 * state.backoff, 256)
            state.ema = 1.0  # a fresh start when it comes back

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)


def _may_speculate(request: Request) -> bool:
    """Plain sampling requests (beam search never speculates; the core refuses it by name)."""
    return isinstance(request.params, SamplingParams) and isinstance(request.policy, IndependentSamples)


Round = Callable[[StepInput, "torch.Tensor", Callable[[dict[int, int]], frozenset[int]]], None]


def verify(core: EngineCore, step: StepInput, logits: torch.Tensor, spec: SpecRows, run_round: Round) -> None:
    """Samples the step's rows round by round (see the module docs). ``run_round(view, logits,
    on_drawn)`` samples, decides and carries out one round over ``view``'s sequences, whose
    logits rows are ``logits``; ``on_drawn`` gets the drawn tokens by sequence id before
    anything is appended and returns the sequences whose token is already in the core."""
    speculator = core.speculator
    assert speculator is not None
    num_seqs = step.num_seqs
    index0 = list(range(num_seqs))
    for i, rows in zip(spec.index, spec.rows):
        index0[i] = rows[0]
    active = list(range(len(spec.seq_ids)))  # positions in spec of the sequences still accepting
    view, round_logits = step, logits[index0]
    j = 0
    while True:
        still: list[int] = []

        def on_drawn(drawn: dict[int, int], j: int = j, candidates: list[int] = active, still: list[int] = still) -> frozenset[int]:
            resolved = []
            for a in candidates:
                seq_id, drafts = spec.seq_ids[a], spec.drafts[a]
                token = drawn.get(seq_id)
                if token is not None and j < len(drafts) and token == drafts[j]:
                    resolved.append(seq_id)  # accepted: already in the core as a draft
                    still.append(a)
                    continue
                # rejected (or the bonus after all k): keep j drafts, the drawn token is appended
                core.scheduler.accept_drafts(seq_id, j)
                speculator.note(core, seq_id, len(drafts), j)
            return frozenset(resolved)

        run_round(view, round_logits, on_drawn)
        # a sequence whose accepted token ended it (EOS, a stop token, max_tokens) goes no further
        live = [a for a in still if core.sequence(spec.seq_ids[a]) is not None]
        for a in still:
            if a not in live:
                speculator.note(core, spec.seq_ids[a], len(spec.drafts[a]), j + 1)
        if not live:
            return
        j += 1
        active = live
        ids = np.asarray([spec.seq_ids[a] for a in active], dtype=np.uint64)
        view = replace(step, seq_ids=ids, do_sample=np.ones(len(active), dtype=bool))
        round_logits = logits[[spec.rows[a][j] for a in active]]


def rewind_interrupted(core: EngineCore, spec: SpecRows, touched: dict[str, Request]) -> None:
    """After a verify step reported done was cut short (an interrupt in a later round, or while
    a round's tokens were recorded): each speculating sequence still here is brought back to
    what the engine recorded for it, its last recorded token to be computed again by the next
    step (``Scheduler.rewind``), so it neither keeps unverified drafts (the next plan would
    refuse them and every request would end) nor waits for a token that never comes. A
    sequence the scheduler cannot rewind ends with that error; the others go on."""
    for seq_id in spec.seq_ids:
        entry = core.sequence(seq_id)
        if entry is None:
            continue
        request, state = entry
        try:
            core.scheduler.rewind(seq_id, len(request.prompt_token_ids) + len(state.token_ids))
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the engine down
            core.fail(request, exc, touched)

