"""A ``StructuredOutputsParams`` as llguidance grammar text, and the check the front end runs on it.

The check compiles the grammar without a tokenizer (``LLMatcher.validate_grammar``): a schema,
regex or grammar llguidance refuses is a ValueError naming the field and llguidance's
message, before the request reaches the core. The core compiles it again with the model's
tokenizer (``backend.GrammarCompiler``), once per distinct spec.

JSON (``json`` and ``json_object``) is generated compact: the separators are ``,`` and ``:``
and no other whitespace is allowed, so an answer's length is bounded by its schema (with
flexible whitespace a weak model may pad forever). A schema can ask otherwise with
llguidance's ``"x-guidance": {"whitespace_flexible": true}``.
"""

from __future__ import annotations

import functools

import llguidance

from pagedrs.sampling_params import StructuredOutputsParams

# llguidance's JsonCompileOptions; "x-guidance" in a schema overrides them
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (raises ValueError for a grammar that cannot be converted)."""
    return _grammar_text(params.kind, params.spec)


def check(params: StructuredOutputsParams) -> None:
    """Raises ValueError naming ``structured_outputs.<kind>`` and llguidance's message when it cannot compile."""
    message = _check(params.kind, params.spec)
    if message:
        raise ValueError(f"structured_outputs.{params.kind} does not compile: {message}")


@functools.lru_cache(maxsize=256)
def _check(kind: str, spec: str) -> str:
    """'' when ``spec`` compiles, else llguidance's error; cached, as a front end sees the same schemas again."""
    try:
        text = _grammar_text(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    except Exception as exc:  # noqa: BLE001 - whatever the converter raises, the spec is what is wrong
        return f"{type(exc).__name__}: {exc}"
    return messages[0].strip() if is_error else ""


def _grammar_text(kind: str, spec: str) -> str:
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF (converted to Lark)
