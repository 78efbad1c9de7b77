"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str = ""  # cumulative text so far
    token_ids: list[int] = field(default_factory=list)  # cumulative generated tokens
    delta_text: str = ""  # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)  # tokens new since the previous output
    finish_reason: Optional[str] = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string that ended it
    logprobs: Optional[list[dict[int, float]]] = None  # per generated token, when requested
    cumulative_logprob: Optional[float] = None
    score: Optional[float] = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: Optional[str] = None  # set when the request ended with finish_reason "error"
    metrics: dict[str, float] = field(default_factory=dict)  # arrival_time, first_token_time, finished_time (time.monotonic)
    # prompt tokens whose K/V the core reused from the prefix cache at the request's first
    # admission (any tier; after a failed step reset it before its first token, at the admission
    # that followed); None until it was first scheduled (OpenAI's cached_tokens)
    num_cached_tokens: Optional[int] = None
    # that count by the tier the tokens were found on, {"device": .., "host": .., "disk": ..}
    # (a host or disk hit was copied back to the device first); None until first scheduled, or
    # after such a reset when the core cannot split the new count
    cached_tokens_by_tier: Optional[dict[str, int]] = None
    # SamplingParams.prompt_logprobs: per prompt token {its id: logprob, then the top-k alternatives},
    # the first token's entry None (vLLM's shape); None until the whole prompt ran, and when not asked
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    # with ``error``: the request's own input caused it (a bad grammar, a field the engine could only
    # check while running: a server answers 400), not the engine or the model (500)
    error_by_request: bool = False
    error_param: Optional[str] = None  # with ``error_by_request``: the request field it names (a server's ``param``)
