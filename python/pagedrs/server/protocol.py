"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (the responses: responses.py).

Shape is checked here, strictly: integers are JSON integers (``true`` is not a token
id), floats are finite (Python's json reads ``NaN`` and ``Infinity``), and text is
valid Unicode (JSON can spell a lone surrogate, ``"\ud800"``, which no tokenizer can
encode). Besides shape, this layer bounds only what must fit a machine type or a
server resource — ``priority`` (int32), ``seed`` (int64), ``top_k`` (int32), ``n``,
token ids, the stop list — so that a hostile number is a 400 here and never an
overflow inside a batched step. Sampling ranges proper are checked in one place,
``pagedrs.SamplingParams``, whose ValueError the server turns into a 400, so the HTTP
API and the Python API accept the same values.
Every field is honoured or refused with a 400 naming it, never silently ignored
(field_policy.py: the fields OpenAI defines that pagedrs does not implement yet, the few
accepted and ignored on purpose, and the message for an unknown name). ``best_of`` is OpenAI's (draw best_of,
return the n with the highest cumulative log-probability); ``use_beam_search``,
``length_penalty`` and ``early_stopping`` are vLLM v0's extension (beam width = best_of,
else n; the n best hypotheses are returned). Neither can be streamed.

This module holds the request bodies (the fields both endpoints share, then each endpoint's own);
the strict field types and wire limits they are built of are wire_types.py's, a chat request's
messages and tools chat_messages.py's (both re-exported here).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from pagedrs.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGPROBS, MAX_TOKENS_LIMIT
from pagedrs.server.chat_messages import (  # noqa: F401  (the message and tool models are re-exported)
    _AUDIO,
    _TOOLS,
    MAX_TOOLS,
    CalledFunction,
    ChatContentPart,
    ChatMessage,
    HistoryToolCall,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolFunction,
)
from pagedrs.server.field_policy import not_supported
from pagedrs.server.wire_types import (  # noqa: F401  (the field types and limits are re-exported)
    INT32_MAX,
    INT64_MAX,
    MAX_CACHE_SALT_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_N,
    MAX_PRIORITY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_PRIORITY,
    CacheSalt,
    Float,
    Int,
    LogitBias,
    StopText,
    Text,
    TokenId,
    _between,
    _Strict,
    null_is,
)

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
    "logit_bias",
    "allowed_token_ids",
)

# OpenAI's legacy completions default; chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16


# Reasons for the fields OpenAI (or vLLM) defines that pagedrs does not implement yet.
_GUIDED = "vLLM's guided decoding options beyond the constraint itself"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    include_obfuscation: Annotated[Any, not_supported("stream obfuscation", False)] = None


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: the schema the answer follows."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", populate_by_name=True)

    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the answer always follows the schema: true and false alike


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_only_with_its_type(self) -> ResponseFormat:
        if self.json_schema is not None and self.type != "json_schema":
            raise PydanticCustomError("json_schema_without_type",
                                      'json_schema is only allowed with type "json_schema", not {type}',
                                      {"type": repr(self.type)})
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (its StructuredOutputsParams): exactly one of these."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", populate_by_name=True)

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:  # "json", as the client and StructuredOutputsParams say
        dumped = super().model_dump(**kwargs)
        if "json_" in dumped:
            dumped["json"] = dumped.pop("json_")
        return dumped


class _SamplingRequest(_Strict):
    """Fields shared by both endpoints (see field_policy.py for what is refused and ignored)."""

    model: Text
    n: Annotated[Int, Field(le=MAX_N), null_is(1)] = 1
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Annotated[Int, Field(ge=0, le=INT64_MAX)] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stream: Annotated[StrictBool, null_is(False)] = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias in [-100, 100], added to its logit
    user: Text | None = None  # ignored on purpose (field_policy.IGNORED_FIELDS)
    cache_salt: CacheSalt | None = None  # vLLM's: requests share cached pages only under the same salt
    return_token_ids: StrictBool | None = None  # vLLM's: prompt and generated token ids beside the text
    # structured outputs (server/structured.py): one of these per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None  # vLLM's older names
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # vLLM's extensions that pagedrs does not implement yet
    prompt_logprobs: Annotated[Any, not_supported("prompt log-probabilities are served by /v1/completions only")] = None
    guided_decoding_backend: Annotated[Any, not_supported(_GUIDED + ": the backend is llguidance", "llguidance")] = None
    guided_whitespace_pattern: Annotated[Any, not_supported(_GUIDED + ": JSON is generated compact")] = None
    # extensions (vLLM's names)
    top_k: Annotated[Int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    min_tokens: Int | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    priority: Annotated[Int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None  # OpenAI's completions field (vLLM v0: chat too)
    use_beam_search: StrictBool | None = None
    length_penalty: Float | None = None
    early_stopping: StrictBool | Literal["never"] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments the client actually sent (None means 'default')."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def returned_ids(self, ids: list[int]) -> list[int] | None:
        """``ids`` for a response field when the client sent ``return_token_ids: true``, else None (absent)."""
        return list(ids) if self.return_token_ids else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: Annotated[StrictBool, null_is(False)] = False
    logprobs: Int | None = None
    prompt_logprobs: Int | None = None  # vLLM's: SamplingParams.prompt_logprobs (bounded there)
    suffix: Annotated[Any, not_supported("text after the completion (insertion)", "")] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    logprobs: Annotated[StrictBool, null_is(False)] = False
    top_logprobs: Annotated[Int, _between(0, MAX_LOGPROBS)] | None = None  # SamplingParams.logprobs, named as sent
    # the newer name of max_tokens (both at once only when equal: chat.py), bounded here to be named as sent
    max_completion_tokens: Annotated[Int, _between(1, MAX_TOKENS_LIMIT)] | None = None
    add_generation_prompt: StrictBool = True
    # ignored on purpose (field_policy.IGNORED_FIELDS)
    safety_identifier: Text | None = None
    metadata: Annotated[dict[Text, Text], Field(max_length=MAX_METADATA_ENTRIES)] | None = None
    prompt_cache_key: Text | None = None
    # OpenAI's fields that pagedrs does not implement yet (null, or the value named, is what pagedrs does)
    # tool calling (server/tools.py): "required" and a named function, forced by a grammar
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: Annotated[Any, not_supported(_TOOLS)] = None
    function_call: Annotated[Any, not_supported(_TOOLS, "none")] = None
    modalities: Annotated[Any, not_supported(_AUDIO, ["text"])] = None
    audio: Annotated[Any, not_supported(_AUDIO)] = None
    store: Annotated[Any, not_supported("stored completions: pagedrs stores nothing", False)] = None
    service_tier: Annotated[Any, not_supported("service tiers: pagedrs has one", "auto", "default")] = None
    prediction: Annotated[Any, not_supported("predicted outputs")] = None
    reasoning_effort: Annotated[Any, not_supported("reasoning controls")] = None
    verbosity: Annotated[Any, not_supported("verbosity controls")] = None
    web_search_options: Annotated[Any, not_supported("web search")] = None
    moderation: Annotated[Any, not_supported("moderation")] = None
    prompt_cache_retention: Annotated[Any, not_supported("prompt cache retention policies")] = None
    prompt_cache_options: Annotated[Any, not_supported("prompt cache options")] = None


# --- responses -------------------------------------------------------------------------
