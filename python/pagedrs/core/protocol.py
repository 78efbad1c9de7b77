"""Every value that crosses the engine-core boundary, typed, in one file.

The core takes token ids in and gives token ids out; it never holds a string of
generated text. What goes in: ``CoreRequest`` (through ``Add``), ``Abort`` and
``FinishSample`` (the front end found a stop string). What comes out: per step one
``CoreOutputs`` (a ``CoreOutput`` per request that progressed, except that the steady decode
rows come together as one ``CoreTokenRows``, and the stats when the client asked for them).
The errors that end the engine are types here too.

Every field is a plain value (ints, floats, strings, lists, dicts of them, the params
dataclasses), so a client that puts the core in another process can encode a value as
the tuple of its fields, in field order, recursively (``pagedrs.frontend.codec``):
a field added here travels without anything else changing.

Designed for what comes next: ``new_token_ids`` is a list (several tokens per sequence
per step: speculative decoding), and nothing in an output refers to the step that made
it (two steps in flight at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pagedrs.beam_search import BeamSearchParams
from pagedrs.sampling_params import SamplingParams
from pagedrs.stats import EngineStats

Params = Union[SamplingParams, BeamSearchParams]


@dataclass(frozen=True)
class CoreRequest:
    request_id: str
    prompt_token_ids: list[int]  # validated: non-empty, inside the vocabulary, at most max_model_len
    params: Params  # SamplingParams (n, best_of) or BeamSearchParams; use_beam_search already turned into the latter
    priority: int  # lower runs first
    arrival_time: Optional[float]  # time.monotonic() when a front end received it; None: when the core takes it
    cache_salt: Optional[str]  # validated (1 to 256 UTF-8 bytes); shares prefix pages only with the same salt
    # Whether the front end reads the request's tokens while it runs (outputs before the end, or a stop
    # string to look for in the growing text). False: the core sends its output once, when it ends
    # (FINAL_ONLY, best_of > n, no stop string), with every token: no CoreOutput per request and step.
    stream_tokens: bool = True


@dataclass
class RequestMetrics:
    """When a request reached each stage (time.monotonic, comparable across processes), as vLLM's RequestMetrics."""

    arrival_time: float  # at the front end
    queued_time: float  # taken by the core
    first_scheduled_time: Optional[float] = None  # the start of its first step
    num_steps_queued: int = 0  # steps that ran without it before its first (admission said no)
    first_token_time: Optional[float] = None  # its first sampled token
    num_prefill_steps: int = 0  # steps it was in up to and including its first token's
    finished_time: Optional[float] = None

    def as_dict(self) -> dict[str, float]:
        """``RequestOutput.metrics``: only the stages reached."""
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
        return metrics


@dataclass
class CoreSampleOutput:
    """What one sample (of n, best_of, or a beam hypothesis) gained since its previous output."""

    index: int  # which sample of the request
    new_token_ids: list[int]  # generated tokens new since the previous output (a hypothesis: all of them)
    # the sampled token's log-probability, per new token (always: best_of ranks by their sum);
    # empty for beam search, whose scores come in cumulative_logprob / score
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: Optional[list[dict[int, float]]] = None  # per new token, when params.logprobs asked for them
    finish_reason: Optional[str] = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: Union[int, str, None] = None  # the stop token id that ended it (the core knows no strings)
    cumulative_logprob: Optional[float] = None  # beam search only: the hypothesis' sum (samples: the front end sums)
    score: Optional[float] = None  # beam search only: the length-penalized score


@dataclass
class CoreOutput:
    """One request's progress in one step."""

    request_id: str
    samples: list[CoreSampleOutput]  # the samples that exist (a finished request: all num_samples of them)
    finished: bool
    metrics: Optional[RequestMetrics]  # None: unchanged since the previous output (a client may send them once)
    error: Optional[str] = None  # set when the core ended it with finish_reason "error"
    num_cached_tokens: Optional[int] = None  # prompt tokens reused at its admission (the last, after a reset); None until scheduled
    # that count by the tier the tokens were found on: {"device": .., "host": .., "disk": ..}
    cached_tokens_by_tier: Optional[dict[str, int]] = None
    # SamplingParams.prompt_logprobs: vLLM's list (first entry None), in one output only, once complete
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    # with ``error``: the request's own input caused it (errors.REQUEST_CAUSED; a server's 400), not
    # the engine or the model (a 500)
    error_by_request: bool = False
    error_param: Optional[str] = None  # with ``error_by_request``: the request field it names (errors.error_param)


