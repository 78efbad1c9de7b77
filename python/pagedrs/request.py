"""A request's state inside the engine: its samples, their text, and when they stop.

The scheduler only knows sequence ids and tokens; everything about text (detokenizing,
stop strings, deltas for streaming) lives here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedrs.outputs import CompletionOutput, RequestOutput
from pagedrs.sampling_params import SamplingParams
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Sample:
    """One of a request's n samples: one scheduler sequence."""

    seq_id: int
    index: int
    detokenizer: IncrementalDetokenizer
    generator: Optional[torch.Generator]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # visible text (a matched stop string cut off)
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: Optional[float] = None
    score: Optional[float] = None  # beam search: the hypothesis' length-penalized score
    sent_tokens: int = 0  # tokens already reported in an output
    sent_chars: int = 0  # characters of text already reported

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Any  # SamplingParams, or BeamSearchParams for beam search
    priority: int
    arrival: int  # engine-wide arrival counter
    samples: list[Sample]
    # Timestamps (time.monotonic, comparable across the server's processes), as vLLM's
    # RequestMetrics: arrival at the front end (the API process, or add_request), taken by the
    # engine (queued), the start of its first step (first scheduled), its first sampled token.
    arrival_time: float = field(default_factory=time.monotonic)
    queued_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: Optional[float] = None
    num_cached_tokens: Optional[int] = None  # prompt tokens the core reused at its first admission
    first_token_time: Optional[float] = None
    queued_step: int = 0  # the engine's step count when it was queued
    num_steps_queued: int = 0  # steps that ran without it before its first (admission said no)
    num_prefill_steps: int = 0  # steps it was in up to and including its first token's
    finished_time: Optional[float] = None
    error: Optional[str] = None
    forked: bool = False  # n > 1: children created after the first sample
    policy: Any = None  # the ContinuationPolicy its params chose (pagedrs.continuation)
    policy_state: Any = None  # what the policy keeps between steps (beam search: scores, pending rows)
    num_samples: int = 1  # sequences it may hold at once: best_of (or n), or the beam width
    num_outputs: int = 1  # a finished request reports its first num_outputs samples (its policy ranks them)
    streams: bool = True  # False: only the finished output means anything (beam search, best_of > n)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples) and len(self.samples) == self.num_samples

    def to_output(self) -> RequestOutput:
        """The output since the last call: cumulative fields plus deltas."""
        outs = []
        for s in self.samples[: self.num_outputs] if self.finished else self.samples:
            # Hold back text that might still turn out to be the start of a stop string.
            hold = 0 if s.finished else max((len(x) for x in getattr(self.params, "stop", ())), default=1) - 1
            visible = max(len(s.text) - hold, s.sent_chars)
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=s.text[:visible],
                    token_ids=list(s.token_ids),
                    delta_text=s.text[s.sent_chars : visible],
                    delta_token_ids=s.token_ids[s.sent_tokens :],
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    # the sample's own growing list, not a copy (a copy per step is quadratic in
                    # the output length); a consumer that keeps it past the next step copies it
                    logprobs=s.logprobs,
                    cumulative_logprob=s.cumulative_logprob,
                    score=s.score,
                )
            )
            s.sent_tokens = len(s.token_ids)
            s.sent_chars = visible
        metrics = {"arrival_time": self.arrival_time, "queued_time": self.queued_time}
        if self.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = self.first_scheduled_time
            metrics["time_in_queue"] = self.first_scheduled_time - self.queued_time
            metrics["num_steps_queued"] = self.num_steps_queued
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
            metrics["num_prefill_steps"] = self.num_prefill_steps
        if self.finished_time is not None:
            metrics["finished_time"] = self.finished_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            error=self.error,
            metrics=metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


def record_token(
    sample: Sample,
    token: int,
    logprob: float,
    top_logprobs: Optional[dict[int, float]],
    request: Request,
    tokenizer: Tokenizer,
    max_model_len: int,
) -> None:
    """Appends one sampled token and decides whether the sample is finished."""
    params = request.params
    sample.token_ids.append(token)
    # always (as vLLM v0): best_of ranks the samples by it
    sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + logprob
    if params.logprobs is not None:
        entry = {token: logprob}
        if top_logprobs:
            entry.update(top_logprobs)
        if sample.logprobs is None:
            sample.logprobs = []
        sample.logprobs.append(entry)  # in place: a copy per token would be quadratic
    num_out = len(sample.token_ids)
    is_eos = token in tokenizer.eos_token_ids and not params.ignore_eos
    is_stop_token = token in params.stop_token_ids
    detokenize = params.detokenize
    if (is_eos or is_stop_token) and num_out > params.min_tokens:
        # The stop token itself is not part of the text.
        if detokenize:
            sample.text += sample.detokenizer.flush()
        sample.finish_reason, sample.stop_reason = "stop", (token if is_stop_token else None)
        return
    if detokenize:
        delta = sample.detokenizer.step([token])
        previous = len(sample.text)
        sample.text += delta
        if params.stop and num_out > params.min_tokens and _apply_stop_strings(sample, params, previous):
            return
    if num_out >= params.max_tokens or len(request.prompt_token_ids) + num_out >= max_model_len:
        if detokenize:
            sample.text += sample.detokenizer.flush()
        sample.finish_reason = "length"


def _apply_stop_strings(sample: Sample, params: SamplingParams, previous: int) -> bool:
    """Finds a stop string that ends in the newest text; cuts the text at it."""
    stops: list[str] = params.stop  # type: ignore[assignment]  # normalized to a list by SamplingParams
    longest = max(len(s) for s in stops)
    search_from = max(0, previous - longest + 1)
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        at = sample.text.find(stop, search_from)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return False
    at, stop = best
    sample.text = sample.text[: at + len(stop)] if params.include_stop_str_in_output else sample.text[:at]
    sample.finish_reason, sample.stop_reason = "stop", stop
    return True
