"""Where text ends: the one place that turns the core's token ids into outputs.

Per request and sample it keeps the detokenizer, the text, the logprobs handed out and
what was already reported. The token rules (stop tokens, stop strings, flushes) are applied
token by token in ``frontend/sample_text.py``; here, a stop string found while the core's
sequence goes on is told to the core with a ``FinishSample`` (reason "stop", ``stop_reason``
the string): in the same process the core hears it before its next step; a core in another
process may have computed one token more, which never reaches an output. While a sample runs,
text that may still be the start of a stop string is held back.

``best_of > n`` ranks the finished samples by cumulative log-probability here, summed over
the tokens kept (so cut where a stop string cut the text), best first, ties by index; beam
search's hypotheses come ranked and scored from the core, and their text is made here.

``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``) says which outputs a request gets:
``CUMULATIVE`` one per step with everything so far; ``DELTA`` one per step with only what is new
(a sample appears when it gained tokens or text, or finished; ``prompt_logprobs`` once);
``FINAL_ONLY`` one at the end, equal to CUMULATIVE's last. A sample nobody reads before its end
(FINAL_ONLY, ``best_of > n``) without stop strings (the only rule that needs the text as it grows)
keeps only its tokens and is decoded once, when it finishes; aborted or failed, its tokens are
replayed through the detokenizer as the per-token path would have stepped them. The
``CompletionOutput``s of each kind are built in ``frontend/completions.py``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Union

from pagedrs.beam_search import BeamSearchParams
from pagedrs.core.continuation import RequestShape, request_shape
from pagedrs.core.protocol import Abort, CoreOutput, CoreOutputItem, CoreSampleOutput, CoreTokenRows, FinishSample, RequestMetrics
from pagedrs.errors import error_param, error_text
from pagedrs.frontend.completions import cumulative_completions, delta_completions, one_delta_completion
from pagedrs.frontend.input_processor import ProcessedRequest, outputs_before_end
from pagedrs.frontend.sample_text import SampleText, replay_text, take_deferred, take_hypothesis, take_plain_token, take_tokens
from pagedrs.outputs import RequestOutput
from pagedrs.sampling_params import RequestOutputKind, SamplingParams
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer

Command = Union[FinishSample, Abort]


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Union[SamplingParams, BeamSearchParams]
    shape: RequestShape
    samples: list[SampleText]  # by index
    metrics: RequestMetrics
    num_cached_tokens: Optional[int] = None
    cached_tokens_by_tier: Optional[dict[str, int]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # once the core sent them
    error: Optional[str] = None
    error_by_request: bool = False  # ``error`` is the request's own fault (errors.error_text)
    error_param: Optional[str] = None  # the request field ``error`` names (errors.error_param)
    ended: Optional[str] = None  # "abort" or "error": ended before its samples did (no ranking)
    delta: bool = False  # output_kind is DELTA (asked per step: a plain bool is cheaper than an enum compare)
    streams: bool = True  # it gets outputs before it finishes (not beam search, best_of > n, FINAL_ONLY)
    detokenize: bool = True  # SamplingParams.detokenize, and the tokenizer makes text (not skip_tokenizer_init)
    metrics_unsent: bool = False  # metrics came that no output carried yet
    prompt_logprobs_sent: bool = False  # DELTA: an output carried them (they go once)
    beam: bool = False  # BeamSearchParams (asked per sample and step: a bool, not an isinstance)
    longest_hold: int = 0  # characters held back while a sample runs: the longest stop string's, less one
    # one sample, no stop string, its text made token by token: a steady row's token is taken inline
    # (``OutputProcessor._take_rows``)
    plain_stream: bool = False
    # DELTA and plain_stream: a running step's output is its one sample's new tokens and text
    # (``completions.one_delta_completion``), the server's common case
    one_delta: bool = False

    @property
    def finished(self) -> bool:
        if self.ended is not None:
            return True
        if len(self.samples) != self.shape.num_samples:
            return False
        for s in self.samples:  # asked several times per request and step: no generator
            if s.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}

    @property
    def requests(self) -> Mapping[str, RequestState]:
        """The unfinished requests' text state, by id (read-only)."""
        return MappingProxyType(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, processed: ProcessedRequest, queued_time: float) -> None:
        params = processed.params
        arrival = queued_time if processed.arrival_time is None else min(processed.arrival_time, queued_time)
        shape = request_shape(params)
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        stops = params.stop if isinstance(params, SamplingParams) else ()
        state = RequestState(processed.request_id, processed.prompt, processed.prompt_token_ids, params,
                             shape, [], RequestMetrics(arrival, queued_time),
                             delta=kind == RequestOutputKind.DELTA, streams=outputs_before_end(params),
                             detokenize=(isinstance(params, SamplingParams) and params.detokenize
                                         and self.tokenizer.makes_text),
                             beam=isinstance(params, BeamSearchParams),
                             longest_hold=max(map(len, stops)) - 1 if stops else 0)
        first = self._sample(state, 0)  # its detokenizer exists from the start
        state.plain_stream = (isinstance(params, SamplingParams) and not stops and shape.num_samples == 1
                              and not first.deferred)
        state.one_delta = state.delta and state.plain_stream
        self._requests[processed.request_id] = state

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Ends the request as "abort"; its final output (None when it is not known here)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        self._end(state, "abort")
        return self._output(state, with_metrics=True)

    def fail_all(self) -> None:
        """The engine is dead: every request has ended (the core reports none of them)."""
        self._requests.clear()

    def process(self, outputs: list[CoreOutputItem]) -> tuple[list[RequestOutput], list[Command]]:
        """The core's outputs as RequestOutputs, and what the core must be told (stop strings found,
        requests that failed here).

        One RequestOutput per request per call, after all of its core outputs in ``outputs`` are
        taken: a client in another process may deliver several core steps at once, and the
        cumulative fields (``logprobs`` is the sample's own growing list) must match the deltas
        of the output that carries them. A FINAL_ONLY request gets none until it ends; a DELTA
        request none in a call that brought it nothing new."""
        commands: list[Command] = []
        # request id -> (state, finished), in the order the core sent them; a later output of the
        # same request (a client in another process delivers several steps at once) replaces it
        touched: dict[str, tuple[RequestState, bool]] = {}
        requests = self._requests
        apply = self._apply
        for out in outputs:
            if isinstance(out, CoreTokenRows):
                self._take_rows(out, touched, commands)
                continue
            state = requests.get(out.request_id)
            if state is not None:  # else aborted or failed here; the core has been told
                apply(state, out, touched, commands)
        results = []
        output = self._output
        for state, finished in touched.values():
            if state.streams or finished:  # beam search, best_of > n, FINAL_ONLY: the final output only
                result = output(state, finished=finished)
                if result is not None:
                    results.append(result)
        return results, commands

    def _apply(self, state: RequestState, out: CoreOutput, touched: dict[str, tuple[RequestState, bool]],
               commands: list[Command]) -> None:
        """One core output of a request known here: its samples' tokens, its metrics and counts, its
        end (a finished request leaves the table, ranked when best_of > n)."""
        if out.metrics is not None:
            state.metrics = out.metrics
            state.metrics_unsent = True
        if out.num_cached_tokens is not None:
            state.num_cached_tokens = out.num_cached_tokens
            state.cached_tokens_by_tier = out.cached_tokens_by_tier
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        try:
            for c in out.samples:
                self._take(state, c, commands)
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer: this request fails, the others go on
            self._fail_here(state, exc, commands)
        if out.error is not None:
            if state.error is None:
                state.error, state.error_by_request, state.error_param = out.error, out.error_by_request, out.error_param
            self._end(state, "error")
        self._touch(state, touched)

    def _take_rows(self, rows: CoreTokenRows, touched: dict[str, tuple[RequestState, bool]],
                   commands: list[Command]) -> None:
        """A step's steady rows: each request's one new token. A request with one sample and no stop
        string takes it here, as ``_take`` takes one token with no top logprobs and no finish (the
        server's common case, once per request and step: no objects); any other request gets the
        ``CoreOutput`` the row stands for."""
        if not len(rows.request_ids) == len(rows.token_ids) == len(rows.logprobs):  # a malformed message: take none
            raise ValueError(f"CoreTokenRows: {len(rows.request_ids)} request ids, {len(rows.token_ids)} tokens and "
                             f"{len(rows.logprobs)} logprobs; need one of each per row")
        requests = self._requests
        for request_id, token, logprob in zip(rows.request_ids, rows.token_ids, rows.logprobs):
            state = requests.get(request_id)
            if state is None:
                continue  # aborted or failed here; the core has been told
            if not state.plain_stream:
                self._apply(state, CoreOutput(request_id, [CoreSampleOutput(0, [token], [logprob])], False, None),
                            touched, commands)
                continue
            s = state.samples[0]
            if s.finish_reason is None:
                try:
                    take_plain_token(s, token, logprob, state.detokenize)
                except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer: this request fails, the others go on
                    self._fail_here(state, exc, commands)
                    self._touch(state, touched)
                    continue
            touched[request_id] = (state, False)  # one running sample, no stop string: still running

    def _fail_here(self, state: RequestState, exc: Exception, commands: list[Command]) -> None:
        """The front end failed the request (its text could not be made): it ends with "error"
        and the core is told to abort it."""
        if state.error is None:
            state.error, state.error_by_request = error_text(exc)
            state.error_param = error_param(exc)
        self._end(state, "error")
        commands.append(Abort(state.request_id))

    def _touch(self, state: RequestState, touched: dict[str, tuple[RequestState, bool]]) -> None:
        """Notes the request for this call's outputs; a finished one leaves the table (best_of > n
        ranked first; a beam search's hypotheses come ranked by score already)."""
        finished = state.finished
        touched[state.request_id] = (state, finished)
        if finished:
            del self._requests[state.request_id]
            if state.ended is None and state.shape.num_outputs < state.shape.num_samples and not state.beam:
                _rank_by_cumulative_logprob(state)

    # ---- one sample's tokens -----------------------------------------------------------

    def _sample(self, state: RequestState, index: int) -> SampleText:
        while len(state.samples) <= index:
            detok = None
            deferred = False
            if isinstance(state.params, SamplingParams):
                detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, state.params.skip_special_tokens)
                # no output before the end and no stop string: nothing reads the text as it grows
                deferred = not state.streams and not state.params.stop and state.detokenize
            state.samples.append(SampleText(len(state.samples), detok, deferred=deferred))
        return state.samples[index]

    def _take(self, state: RequestState, c: CoreSampleOutput, commands: list[Command]) -> None:
        samples = state.samples
        s = samples[c.index] if c.index < len(samples) else self._sample(state, c.index)
        if s.finish_reason is not None:
            return  # a stop string ended it here; the core computed on before it heard
        params = state.params
        if state.beam:
            assert isinstance(params, BeamSearchParams)
            take_hypothesis(s, c, params, self.tokenizer)
        elif s.deferred:
            take_deferred(s, c)
        else:
            assert isinstance(params, SamplingParams)
            if take_tokens(s, c, params, state.detokenize):
                commands.append(FinishSample(state.request_id, s.index, "stop", s.stop_reason))

    # ---- outputs ---------------------------------------------------------------------

    def _end(self, state: RequestState, reason: str) -> None:
        for s in state.samples:
            if not s.finished:
                if s.deferred:
                    replay_text(s)  # aborted or failed: the text so far, unflushed
                s.finish_reason = reason
        for index in range(len(state.samples), state.shape.num_samples):  # samples never forked
            self._sample(state, index).finish_reason = reason
        state.ended = state.ended or reason

    def _output(self, state: RequestState, with_metrics: Optional[bool] = None,
                finished: Optional[bool] = None) -> Optional[RequestOutput]:
        """The output since the previous one (CUMULATIVE, FINAL_ONLY: cumulative fields plus deltas;
        DELTA: the deltas only, None when there are none); the metrics when no output carried them
        yet (a client in another process sends them once, with the first token). ``finished``:
        ``state.finished`` when the caller knows it."""
        if finished is None:
            finished = state.finished
        if (state.one_delta and not finished and with_metrics is None and not state.metrics_unsent
                and state.prompt_logprobs is None):
            # the server's common case, once per request and step: its one sample's news, nothing else due
            completion = one_delta_completion(state.samples[0])
            if completion is None:
                return None
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], False,
                                 state.error, {}, state.num_cached_tokens, state.cached_tokens_by_tier, None,
                                 state.error_by_request, state.error_param)
        delta = state.delta
        # Hold back text that might still turn out to be the start of a stop string.
        longest_hold = state.longest_hold
        samples = state.samples[: state.shape.num_outputs] if finished else state.samples
        outs = delta_completions(samples, longest_hold) if delta else cumulative_completions(samples, longest_hold)
        if delta and not outs:
            return None
        if with_metrics is None:
            with_metrics = state.metrics_unsent
        state.metrics_unsent = False
        metrics = state.metrics.as_dict() if with_metrics else {}
        if with_metrics and finished and "finished_time" not in metrics:  # it ended here (a stop string, an abort)
            metrics["finished_time"] = time.monotonic()
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:  # vLLM's DELTA: they go once
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        # positional, in RequestOutput's field order (keywords cost a batch of 256 a tenth of this call)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, finished, state.error,
                             metrics, state.num_cached_tokens, state.cached_tokens_by_tier, prompt_logprobs,
                             state.error_by_request, state.error_param)


def _rank_by_cumulative_logprob(state: RequestState) -> None:
    """Best first (ties: the lower index first), renumbered, so that the first n are the output."""
    ranked = sorted(state.samples, key=lambda s: (-(s.cumulative_logprob or 0.0), s.index))
    for index, s in enumerate(ranked):
        s.index = index
    state.samples = ranked
