"""``StructuredOutputsParams``: one grammar constraint on what a sample may generate, checked on plain values.

Its own module because it is a value of its own: ``SamplingParams`` and ``BeamSearchParams`` both carry
one, the server builds it from four spellings of a request (``response_format``, ``structured_outputs``,
the ``guided_*`` fields, tools), and the core compiles it. What is checked here is what can be checked
without a grammar engine: exactly one kind, the types, and the size and depth bounds that keep a hostile
constraint from costing more than its share to compile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

# Structured outputs (see StructuredOutputsParams): what one constraint may cost to compile.
MAX_STRUCTURED_SPEC_BYTES = 64 * 1024  # a schema, regex, grammar or the choices, as UTF-8 text
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema's objects and arrays
MAX_CHOICES = 1024
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on what a sample may generate (vLLM's ``StructuredOutputsParams``):
    exactly one of ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (Lark, or GBNF as llama.cpp writes
    it) or ``json_object=True`` (any JSON object).

    Checked here on plain values (one kind, types, the size and depth limits above); the
    front end compiles it once more before the request reaches the core, so a schema or a
    regex the grammar engine refuses is a ValueError naming the field and the engine's message.
    """

    json: Union[str, dict[str, Any], None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = False

    def __post_init__(self) -> None:
        if self.json_object is None:  # vLLM's default
            self.json_object = False
        given = [k for k in STRUCTURED_KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object=True; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if not isinstance(self.json_object, bool):
            _fail_structured("json_object", self.json_object, "true or false")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            _fail_structured("json", self.json, "a JSON schema: an object, or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail_structured(name, value, "a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not 0 < len(self.choice) <= MAX_CHOICES or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                _fail_structured("choice", self.choice, f"a list of 1 to {MAX_CHOICES} non-empty strings")
            self.choice = list(self.choice)
        if isinstance(self.json, str):
            self.json = _parse_schema(self.json)
        if self.json is not None:  # before it is written as text, which recurses
            depth = json_depth(self.json)
            if depth > MAX_SCHEMA_DEPTH:
                _fail_structured("json", f"<a schema nested {depth} deep>", f"nesting depth at most {MAX_SCHEMA_DEPTH}")
        spec = self.spec
        if len(spec.encode("utf-8", "surrogatepass")) > MAX_STRUCTURED_SPEC_BYTES:
            _fail_structured(self.kind, f"<{len(spec)} characters>",
                             f"at most {MAX_STRUCTURED_SPEC_BYTES} bytes of text")

    @property
    def kind(self) -> str:
        """Which constraint it is: one of ``STRUCTURED_KINDS``."""
        return next(k for k in STRUCTURED_KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    @property
    def spec(self) -> str:
        """The constraint as text, the same for equal constraints (a schema's JSON text rewritten
        without its whitespace; its keys keep their order, which is the order of the answer's
        properties): the key under which its compiled grammar is cached."""
        if self.json is not None:
            return json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        if self.choice is not None:
            return json.dumps(self.choice, ensure_ascii=False)
        if self.json_object:
            return '{"type": "object"}'
        return str(self.regex if self.regex is not None else self.grammar)


def _fail_structured(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"structured_outputs.{name}={str(value)[:200]!r} is not valid: allowed {allowed}")


def _parse_schema(text: str) -> dict[str, Any]:
    if len(text) > MAX_STRUCTURED_SPEC_BYTES:  # before parsing: the parse itself is the cost
        _fail_structured("json", f"<{len(text)} characters>", f"at most {MAX_STRUCTURED_SPEC_BYTES} bytes of text")
    try:
        value = json.loads(text)
    except RecursionError:
        _fail_structured("json", "<a deeply nested schema>", f"nesting depth at most {MAX_SCHEMA_DEPTH}")
    except ValueError as exc:
        _fail_structured("json", text, f"a JSON schema; this text is not JSON ({exc})")
    if not isinstance(value, dict):
        _fail_structured("json", text, "a JSON schema, which is a JSON object")
    return value


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in ``value`` (iterative: a hostile depth cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest
