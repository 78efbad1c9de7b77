"""Input processing: a request's prompt and settings checked and tokenized, before any state changes.

Everything that can reject a request happens here, on plain Python values, so the
engine touches the core only with input already known to be valid (the hardening
rule: validate and build first, touch the core last, roll back on any failure).
Each error names the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from pagedrs.beam_search import BeamSearchParams
from pagedrs.core.continuation import request_shape
from pagedrs.core.protocol import CoreRequest
from pagedrs.core.structured import grammar
from pagedrs.errors import FieldError
from pagedrs.sampling_params import RequestOutputKind, SamplingParams
from pagedrs.tokenizer import TokenIdsOnly

PromptType = Union[str, list[int], dict[str, Any]]

MAX_REQUEST_ID_CHARS = 512
MAX_CACHE_SALT_BYTES = 256
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # lower runs first; the core keeps an i64 and ages it


@dataclass(frozen=True)
class ProcessedRequest:
    request_id: str
    prompt: Optional[str]  # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: Union[SamplingParams, BeamSearchParams]
    priority: int
    arrival_time: Optional[float] = None
    cache_salt: Optional[str] = None

    def core_request(self) -> CoreRequest:
        return CoreRequest(self.request_id, self.prompt_token_ids, self.params, self.priority, self.arrival_time,
                           self.cache_salt, stream_tokens=reads_tokens_as_they_come(self.params))


def outputs_before_end(params: Union[SamplingParams, BeamSearchParams]) -> bool:
    """Whether a request gets outputs before it finishes: not beam search, not ``best_of > n``
    (its samples are ranked at the end), not ``FINAL_ONLY``."""
    if isinstance(params, BeamSearchParams):
        return False
    return request_shape(params).streams and params.output_kind != RequestOutputKind.FINAL_ONLY


def reads_tokens_as_they_come(params: Union[SamplingParams, BeamSearchParams]) -> bool:
    """Whether the front end needs a request's tokens step by step (``CoreRequest.stream_tokens``): it
    hands out outputs before the end, or a stop string (a text rule, which only the front end can
    check) may end a sample at any token. When not, the core sends them all once, at the end: at
    batch 32 a CoreOutput per request and step was a tenth of a step's host time (issue 25)."""
    return outputs_before_end(params) or (isinstance(params, SamplingParams) and bool(params.stop))


