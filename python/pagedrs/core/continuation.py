"""Continuation policies: what a request does with the logits rows of its sequences.

Each request has a policy, chosen by the type of its params (``SamplingParams`` ->
``IndependentSamples``, ``BeamSearchParams`` -> ``BeamSearch``; a
``SamplingParams(use_beam_search=True)`` reaches the core as ``BeamSearchParams``).
``request_shape(params)`` says how many sequences a request may hold at once
(``num_samples``: the core's worst case), how many outputs it returns (``num_outputs``:
its best ones, best first, once finished) and whether its outputs mean anything before
it finishes (``streams``); the front end reads the same shape. A policy starts each
request's own typed state (``start``). After each step the core asks the request's policy
two things:

- ``draws(request, sample, new_sample)``: which samples draw a token from ``sample``'s
  logits row with the sampler (the sample itself, children created now with
  ``new_sample(index)``, or none when the policy reads the row itself);
- ``on_step(request, rows, new_sample)``: given this step's rows of the request (each
  with the tokens drawn from it), a ``Decision`` or ``None`` (not yet: the policy keeps
  the rows until the ones it waits for arrive).

A ``Decision`` lists continuations ``(parent, sample, token)`` — ``sample`` is ``parent``
(the token joins the parent's sequence) or a new sample forked from ``parent`` first —
and the samples whose sequences end. The core carries it out generically (core/step.py):
every fork first (pages shared; a parent that goes on more than once is forked before
any token is appended), then one batched append, then the frees. It never branches on
the kind of request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import torch

from pagedrs.beam_search import BeamSearchParams, BeamState, beam_step
from pagedrs.core.request import Hypothesis, Request, Sample, SamplesState, record_token
from pagedrs.core.structured.mask import apply_grammar_masks
from pagedrs.errors import NonFiniteLogitsError
from pagedrs.sampling import SampleResult
from pagedrs.sampling_params import SamplingParams

NewSample = Callable[[int], Sample]  # index -> a new sample with its own (not yet forked) sequence id


@dataclass(frozen=True)
class RequestShape:
    num_samples: int  # sequences it may hold at once (forks included)
    num_outputs: int  # a finished request reports its first num_outputs samples, best first
    streams: bool  # whether its outputs before it finishes are worth reporting


def request_shape(params: Union[SamplingParams, BeamSearchParams]) -> RequestShape:
    """``best_of`` (default ``n``) samples, the best ``n`` returned; or ``beam_width`` beams."""
    if isinstance(params, BeamSearchParams):
        return RequestShape(params.beam_width, params.num_returned, False)
    num_samples = params.best_of or params.n
    return RequestShape(num_samples, params.n, num_samples == params.n)


@dataclass
class StepRow:
    sample: Sample  # whose sequence produced the row
    step_logits: torch.Tensor  # float32 [rows, V], the step's raw logits
    row: int  # this row's index in ``step_logits``
    drawn: list[tuple[Sample, SampleResult]] = field(default_factory=list)  # the sampler's tokens for ``draws``

    @property
    def logits(self) -> torch.Tensor:
        """float32 [V], the row's raw logits (a view, made only for a policy that reads them: an
        indexed view per row and step was a tenth of a batch-256 step's host time)."""
        return self.step_logits[self.row]


@dataclass
class Continuation:
    parent: Sample  # the sequence continued
    sample: Sample  # ``parent`` itself, or a new sample forked from it before any append
    token_id: int


@dataclass
class Decision:
    continuations: list[Continuation] = field(default_factory=list)
    finished: list[Sample] = field(default_factory=list)  # sequences freed after the forks
    num_tokens: int = 0  # tokens this step produced for the request (for the core's counters)


class ContinuationPolicy(Protocol):
    streams_tokens: bool  # the core sends a running request's new tokens (False: only its final output)

    def start(self, params: Union[SamplingParams, BeamSearchParams]) -> Union[SamplesState, BeamRequest]:
        """The policy's own state for a new request (kept in ``Request.state``)."""
        ...

    def draws(self, request: Request, sample: Sample, new_sample: NewSample) -> list[Sample]:
        """The samples that draw a token from ``sample``'s row with the sampler."""
        ...

    def on_step(self, request: Request, rows: list[StepRow], new_sample: NewSample) -> Optional[Decision]:
        """This step's continuations of the request, or None while rows are still missing."""
        ...


