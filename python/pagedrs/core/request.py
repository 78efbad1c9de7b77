"""A request's state inside the engine core: its sequences, their token ids, and when they
end by token rules (EOS, stop_token_ids, max_tokens, min_tokens, the context length).

The core never holds text. Stop strings are a text rule: the front end finds them and
finishes the sample here with ``FinishSample`` (``EngineCore.finish_sample``).

A sample under a grammar (``SamplingParams.structured_outputs``) feeds each token to its
``GrammarState``. Where the grammar accepts, its mask allows EOS; once it is complete it
allows nothing else, so the next token is EOS and the sample ends with "stop" (one more
step; the EOS is a stop token like any other: in ``token_ids``, not in the text). That
EOS would end it even with ``ignore_eos``, which SamplingParams therefore refuses beside a
grammar (it could not take effect). The grammar does not make an
answer end by itself: ``max_tokens`` still ends it with "length", however incomplete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import torch

from pagedrs.beam_search import BeamSearchParams
from pagedrs.core.protocol import CoreOutput, CoreSampleOutput, RequestMetrics
from pagedrs.errors import GrammarDeadEnd, GrammarLimitError, NonFiniteLogitsError
from pagedrs.sampling_params import SamplingParams

# llguidance's words when a grammar outgrows its parser limits (ParserLimits: items per row, lexer
# states and fuel, grammar size): "Current row has 8007 items; max is 2000", "too many states", ...
_PARSER_LIMIT = re.compile(r"max is \d|\blimit\b|too many|too big|fuel", re.IGNORECASE)

if TYPE_CHECKING:  # continuation.py imports this module
    from pagedrs.core.continuation import BeamRequest, ContinuationPolicy
    from pagedrs.core.structured.state import GrammarState


@dataclass
class Sample:
    """One of a request's sequences in the core (a sample of n / best_of, or a live beam)."""

    seq_id: int
    index: int
    generator: Optional[torch.Generator]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampled token's, per token
    top_logprobs: Optional[list[dict[int, float]]] = None  # per token, when params.logprobs asks
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    cumulative_logprob: Optional[float] = None  # beam search: the beam's running score
    sent_tokens: int = 0  # tokens already in an output
    grammar: Optional[GrammarState] = None  # structured outputs: the matcher of its tokens so far

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_output(self) -> CoreSampleOutput:
        """What is new since the previous output."""
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        # positional, in CoreSampleOutput's field order (one per request per step: keywords cost)
        return CoreSampleOutput(self.index, self.token_ids[start:], self.logprobs[start:],
                                None if self.top_logprobs is None else self.top_logprobs[start:],
                                self.finish_reason, self.stop_reason)


@dataclass
class Hypothesis:
    """A finished beam-search hypothesis: an output with no sequence behind it."""

    token_ids: list[int]
    finish_reason: str  # "stop" (its last token is EOS or a stop token id) or "length"
    stop_reason: Optional[int]
    cumulative_logprob: Optional[float]  # None: a slot never filled
    score: Optional[float]


