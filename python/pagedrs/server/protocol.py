"""Request and response bodies of the OpenAI-compatible endpoints, as pydantic models.

Shape is checked here, strictly: integers are JSON integers (``true`` is not a token
id), floats are finite (Python's json reads ``NaN`` and ``Infinity``), and text is
valid Unicode (JSON can spell a lone surrogate, ``"\ud800"``, which no tokenizer can
encode). Besides shape, this layer bounds only what must fit a machine type or a
server resource — ``priority`` (int32), ``seed`` (int64), ``top_k`` (int32), ``n``,
token ids, the stop list — so that a hostile number is a 400 here and never an
overflow inside a batched step. Sampling ranges proper are checked in one place,
``pagedrs.SamplingParams``, whose ValueError the server turns into a 400, so the HTTP
API and the Python API accept the same values.
Fields OpenAI defines but pagedrs cannot honour (``suffix``, ``logit_bias``) are
rejected with a 400 instead of silently ignored. ``best_of`` is OpenAI's (draw best_of,
return the n with the highest cumulative log-probability); ``use_beam_search``,
``length_penalty`` and ``early_stopping`` are vLLM v0's extension (beam width = best_of,
else n; the n best hypotheses are returned). Neither can be streamed.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

# Request fields that map one-to-one onto SamplingParams fields of the same name.
SAMPLING_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
)

# OpenAI's legacy completions default; chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16


# --- wire limits (see docs/limits_and_safety.md) ----------------------------------------

MAX_N = 128  # samples per prompt; SamplingParams bounds n as well
MAX_STOP_STRINGS = 16  # entries in `stop`
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64  # entries in `stop_token_ids`
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1  # seeds: the engine seeds sample i with seed + i, inside torch's 64-bit range
MAX_PRIORITY = 2**31  # |priority| <= 2**31: the scheduler keeps priorities in 64-bit integers


def _valid_unicode(text: str) -> str:
    """Reject lone surrogates: JSON can spell them, UTF-8 (and so every tokenizer) cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text has a lone surrogate {text[exc.start]!r} at character {exc.start}; "
            "text must be valid Unicode (surrogates only in pairs)"
        ) from None
    return text


def _not_a_bool(value: Any) -> Any:
    """JSON's true/false are not integers here (Python and pydantic's lax mode treat them as 1/0)."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got the boolean {str(value).lower()}")
    return value


# Every string of a request body goes through Text, every integer through Int: an integral
# number (5 or 5.0, as JSON Schema's "integer"), never a boolean.
Text = Annotated[str, AfterValidator(_valid_unicode)]
Int = Annotated[int, BeforeValidator(_not_a_bool)]
TokenId = Annotated[Int, Field(ge=0, le=INT32_MAX)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_valid_unicode)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _Strict(BaseModel):
    """Finite floats everywhere (no NaN / Infinity)."""

    model_config = ConfigDict(allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingRequest(_Strict):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text
    n: Annotated[Int, Field(le=MAX_N)] = 1
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[Int, Field(ge=0, le=INT64_MAX)] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    # extensions (vLLM's names)
    top_k: Annotated[Int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: Int | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    priority: Annotated[Int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None  # OpenAI's completions field (vLLM v0: chat too)
    use_beam_search: StrictBool | None = None
    length_penalty: float | None = None
    early_stopping: StrictBool | Literal["never"] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments the client actually sent (None means 'default')."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: StrictBool = False
    logprobs: Int | None = None
    suffix: Text | None = None


class ChatContentPart(_Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: Text
    text: Text | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Text
    content: Text | list[ChatContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    max_completion_tokens: Int | None = None  # the newer name of max_tokens; wins when both are set
    add_generation_prompt: StrictBool = True


# --- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions layout: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedrs"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