class IndependentSamples:
    """``best_of`` (default ``n``) independent samples.

    The prompt's logits give every sample its first token: the first row forks
    ``best_of - 1`` children (they share every prompt page); afterwards each sample
    appends until a token rule (EOS, a stop token, max_tokens, the context length), or
    the front end (a stop string), finishes it. With ``best_of > n`` (vLLM v0's
    semantics) the front end ranks the finished samples by cumulative log-probability,
    cut where a stop string cut the text (frontend/output_processor.py), and returns the
    ``n`` best; the core streams every sample's tokens to it all the same.
    """

    streams_tokens = True

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, params: Union[SamplingParams, BeamSearchParams]) -> SamplesState:
        return SamplesState()

    def draws(self, request: Request, sample: Sample, new_sample: NewSample) -> list[Sample]:
        state = request.state
        assert isinstance(state, SamplesState)
        if request.num_samples == 1 or state.forked:
            return [sample]
        children = [new_sample(index) for index in range(1, request.num_samples)]
        request.samples.extend(children)
        state.forked = True
        return [sample, *children]

    def on_step(self, request: Request, rows: list[StepRow], new_sample: NewSample) -> Decision:
        decision = Decision()
        for row in rows:
            for s, result in row.drawn:
                record_token(s, result.token_id, result.logprob, result.top_logprobs, request, self.eos_token_ids,
                             self.max_model_len)
                decision.num_tokens += 1
                if s.finished:
                    decision.finished.append(s)
                else:
                    decision.continuations.append(Continuation(row.sample, s, result.token_id))
        return decision


