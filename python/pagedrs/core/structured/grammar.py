"""A ``StructuredOutputsParams`` as llguidance grammar text, and the check the front end runs on it.

The check compiles the grammar without the model's tokenizer (``LLMatcher.validate_grammar``): a
schema, regex or grammar llguidance refuses is a ValueError naming the field and llguidance's
message, before the request reaches the core. So is one that can generate nothing at all
(``empty_language_error``), found on a matcher over single bytes. The core compiles it again with
the model's tokenizer (``backend.GrammarCompiler``), once per distinct spec.

JSON (``json`` and ``json_object``) is generated compact: the separators are ``,`` and ``:``
and no other whitespace is allowed, so an answer's length is bounded by its schema (with
flexible whitespace a weak model may pad forever). A schema can ask otherwise with
llguidance's ``"x-guidance": {"whitespace_flexible": true}``.
"""

from __future__ import annotations

import functools
from typing import Any

import llguidance
from llguidance._tokenizer import TokenizerWrapper

from pagedrs.sampling_params import StructuredOutputsParams

# llguidance's JsonCompileOptions; "x-guidance" in a schema overrides them
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (raises ValueError for a grammar that cannot be converted)."""
    return _grammar_text(params.kind, params.spec)


def check(params: StructuredOutputsParams) -> None:
    """Raises ValueError naming ``structured_outputs.<kind>`` and llguidance's message when it cannot compile."""
    problem = _check(params.kind, params.spec)
    if problem:
        raise ValueError(f"structured_outputs.{params.kind} {problem}")


def empty_language_error(matcher: llguidance.LLMatcher) -> str:
    """'' unless ``matcher`` (untouched) can generate nothing at all; then what to tell the client.

    Why: llguidance compiles a grammar none of whose derivations ends (a JSON schema whose
    ``$ref`` points at itself, a rule ``a: a``), and its matcher fails only at its first mask,
    which then allows EOS alone, its way to end a failed match. A sample would end at once with
    finish_reason "stop" and an empty answer that matches nothing: a wrong answer with a 200.
    One mask, on a copy, finds it."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if not probe.is_error():
        return ""
    reason = (probe.get_error().strip().splitlines() or ["?"])[0]
    return (f"accepts no output: no token can start an answer it matches (llguidance: {reason}); a $ref or a "
            "rule that only refers to itself, with no alternative that ends, is the usual cause")


@functools.lru_cache(maxsize=256)
def _check(kind: str, spec: str) -> str:
    """'' when ``spec`` compiles and can generate something, else what is wrong; cached, as a front end
    sees the same schemas again."""
    try:
        text = _grammar_text(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
        if is_error:
            return f"does not compile: {messages[0].strip()}"
        return empty_language_error(llguidance.LLMatcher(_byte_tokenizer(), text, log_level=0))
    except Exception as exc:  # noqa: BLE001 - whatever the converter raises, the spec is what is wrong
        return f"does not compile: {type(exc).__name__}: {exc}"


class _Bytes:
    """A tokenizer of 256 single-byte tokens and an EOS (256): any text, one byte a token."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: Any) -> list[int]:
        return list(text if isinstance(text, bytes) else str(text).encode("utf-8"))


@functools.lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])


def _grammar_text(kind: str, spec: str) -> str:
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF (converted to Lark)
