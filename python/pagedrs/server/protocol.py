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
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagedrs.frontend.input_processor import PRIORITY_RANGE
from pagedrs.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SCHEMA_DEPTH,
    MAX_TOKENS_LIMIT,
    json_depth,
)
from pagedrs.server.field_policy import check_role, name_unknown_fields, not_supported

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


# --- wire limits (see docs/limits_and_safety.md) ----------------------------------------

MAX_N = 128  # samples per prompt; SamplingParams bounds n as well
MAX_STOP_STRINGS = 16  # entries in `stop`
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64  # entries in `stop_token_ids`
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1  # seeds: the engine seeds sample i with seed + i, inside torch's 64-bit range
MIN_PRIORITY, MAX_PRIORITY = PRIORITY_RANGE  # the engine's bounds (an int32), so none passes here to fail there
MAX_CACHE_SALT_BYTES = 256  # vLLM's bound on cache_salt (UTF-8 bytes); the engine refuses longer ones too
MAX_METADATA_ENTRIES = 16  # OpenAI's bound on `metadata`


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


def _json_number(kind: str) -> BeforeValidator:
    """A number field of ``kind`` ("an integer" or "a number": a float field takes an integer too,
    ``temperature: 1`` is 1.0) refuses JSON's true/false (Python and pydantic's lax mode read them as
    1/0: ``temperature: false`` was greedy) and strings (the lax mode reads "3" as 3): a wrong type
    is the client's mistake to hear about, not a value to guess."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected {kind}, got the boolean {str(value).lower()}")
        if isinstance(value, str):
            raise ValueError(f"expected {kind}, got the string {value[:40]!r}; send the number without quotes")
        return value

    return BeforeValidator(check)


# Every string of a request body goes through Text, every integer through Int: an integral
# number (5 or 5.0, as JSON Schema's "integer"), never a boolean or a string; every float
# through Float: a finite JSON number, never a boolean or a string.
def _salt_size(salt: str) -> str:
    size = len(salt.encode("utf-8"))
    if not 1 <= size <= MAX_CACHE_SALT_BYTES:
        raise PydanticCustomError(
            "cache_salt_size", "cache_salt has {size} bytes in UTF-8; allowed 1 to {limit}",
            {"size": size, "limit": MAX_CACHE_SALT_BYTES},
        )
    return salt


def _between(low: int, high: int) -> AfterValidator:
    """An integer in [low, high], the whole range named when it is not (pydantic's ge/le name one end)."""

    def check(value: int) -> int:
        if not low <= value <= high:
            raise PydanticCustomError("out_of_range", "{value} is out of range: allowed an integer in [{low}, {high}]",
                                      {"value": value, "low": low, "high": high})
        return value

    return AfterValidator(check)


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int = Annotated[int, _json_number("an integer")]
Float = Annotated[float, _json_number("a number")]
TokenId = Annotated[Int, Field(ge=0, le=INT32_MAX)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_valid_unicode)]
CacheSalt = Annotated[StrictStr, AfterValidator(_valid_unicode), AfterValidator(_salt_size)]


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as decimal strings ("50256"): as ints here.
    Their range, the biases' range and the vocabulary are checked by SamplingParams and the engine."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (0 < len(key) <= 10 and key.isascii() and key.isdigit()):
            raise PydanticCustomError(
                "logit_bias_key", "logit_bias has the key {key}; keys are token ids written as decimal integers "
                '(OpenAI\'s form, e.g. "50256")', {"key": repr(key[:40])},
            )
        if key != str(int(key)):  # "01" and "1" would name one token: the body repeats no key, so neither may this
            raise PydanticCustomError(
                "logit_bias_key", "logit_bias has the key {key}; token ids are written without leading zeros "
                "(write {canonical}), so that no two keys name the same token",
                {"key": repr(key), "canonical": repr(str(int(key)))},
            )
        out[int(key)] = value
    return out