@dataclass
class CoreTokenRows:
    """The steady rows of one step, in columns: request ``request_ids[i]`` gained the one token
    ``token_ids[i]`` (sampled with log-probability ``logprobs[i]``) and nothing else changed.

    What ``CoreOutput(request_ids[i], [CoreSampleOutput(0, [token_ids[i]], [logprobs[i]])], False,
    None)`` would say, without two objects per request and step (at batch 32 those and the front
    end's handling of them were most of a step's fixed host cost, issue 25). A row is steady when
    its request is a running one-sample request on the core's fast rows (core/fast_rows.py) past
    its first output, with no top logprobs, no prompt logprobs, not finished by this token, every
    earlier token already sent. A request is in at most one element of a step's outputs, except
    that a steady row may be followed by its request's ``CoreOutput`` when the request failed later
    in the same step (that output then carries the failure, not the token again)."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


CoreOutputItem = Union[CoreOutput, CoreTokenRows]


@dataclass
class CoreOutputs:
    # in the order the core made them: across steps delivered together, a request's tokens in order
    outputs: list[CoreOutputItem] = field(default_factory=list)
    stats: Optional[EngineStats] = None  # when the client asked for them (a client in another process does)


# ---- commands (front end -> core) ---------------------------------------------------------


@dataclass(frozen=True)
class Add:
    request: CoreRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class FinishSample:
    """The front end ended one sample by a text rule (a stop string): the core frees its sequence."""

    request_id: str
    index: int
    reason: str  # "stop"
    stop_reason: Union[int, str, None]  # the stop string


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached page on every tier (device, host, disk): the core answers ``CacheReset``."""


@dataclass(frozen=True)
class CacheReset:
    """The core's answer to ``ResetPrefixCache``: the pages each tier dropped, or why it refused."""

    device: int
    host: int
    disk: int
    refused: Optional[str] = None  # set when requests held pages: nothing was cleared (PrefixCacheBusyError)


@dataclass(frozen=True)
class PinPrefix:
    """Pin a prompt's pages (core/pins.py): the core prefills it, then holds its full pages
    until ``Unpin`` or the TTL; it answers ``Pinned``."""

    token_ids: list[int]  # validated: non-empty, inside the vocabulary, at most max_model_len
    ttl_s: Optional[float]  # validated (pins.validate_ttl); None: until unpinned
    cache_salt: Optional[str]  # the chain the pages are pinned under (equally salted requests hit them)


@dataclass(frozen=True)
class PinState:
    """One live pin, as ``GET /v1/cache`` lists it."""

    pin_id: str
    num_tokens: int  # leading prompt tokens whose pages are pinned (whole pages only)
    num_pages: int
    ttl_s: Optional[float]
    expires_in_s: Optional[float]  # seconds left (monotonic clock); None: no TTL


@dataclass(frozen=True)
class Pinned:
    """The core's answer to ``PinPrefix``: the pin, or why it refused (nothing pinned then)."""

    pin: Optional[PinState]
    refused: Optional[str] = None
    refused_kind: Optional[str] = None  # "cap" (PinCapError) | "invalid" (ValueError)


@dataclass(frozen=True)
class Unpin:
    pin_id: str


@dataclass(frozen=True)
class Unpinned:
    pin_id: str
    found: bool  # False: no such pin (unknown, expired or unpinned already)


@dataclass(frozen=True)
class ListPins:
    """Ask for the live pins (expired ones are released first): the core answers ``PinList``."""


@dataclass(frozen=True)
class PinList:
    pins: list[PinState]


Command = Union[Add, Abort, FinishSample, ResetPrefixCache, PinPrefix, Unpin, ListPins]


# ---- errors --------------------------------------------------------------------------------


# The error types live in the base layer (pagedrs.errors) so that every layer may raise them;
# they are part of this protocol and re-exported here.
from pagedrs.errors import EngineCoreDeadError, EngineCoreError, EngineDeadError  # noqa: E402, F401


def is_engine_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` ends the engine: every error that does is an ``EngineDeadError`` (a dead
    core process, a failed scheduler, a tensor-parallel executor's ExecutorDeadError)."""
    return isinstance(exc, EngineDeadError)