@dataclass
class SamplesState:
    """IndependentSamples' state: whether the first row forked the other samples yet."""

    forked: bool = False


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: Union[SamplingParams, BeamSearchParams]
    priority: int
    arrival: int  # the core-wide arrival counter
    samples: list[Sample]  # the sequences it holds (a finished sample stays until the request ends)
    policy: ContinuationPolicy  # the one its params chose (pagedrs.core.continuation)
    state: Union[SamplesState, BeamRequest]  # that policy's own state
    num_samples: int  # sequences it may hold at once: best_of (or n), or the beam width
    metrics: RequestMetrics
    queued_step: int = 0  # the core's step count when it was queued
    stream_tokens: bool = True  # CoreRequest.stream_tokens: False, its output goes out once, when it ends
    num_cached_tokens: Optional[int] = None  # prompt tokens reused at its admission (the last, after a reset)
    cached_tokens_by_tier: Optional[dict[str, int]] = None  # that count by tier (core/prefix_cache.py)
    # its sequences were reset before its first token (a failed step: a disk page that failed its check, say):
    # what that admission found was thrown away, so the next admission's reuse is the one reported
    recount_cached: bool = False
    hypotheses: Optional[list[Hypothesis]] = None  # beam search, once it ended
    ended: Optional[str] = None  # "abort" or "error": it ended before its samples did
    error: Optional[str] = None
    error_by_request: bool = False  # ``error`` is the request's own fault (errors.error_text)
    error_param: Optional[str] = None  # the request field ``error`` names (errors.error_param)
    # prompt_logprobs asked (core/prompt_logprobs.py): prompt position p -> the entry of token p + 1
    prompt_logprobs: Optional[dict[int, dict[int, float]]] = None
    prompt_logprobs_sent: bool = False
    _rule: Optional[TokenRule] = None  # token_rule(), made at its first token
    _timed: bool = False  # an output with its first token's metrics went out

    def token_rule(self, eos_token_ids: frozenset[int], max_model_len: int) -> TokenRule:
        """Its token rules (SamplingParams only), made once."""
        if self._rule is None:
            assert isinstance(self.params, SamplingParams)
            self._rule = TokenRule.of(self.params, len(self.prompt_token_ids), eos_token_ids, max_model_len)
        return self._rule

    @property
    def prompt_logprobs_complete(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) >= len(self.prompt_token_ids) - 1

    def take_prompt_logprobs(self) -> Optional[list[Optional[dict[int, float]]]]:
        """vLLM's ``prompt_logprobs`` (first entry None) once every position is in, and only once."""
        entries = self.prompt_logprobs
        if entries is None or self.prompt_logprobs_sent or not self.prompt_logprobs_complete:
            return None
        self.prompt_logprobs_sent = True
        return [None, *(entries[p] for p in range(len(self.prompt_token_ids) - 1))]

    @property
    def finished(self) -> bool:
        if self.ended is not None or self.hypotheses is not None:
            return True
        if len(self.samples) != self.num_samples:
            return False
        for s in self.samples:  # asked several times per request and step: no generator
            if s.finish_reason is None:
                return False
        return True

    @property
    def steady(self) -> bool:
        """Past the output with its first token (its metrics went out), no prompt logprobs to send,
        not ended: while its samples run, an output says only what they gained (``output``'s short
        path, and the core's steady rows: ``CoreTokenRows``)."""
        return self._timed and self.prompt_logprobs is None and self.ended is None

    def output(self, streams_tokens: bool) -> Optional[CoreOutput]:
        """The output since the previous one; None when there is nothing worth sending
        (``streams_tokens`` False — beam search — until it finishes)."""
        finished = self.finished
        if not streams_tokens and not finished:
            return None
        samples_held = self.samples
        if not finished and len(samples_held) == 1 and self.steady:
            # a running one-sample request past its first token (most of a decode batch): what the
            # general path below builds for it, without its loops and checks
            return CoreOutput(self.request_id, [samples_held[0].take_output()], False, None, self.error,
                              self.num_cached_tokens, self.cached_tokens_by_tier, None, self.error_by_request,
                              self.error_param)
        if self.hypotheses is not None:
            samples = [CoreSampleOutput(i, list(h.token_ids), finish_reason=h.finish_reason, stop_reason=h.stop_reason,
                                        cumulative_logprob=h.cumulative_logprob, score=h.score)
                       for i, h in enumerate(self.hypotheses)]
        else:
            samples = [s.take_output() for s in self.samples]
            if not streams_tokens:  # an ended search: its live beams, scores included
                for c, s in zip(samples, self.samples):
                    c.cumulative_logprob = s.cumulative_logprob
        if self.ended is not None:  # samples never forked end too
            samples.extend(CoreSampleOutput(i, [], finish_reason=self.ended)
                           for i in range(len(samples), self.num_samples))
        # Metrics go out until the output with its first token, then with the final one: in
        # between nothing in them changes (a RequestMetrics.as_dict per request and step was
        # a tenth of a batch-256 step's host time).
        metrics: Optional[RequestMetrics] = None
        if finished or not self._timed:
            metrics = self.metrics
            self._timed = self.metrics.first_token_time is not None
        prompt_logprobs = None if self.prompt_logprobs is None else self.take_prompt_logprobs()
        return CoreOutput(self.request_id, samples, finished, metrics, self.error, self.num_cached_tokens,
                          self.cached_tokens_by_tier, prompt_logprobs, self.error_by_request, self.error_param)


