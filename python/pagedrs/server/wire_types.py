"""The strict field types every request body is built of (``Text``, ``Int``, ``Float``, token ids, stop
strings, the cache salt, logit bias), the wire limits they enforce, and ``_Strict``, the base model that
refuses an undeclared name.

Apart from the endpoints' models (protocol.py, chat_messages.py, tokenize.py) because all of them share
these, and because this is where "shape is checked strictly" is kept: a JSON ``true`` is not a token id,
``NaN`` is not a temperature, a lone surrogate is not text. A change here changes every endpoint at once.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagedrs.frontend.input_processor import PRIORITY_RANGE
from pagedrs.sampling_params import MAX_LOGIT_BIAS
from pagedrs.server.field_policy import name_unknown_fields

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


def null_is(default: Any) -> BeforeValidator:
    """A field OpenAI's spec declares nullable (``n``, ``stream``, ``echo``, chat's ``logprobs``): an explicit
    JSON null is its default, as OpenAI reads it; it was refused, so a client that sends every field of its
    own request type (nulls for the unset ones) got a 400 for a request OpenAI serves."""
    return BeforeValidator(lambda value: default if value is None else value)


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


class _Strict(BaseModel):
    """Finite floats everywhere (no NaN / Infinity); a name the model does not declare is a 400 naming it."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return name_unknown_fields(data, handler)