class BeamSearch:
    """Beam search (``beam_search.beam_step``) on the core's fork / append / finish.

    The live beams are the request's samples, best first. A step decides only when every
    live beam has its logits row: under preemption the beams of one request may run in
    different steps, so the rows of those that ran are kept (as log-probabilities) until
    the rest arrive; a beam whose row is kept has nothing to compute and stays idle in
    the core. Then each new beam continues its parent in place (the parent's first new
    beam) or as a fork of it; beams no new beam continues are freed. When the search
    ends every beam is freed and the request's ``hypotheses`` are the finished ones, best
    first. The core reports nothing before that (vLLM v0 streamed nothing meaningful
    either: the live beams change places every step); the one output is the hypotheses'
    token ids and scores, and the front end makes their text.

    A hypothesis ends at EOS (unless ``ignore_eos``) or at one of ``stop_token_ids``:
    together they are HF's ``eos_token_id`` list. Until ``min_tokens`` tokens exist
    those tokens' log-probabilities are -inf, as HF's ``min_new_tokens`` processor sets
    them (after the log-softmax, not renormalized).

    Under a grammar (``structured_outputs``) each beam has its own matcher: a beam that goes
    on in place consumes its token; a beam forked from a parent gets a clone of the parent's
    matcher as of the parent's row (cloned before the parent consumes anything), just as its
    pages are shared with the parent. The mask acts where transformers' logits processors
    act in its beam search: on the log-softmax of the raw logits, each forbidden token set
    to -inf, not renormalized. So a beam's score stays the model's own log-probability of its
    tokens, and the grammar only removes candidates: of two answers the grammar allows, the
    one the model finds likelier wins, however many alternatives the grammar cut at each
    step. (Renormalizing, i.e. the log-softmax of the masked logits, would favour answers
    through forced tokens, which then cost nothing.) Where the grammar is complete its mask
    allows only EOS, so the beam ends with "stop" on its next candidate; EOS ends it even with
    ``ignore_eos`` (the grammar forced it). A beam whose score is already -inf may be kept
    when too few candidates are left (transformers keeps it too); the grammar refuses its
    token, and its matcher, in error, allows only EOS from then on.
    """

    streams_tokens = False

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def start(self, params: Union[SamplingParams, BeamSearchParams]) -> BeamRequest:
        assert isinstance(params, BeamSearchParams)
        return BeamRequest(BeamState.start(params.beam_width))

    def stop_token_ids(self, params: BeamSearchParams) -> frozenset[int]:
        ignored = params.ignore_eos and params.structured_outputs is None  # a grammar's EOS always ends a beam
        return (frozenset() if ignored else self.eos_token_ids) | frozenset(params.stop_token_ids)

    def draws(self, request: Request, sample: Sample, new_sample: NewSample) -> list[Sample]:
        return []

    def on_step(self, request: Request, rows: list[StepRow], new_sample: NewSample) -> Optional[Decision]:
        params = request.params
        search = request.state
        assert isinstance(params, BeamSearchParams) and isinstance(search, BeamRequest)
        for row in rows:
            if row.sample.seq_id in search.rows:
                # the first row of a beam stays: one that ran again after a recompute preemption
                # is for the same tokens (a beam gets no token before the decision)
                continue
            logits = row.logits.float()
            if params.temperature > 0:
                logits = logits / params.temperature
            logprobs_row = torch.log_softmax(logits, dim=-1).cpu()
            if bool(torch.isnan(logprobs_row).any()):  # ``record_token``'s rule: NaN logits end the request
                raise NonFiniteLogitsError(search.state.num_generated)  # (NaN scores would rank silently)
            search.rows[row.sample.seq_id] = logprobs_row
        beams = request.samples
        if any(b.seq_id not in search.rows for b in beams):
            return None  # wait for the other beams' rows
        logprobs = torch.stack([search.rows[b.seq_id] for b in beams])
        search.rows.clear()
        if params.structured_outputs is not None:  # after the log-softmax, as transformers' processors
            logprobs = apply_grammar_masks(logprobs, [b.grammar for b in beams])
        stops = self.stop_token_ids(params)
        if search.state.num_generated < params.min_tokens:
            banned = [t for t in stops if t < logprobs.shape[1]]
            logprobs[:, banned] = float("-inf")
        max_generated = min(params.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        choice = beam_step(search.state, logprobs, [b.token_ids for b in beams], params, stops, max_generated)
        if choice.done:
            request.hypotheses = self._hypotheses(params, search)
            return Decision(finished=beams, num_tokens=len(choice.continuing))
        return self._continue(request, beams, choice.continuing, search, new_sample)

    def _continue(self, request: Request, beams: list[Sample], continuing: list[tuple[int, int]],
                  search: BeamRequest, new_sample: NewSample) -> Decision:
        decision = Decision(num_tokens=len(continuing))
        used: set[int] = set()
        scores = search.state.running_scores.tolist()
        new_beams = []
        for position, (parent_index, token) in enumerate(continuing):
            parent = beams[parent_index]
            child = parent if parent_index not in used else new_sample(position)
            used.add(parent_index)
            new_beams.append((parent, child, parent.token_ids + [token], scores[position]))
            decision.continuations.append(Continuation(parent, child, token))
        for parent, beam, _, _ in new_beams:  # every fork's matcher as of its parent's row, before any consumes
            if beam is not parent and parent.grammar is not None:
                beam.grammar = parent.grammar.clone()
        for index, (_, beam, tokens, score) in enumerate(new_beams):
            beam.index, beam.token_ids, beam.cumulative_logprob = index, tokens, score
            if beam.grammar is not None:
                beam.grammar.consume(tokens[-1])  # False only for a beam at -inf (see the class docstring)
        decision.finished = [b for i, b in enumerate(beams) if i not in used]
        request.samples = [beam for _, beam, _, _ in new_beams]
        return decision

    def _hypotheses(self, params: BeamSearchParams, search: BeamRequest) -> list[Hypothesis]:
        """The finished hypotheses, best first. As for sampled outputs, a stop token (EOS or
        a stop token id) is in ``token_ids``; the front end leaves it out of the text."""
        stops = self.stop_token_ids(params)
        out = []
        for hyp in search.state.finished:
            generated = list(hyp.generated) if hyp is not None else []
            stopped = bool(generated) and generated[-1] in stops
            out.append(Hypothesis(
                token_ids=generated,
                finish_reason="stop" if stopped else "length",
                stop_reason=generated[-1] if stopped and generated[-1] in params.stop_token_ids else None,
                cumulative_logprob=hyp.cum_logprob if hyp is not None else None,
                score=hyp.score if hyp is not None else None,
            ))
        return out


@dataclass
class BeamRequest:
    """BeamSearch's state of one request."""

    state: BeamState
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> its log-probabilities, until all arrive