@dataclass(frozen=True)
class TokenRule:
    """A sampled request's token rules, made once per request (``Request.token_rule``): what
    ``record_token`` and the core's fast rows (core/fast_rows.py) both decide by."""

    stops: frozenset[int]  # tokens that end a sample with "stop": EOS unless ignore_eos, and stop_token_ids
    stop_token_ids: frozenset[int]  # of those, the ones reported as stop_reason
    eos_token_ids: frozenset[int]  # a grammar's end: EOS ends it even with ignore_eos (the grammar forced it)
    min_tokens: int  # no "stop" before this many outputs
    limit: int  # outputs at which a sample ends with "length": max_tokens, or what max_model_len leaves

    @classmethod
    def of(cls, params: SamplingParams, prompt_len: int, eos_token_ids: frozenset[int], max_model_len: int) -> TokenRule:
        stop_ids = frozenset(params.stop_token_ids)
        stops = stop_ids if params.ignore_eos else stop_ids | eos_token_ids
        return cls(stops, stop_ids, eos_token_ids, params.min_tokens, min(params.max_tokens, max_model_len - prompt_len))

    def finish(self, sample: Sample, token: int, num_out: int, stop_ids: frozenset[int]) -> None:
        """Sets the sample's finish reason when ``token``, its ``num_out``-th output, ends it."""
        if token in stop_ids and num_out > self.min_tokens:
            sample.finish_reason, sample.stop_reason = "stop", (token if token in self.stop_token_ids else None)
        elif num_out >= self.limit:
            sample.finish_reason = "length"


def record_token(sample: Sample, token: int, logprob: float, top_logprobs: Optional[dict[int, float]],
                 request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> None:
    """Appends one sampled token and decides by token rules whether the sample is finished."""
    params = request.params
    assert isinstance(params, SamplingParams)
    if logprob != logprob:  # NaN: the row's logits held NaN (the pick would be token 0)
        raise NonFiniteLogitsError(len(sample.token_ids))
    rule = request.token_rule(eos_token_ids, max_model_len)
    sample.token_ids.append(token)
    sample.logprobs.append(logprob)
    if params.logprobs is not None:
        entry = {token: logprob}
        if top_logprobs:
            entry.update(top_logprobs)
        if sample.top_logprobs is None:
            sample.top_logprobs = []
        sample.top_logprobs.append(entry)
    stop_ids = rule.stops
    if sample.grammar is not None:
        if not sample.grammar.consume(token):  # its mask allowed the token: a limit of the parser, or a bug
            error = sample.grammar.error or ""
            if _PARSER_LIMIT.search(error):
                raise GrammarLimitError(f"structured_outputs: after {len(sample.token_ids) - 1} tokens the grammar "
                                        f"outgrew the grammar engine's limits (llguidance: "
                                        f"{error.strip().splitlines()[0]}); use a smaller schema or grammar")
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed: {error}")
        if sample.grammar.error:  # a failed matcher allows EOS alone: an answer ended there matches nothing
            reason = sample.grammar.error.strip().splitlines()[0]
            raise GrammarDeadEnd(f"structured_outputs: after {len(sample.token_ids) - 1} tokens no token can continue "
                                 f"an answer the grammar matches (llguidance: {reason}); the output is refused, "
                                 "not returned as complete")
        stop_ids = rule.stop_token_ids | rule.eos_token_ids  # the grammar allows EOS only where the answer may end
    rule.finish(sample, token, len(sample.token_ids), stop_ids)