class InputProcessor:
    """Turns (request_id, prompt, params, priority) into a ProcessedRequest or a ValueError."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_n: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_n = max_n

    def process(
        self, request_id: Any, prompt: Any, params: Any, priority: Any, arrival_time: Any = None, cache_salt: Any = None,
    ) -> ProcessedRequest:
        """``arrival_time`` (``time.monotonic()``; None: when the core takes it) is when a front end
        received the request; ``cache_salt`` a string of 1 to 256 UTF-8 bytes, or None (a dict prompt may
        carry it too, as vLLM's do)."""
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise FieldError("cache_salt", f"request {request_id!r}: the prompt's cache_salt "
                                 f"{prompt['cache_salt']!r} differs from the cache_salt argument {cache_salt!r}")
            cache_salt = prompt["cache_salt"]
        check_cache_salt(cache_salt)
        if arrival_time is not None and (
            isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) or not math.isfinite(arrival_time)
        ):  # a NaN would poison the latency histograms' sums for the server's lifetime
            raise ValueError(f"arrival_time is {arrival_time!r}; it must be a finite time.monotonic() value or None")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise ValueError(
                f"request_id is {str(request_id)[:80]!r}; it must be a non-empty string of at most "
                f"{MAX_REQUEST_ID_CHARS} characters"
            )
        params = params if params is not None else SamplingParams()
        if type(params) not in (SamplingParams, BeamSearchParams):
            raise TypeError(
                f"request {request_id!r}: params must be SamplingParams or BeamSearchParams, not {type(params).__name__}"
            )
        field, width = _width(params)
        if width > self.max_n:
            raise ValueError(
                f"{type(params).__name__}.{field}={width} is out of range: allowed 1 <= {field} <= {self.max_n} "
                "(EngineArgs.max_n)"
            )
        if isinstance(params, SamplingParams) and params.use_beam_search:
            params = BeamSearchParams.from_sampling_params(params)  # the engine runs one beam search
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) or not (
            PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]
        ):
            raise FieldError(
                "priority", f"request {request_id!r}: priority is {priority!r}; it must be an int in "
                f"[{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]"
            )
        if getattr(params, "stop", None) and isinstance(self.tokenizer, TokenIdsOnly):
            raise ValueError(
                f"request {request_id!r}: stop strings need a tokenizer, but the engine was built with "
                "skip_tokenizer_init=True; use stop_token_ids instead"
            )
        self._check_structured(request_id, params)
        if isinstance(params, SamplingParams):
            self._check_vocabulary(request_id, params)
        text, token_ids = self._tokenize(request_id, prompt)
        return ProcessedRequest(request_id, text, token_ids, params, int(priority), arrival_time, cache_salt)

    def _check_vocabulary(self, request_id: str, params: SamplingParams) -> None:
        """Token ids that bias, restrict or stop sampling must be the model's: a FieldError naming the field
        (a stop token the model cannot draw would never stop anything: a field silently without effect)."""
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                          ("stop_token_ids", params.stop_token_ids)):
            if ids:
                top = max(ids)
                if top >= self.vocab_size:
                    raise FieldError(name, f"request {request_id!r}: {name} has token id {top}, outside the "
                                           f"vocabulary [0, {self.vocab_size})")

    def _check_structured(self, request_id: str, params: Union[SamplingParams, BeamSearchParams]) -> None:
        """A grammar that does not compile is refused here, with llguidance's message (cached per spec)."""
        structured = params.structured_outputs
        if structured is None:
            return
        if isinstance(self.tokenizer, TokenIdsOnly):
            raise ValueError(
                f"request {request_id!r}: structured_outputs need a tokenizer (the grammar is matched against "
                "its tokens), but the engine was built with skip_tokenizer_init=True"
            )
        grammar.check(structured)

    def _tokenize(self, request_id: str, prompt: Any) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(map(str, prompt.keys() - _PROMPT_KEYS))
            if unknown:  # never dropped without a word (multi_modal_data: this engine runs text models only)
                raise FieldError("prompt", f"request {request_id!r}: a dict prompt has key(s) {unknown} this engine "
                                 f"does not support; allowed: {sorted(_PROMPT_KEYS)}")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")  # vLLM's TokensPrompt: the ids' text, shown as the output's prompt
                if text is not None and not isinstance(text, str):
                    raise FieldError("prompt", f"request {request_id!r}: the prompt's 'prompt' beside "
                                     f"'prompt_token_ids' is {type(text).__name__}; it must be the ids' text (a str)")
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, str):
                    raise FieldError(
                        "prompt", f"request {request_id!r}: prompt_token_ids is a string; it must be a list of ints"
                    )
                return text, self._checked_ids(request_id, ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise FieldError(
                    "prompt", f"request {request_id!r}: a dict prompt needs 'prompt_token_ids' or 'prompt'; "
                    f"got keys {sorted(map(str, prompt))}"
                )
        if isinstance(prompt, str):
            if len(prompt) > 64 * self.max_model_len:  # no tokenizer packs 64 characters per token
                raise FieldError(
                    "prompt", f"request {request_id!r}: the prompt has {len(prompt)} characters; it cannot fit "
                    f"max_model_len = {self.max_model_len} tokens"
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800" from JSON
                raise FieldError(
                    "prompt", f"request {request_id!r}: the prompt is not valid Unicode text: {exc.reason} "
                    f"(character {exc.object[exc.start]!r} at index {exc.start})"
                ) from None
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        else:
            return None, self._checked_ids(request_id, prompt)
        if not token_ids:
            raise FieldError("prompt", f"request {request_id!r}: the prompt is empty; at least 1 token is needed")
        if len(token_ids) > self.max_model_len:
            raise self._too_long(request_id, len(token_ids))
        return text, token_ids

    def _checked_ids(self, request_id: str, prompt: Any) -> list[int]:
        """A prompt given as token ids: in the vocabulary, 1 to max_model_len of them."""
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise FieldError(
                "prompt", f"request {request_id!r}: prompt must be a str, a list of token ids or a dict; "
                f"got {type(prompt).__name__}"
            )
        token_ids = self._token_ids(request_id, prompt)
        if not token_ids:
            raise FieldError("prompt", f"request {request_id!r}: the prompt is empty; at least 1 token is needed")
        return token_ids

    def _too_long(self, request_id: str, tokens: int) -> FieldError:
        return FieldError(
            "prompt", f"request {request_id!r}: the prompt has {tokens} tokens; max_model_len is {self.max_model_len}"
        )

    def _token_ids(self, request_id: str, prompt: Any) -> list[int]:
        if len(prompt) > self.max_model_len:  # before reading a huge list
            raise self._too_long(request_id, len(prompt))
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
                raise FieldError(
                    "prompt", f"request {request_id!r}: a token-id array must be 1-D of integers; "
                    f"got {prompt.dtype} {prompt.shape}"
                )
            token_ids = prompt.tolist()  # Python ints: a uint64 past 2**63 keeps its value (astype wrapped it to < 0)
        else:
            for t in prompt:  # bools are ints to Python, but never token ids
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise FieldError("prompt", f"request {request_id!r}: token id {t!r} is not an int")
            token_ids = [int(t) for t in prompt]
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise FieldError(
                    "prompt", f"request {request_id!r}: token id {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        return token_ids


# The keys a dict prompt may have (vLLM's TextPrompt / TokensPrompt, less the multimodal ones).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def _width(params: Union[SamplingParams, BeamSearchParams]) -> tuple[str, int]:
    """The field that sets how many sequences the request holds at once, and its value."""
    if isinstance(params, BeamSearchParams):
        return "beam_width", params.beam_width
    if params.use_beam_search:
        field = "beam_width" if params.beam_width is not None else "best_of" if params.best_of is not None else "n"
        return field, params.beam_search_width
    return ("best_of", params.best_of) if params.best_of is not None else ("n", params.n)


def check_cache_salt(cache_salt: object) -> None:
    """ValueError naming ``cache_salt`` when it is not None or a string of 1 to 256 UTF-8 bytes."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt is {cache_salt!r} ({type(cache_salt).__name__}); it must be a string or None")
    try:
        raw = cache_salt.encode("utf-8", errors="strict")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"cache_salt is not valid UTF-8 text ({exc.reason} at index {exc.start})") from None
    if not 1 <= len(raw) <= MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt is {len(raw)} UTF-8 bytes; it must be 1 to {MAX_CACHE_SALT_BYTES}")