# at most MAX_LOGIT_BIAS entries (SamplingParams' bound, checked here before any work on them)
LogitBias = Annotated[dict[StrictStr, Float],
                      Field(max_length=MAX_LOGIT_BIAS), AfterValidator(_token_id_keys)]

# Reasons for the fields OpenAI (or vLLM) defines that pagedrs does not implement yet.
_TOOLS = "the legacy functions API is not implemented: use tools and tool_choice"
_GUIDED = "vLLM's guided decoding options beyond the constraint itself"
_AUDIO = "pagedrs generates text only"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _Strict(BaseModel):
    """Finite floats everywhere (no NaN / Infinity); a name the model does not declare is a 400 naming it."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return name_unknown_fields(data, handler)


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


MAX_TOOLS = 128  # functions per request: each one's schema is part of the grammar


def _schema_depth(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema is rendered by the chat template (which recurses: a deep one overflows the
    stack) and may become a grammar: bounded as structured outputs' schemas are, before either."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise PydanticCustomError(
            "schema_too_deep", "the schema nests objects and arrays more than {limit} levels deep; allowed at most "
            "{limit}", {"limit": MAX_SCHEMA_DEPTH},
        )
    return schema


class ToolFunction(_Strict):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_schema_depth)] | None = None  # a JSON schema; None: any object
    strict: StrictBool | None = None  # the call always follows the schema: true and false alike


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _SamplingRequest(_Strict):
    """Fields shared by both endpoints (see field_policy.py for what is refused and ignored)."""

    model: Text
    n: Annotated[Int, Field(le=MAX_N)] = 1
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Annotated[Int, Field(ge=0, le=INT64_MAX)] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stream: StrictBool = False
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
    echo: StrictBool = False
    logprobs: Int | None = None
    prompt_logprobs: Int | None = None  # vLLM's: SamplingParams.prompt_logprobs (bounded there)
    suffix: Annotated[Any, not_supported("text after the completion (insertion)", "")] = None


class ChatContentPart(_Strict):
    """A text part; other kinds (image_url, input_audio, file, refusal) are refused by their type."""

    type: Literal["text"]
    text: Text
    prompt_cache_breakpoint: Annotated[Any, not_supported("explicit prompt cache breakpoints")] = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError(
                "not_supported", "a content part of type {kind} is not supported: only 'text' parts are",
                {"kind": repr(kind)},
            )
        return data


class CalledFunction(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it back


class HistoryToolCall(_Strict):
    """A call an earlier assistant turn made (as this server answered it)."""

    id: Text
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Annotated[Text, AfterValidator(check_role)]
    content: Text | list[ChatContentPart] | None = None
    name: Annotated[Any, not_supported("message names: the chat template is given role and content only")] = None
    tool_calls: Annotated[list[HistoryToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call they answer
    function_call: Annotated[Any, not_supported(_TOOLS)] = None
    refusal: Annotated[Any, not_supported("refusals of earlier turns are not rendered")] = None
    audio: Annotated[Any, not_supported(_AUDIO)] = None

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self) -> ChatMessage:
        for name, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if getattr(self, name) is not None and self.role != role:
                raise PydanticCustomError("wrong_role", "{name} belongs on {role} messages, not on {actual} ones",
                                          {"name": name, "role": repr(role), "actual": repr(self.role)})
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            # rendered as "", a missing turn would pass for an empty one (OpenAI refuses it too)
            raise PydanticCustomError(
                "missing_content", "a {role} message needs content (a string or a list of text parts); only an "
                "assistant message that has tool_calls may leave it out or send null", {"role": repr(self.role)})
        if self.content == []:  # rendered as "", as null would be: refused for the same reason
            raise PydanticCustomError(
                "empty_content", "a {role} message has content [], an empty list of parts; send at least one text "
                "part, or a string", {"role": repr(self.role)})
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    logprobs: StrictBool = False
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
