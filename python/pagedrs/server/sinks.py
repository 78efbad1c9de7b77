"""Sink: where one engine request's outputs go, as deltas, and what its latency was.

The engine thread turns each ``RequestOutput`` into a ``RequestDelta`` (snapshots, copied
here: the handler reads them after the engine moved on), records the request's latency
(time to first token, inter-token latency, and where the first token's time went), and
puts the delta on the handler's ``DeltaStream``. One sink per engine request; the
EngineLoop keeps them by request id and owns nothing else about a request's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedrs.server.deltas import DeltaStream, RequestDelta, SampleDelta
from pagedrs.server.metrics import ServerMetrics
from pagedrs.server.request_trace import RequestTrace

__all__ = ["Sink"]


@dataclass
class Sink:
    """One engine request's delta stream and latency bookkeeping (engine thread only)."""

    stream: DeltaStream
    tag: int  # which prompt of the HTTP request this engine request serves
    arrival: float
    deadline: float | None = None  # time.monotonic() past which it is aborted with a 504 (request_timeout_s)
    last_token_time: float | None = None
    timed: bool = False  # its first token's metrics are recorded
    num_cached_tokens: int = 0  # as last reported (the engine may report it with the first output only)
    cached_tokens_by_tier: dict[str, int] | None = None  # likewise
    # samples whose finish went out: an n > 1 request's later outputs repeat them (CUMULATIVE), and a
    # repeat would be one more chunk with that choice's finish_reason (OpenAI sends one per choice)
    finished_samples: set[int] = field(default_factory=set)

    def delta_of(self, output: Any) -> RequestDelta:
        """``output`` (a RequestOutput) as the delta its handler reads."""
        reported = getattr(output, "num_cached_tokens", None)  # None: not in this output
        if reported is not None:
            self.num_cached_tokens = int(reported)
        by_tier = getattr(output, "cached_tokens_by_tier", None)
        if by_tier is not None:
            self.cached_tokens_by_tier = dict(by_tier)
        error = getattr(output, "error", None)
        return RequestDelta(
            tag=self.tag,
            request_id=output.request_id,
            prompt_token_ids=list(output.prompt_token_ids),
            samples=self._news(output.outputs),
            finished=bool(output.finished),
            error=error,
            error_status=400 if error is not None and getattr(output, "error_by_request", False) else 500,
            error_param=getattr(output, "error_param", None) if error is not None else None,
            num_cached_tokens=self.num_cached_tokens,
            cached_tokens_by_tier=self.cached_tokens_by_tier,
            prompt_logprobs=getattr(output, "prompt_logprobs", None),
        )

    def _news(self, completions: Any) -> list[SampleDelta]:
        """Each sample's delta, leaving out a finished sample that brings nothing new (its finish went out)."""
        samples = []
        for c in completions:
            if c.index in self.finished_samples and not c.delta_token_ids and not c.delta_text:
                continue
            samples.append(_snapshot(c))
            if c.finish_reason is not None:
                self.finished_samples.add(c.index)
        return samples

    def observe(self, output: Any, delta: RequestDelta, metrics: ServerMetrics, trace: RequestTrace | None,
                now: float) -> None:
        """Records the latency ``output`` shows: its first token's breakdown once, TTFT or ITL when
        it carries tokens, and each sample's finish reason in the delta that ends it."""
        stamps = getattr(output, "metrics", None) or {}
        if not self.timed and "first_token_time" in stamps:
            self.timed = True
            self._observe_first_token(output.request_id, stamps, metrics, trace, now)
        if any(s.token_ids for s in delta.samples):
            if self.last_token_time is None:
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                metrics.inter_token_latency.observe(now - self.last_token_time)
            self.last_token_time = now
        for s in delta.samples:  # each sample's finish comes in one delta (``_news``): counted there
            if s.finish_reason is not None:
                metrics.requests.labels(finish_reason=str(s.finish_reason)).inc()

    def _observe_first_token(self, request_id: str, stamps: dict[str, float], metrics: ServerMetrics,
                             trace: RequestTrace | None, now: float) -> None:
        """Where the time to a request's first token went (the engine's stamps, then ours)."""
        queued, scheduled = stamps.get("queued_time"), stamps.get("first_scheduled_time")
        if queued is None or scheduled is None:
            return
        metrics.handoff_time.observe(max(0.0, queued - self.arrival))
        metrics.queue_time.observe(scheduled - queued)
        metrics.prefill_time.observe(stamps["first_token_time"] - scheduled)
        if trace is not None:
            trace.record(request_id, self.arrival, stamps, now)

    def fail(self, request_id: str, message: str, status: int, code: str | None) -> bool:
        """Hands the handler ``message`` as the request's last delta."""
        return self.stream.put(RequestDelta(self.tag, request_id, [], [], finished=True, error=message,
                                            error_status=status, error_code=code))


# The least log-probability a response shows (vLLM's floor): a token the grammar masks has -inf
# under the constrained distribution, which JSON cannot carry (json.dumps refuses it: a 500, or null
# in a stream, against OpenAI's schema).
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` as a response carries it: at least ``LOGPROB_FLOOR`` (-inf and NaN become the floor)."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _snapshot(completion: Any) -> SampleDelta:
    new_ids = list(completion.delta_token_ids)
    logprobs = None
    if completion.logprobs is not None and new_ids:
        logprobs = [{t: json_logprob(lp) for t, lp in d.items()} for d in completion.logprobs[-len(new_ids):]]
    return SampleDelta(
        index=completion.index,
        text=completion.delta_text,
        token_ids=new_ids,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )
