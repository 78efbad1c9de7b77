"""Tool calling on /v1/chat/completions, where a grammar can force it: ``tool_choice`` "required" or
a named function. The tools' JSON schemas become one structured-outputs constraint, so the call
is well formed on any model, whatever its chat template (which is given ``tools`` to render).

* ``"required"``: the answer is a JSON array of ``{"name": <a tool's name>, "parameters": <its
  schema>}`` objects, at least one (exactly one with ``parallel_tool_calls: false``), vLLM's form;
* a named function (``{"type": "function", "function": {"name": ...}}``): the answer is that
  function's arguments, a JSON object following its ``parameters`` schema;
* ``"none"``: the tools are rendered, nothing is forced, the answer is text;
* ``"auto"`` (OpenAI's default when ``tools`` is sent) needs a parser for the model family's own
  tool-call format, and pagedrs has none yet: a 400, as vLLM answers without ``--tool-call-parser``.

A complete answer comes back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``; one
cut by ``max_tokens`` stays text with ``"length"``. The next turn sends that assistant message
back with a ``tool`` message per result (``server/tokens.py`` hands both to the template).
Streamed, a forced call is held until complete and sent as one ``delta.tool_calls`` chunk (each
call whole, with its ``index``; OpenAI sends the arguments in pieces, which clients join the same way).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from pagedrs.server.errors import bad_request

AUTO_REFUSED = ('tool_choice "auto" needs a tool-call parser for this model\'s format, and this server has none '
                '(pagedrs has no --tool-call-parser yet); send tool_choice "required", a named function, or "none"')


@dataclass(frozen=True)
class ForcedCall:
    """How the answer to a forced call is read back: ``name`` for a named function, else a list of calls."""

    name: Optional[str]


def tool_constraint(body: Any) -> tuple[Optional[dict[str, Any]], Optional[ForcedCall]]:
    """(the JSON schema that forces the call, how to read it) for the request's tools; (None, None)
    when nothing is forced. A 400 naming ``tool_choice`` or ``tools`` when it cannot be served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice {_shown(choice)} needs tools: send the tools to call", param="tool_choice")
        return None, None
    if choice is None or choice == "auto":
        raise bad_request(AUTO_REFUSED, param="tool_choice")
    if choice == "none":
        return None, None
    schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools}
    if len(schemas) != len(body.tools):
        raise bad_request("tools has two functions of the same name; each name must be unique", param="tools")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, schema in schemas.items()]
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                 "minItems": 1}
        if body.parallel_tool_calls is False:
            array["maxItems"] = 1
        return array, ForcedCall(None)
    name = choice.function.name
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({', '.join(schemas)})",
                          param="tool_choice")
    return schemas[name], ForcedCall(name)


def tool_calls(forced: ForcedCall, text: str) -> Optional[list[dict[str, Any]]]:
    """The calls in a complete forced answer, in OpenAI's shape; None when the text is not one (cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [(forced.name, value)] if forced.name is not None else [(c["name"], c["parameters"]) for c in value]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in calls]


def _shown(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())
