"""Tool calling on /v1/chat/completions: which ``tool_choice`` asks for what, and how the answer is
read back as ``message.tool_calls`` (whole, or as ``delta.tool_calls`` chunks when streamed).

* ``"required"``: a grammar forces a JSON array of ``{"name": <a tool's name>, "parameters": <its
  schema>}`` objects, at least one (exactly one with ``parallel_tool_calls: false``), vLLM's form;
* a named function (``{"type": "function", "function": {"name": ...}}``): a grammar forces that
  function's arguments, a JSON object following its ``parameters`` schema;
* ``"none"``: the tools are rendered, nothing is forced, the answer is text;
* ``"auto"`` (OpenAI's default when ``tools`` is sent): nothing is forced; the answer is read by
  the parser of the model family's own format, ``pagedrs serve --tool-call-parser NAME``
  (``tool_parsers``: hermes, llama3_json, mistral). A block that does not parse, or names a
  function that is not in ``tools``, is not a call: it stays in ``content``. With
  ``parallel_tool_calls: false`` only the first call is returned (later ones are dropped, from
  the calls and from the content alike). Without a parser "auto" is a 400, as vLLM answers
  without ``--tool-call-parser``.

Both ways of answering read the text with the same parser (``tool_parsers.base`` has the rules),
and the stream sends exactly what the whole answer returns, whatever the text and wherever it
ends (a stop string, ``max_tokens``, EOS in the middle of a call): the same calls, the same
arguments, the same content and the same ``finish_reason``. A streamed call can only be sent
once nothing after it can unmake it, so:

* content is sent as it arrives (markup and what may begin a marker are held by the parser);
* a call is held, name and arguments, until the parser ends it: a complete call (``CallEnd``)
  goes out as one ``delta.tool_calls`` chunk with ``index``, ``id``, ``type``, ``function.name``
  and the whole ``function.arguments``; a call that breaks (``CallBroken``: invalid JSON such as
  ``NaN``, a key given twice, the answer ending inside it) goes out as content, its text exactly
  as the whole answer's ``content`` has it. Arguments are never streamed in pieces: any later
  character could still break the call, and a client cannot take back a piece it was sent;
* a forced answer (``"required"``, a named function) is held whole until it ends: one that did
  not end by "stop" is text, all of it, and even a complete first call of ``"required"`` is
  unmade by a ``max_tokens`` cut after it.

A response with calls ends with ``finish_reason: "tool_calls"`` (or ``"length"`` when
``max_tokens`` cut what followed them); a call cut by ``max_tokens`` or a stop string is no
call, and the answer keeps its own finish reason.

The next turn sends the assistant message back with a ``tool`` message per result
(``server/tokens.py`` hands both to the template, and refuses tools or calls the template does
not render, for every ``tool_choice``: why is there).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from pagedrs.server.errors import bad_request
from pagedrs.server.responses import FunctionCallDelta, ToolCall, ToolCallDelta
from pagedrs.server.tool_parsers import (
    PARSERS,
    TOOL_CALL_PARSERS,
    CallArgs,
    CallEnd,
    CallStart,
    Event,
    ForcedListParser,
    NamedCallParser,
    Text,
    ToolParser,
    read_calls,
)

AUTO_REFUSED = ('tool_choice "auto" (the default when tools are sent) needs a tool-call parser for this model\'s '
                f'format: start the server with --tool-call-parser {{{",".join(TOOL_CALL_PARSERS)}}}; or send '
                'tool_choice "required", a named function, or "none"')


@dataclass(frozen=True)
class ToolReading:
    """How one request's answers are read back as tool calls: a fresh parser per choice."""

    new_parser: Callable[[], ToolParser]
    forced: bool  # a grammar forces the call: an answer that did not end by "stop" is text, all of it

    @property
    def needs_special_tokens(self) -> bool:
        return self.new_parser().needs_special_tokens


def tool_constraint(body: Any, parser_name: Optional[str]) -> tuple[Optional[dict[str, Any]], Optional[ToolReading]]:
    """(the JSON schema that forces the call, or None; how to read the answer, or None for plain
    text) for the request's tools under ``parser_name`` (--tool-call-parser, None: none). A 400
    naming ``tool_choice`` or ``tools`` when it cannot be served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice {_shown(choice)} needs tools: send the tools to call", param="tool_choice")
        return None, None
    schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools}
    if len(schemas) != len(body.tools):
        raise bad_request("tools has two functions of the same name; each name must be unique", param="tools")
    names = frozenset(schemas)
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice is None or choice == "auto":
        if parser_name is None:
            raise bad_request(AUTO_REFUSED, param="tool_choice")
        parser = PARSERS[parser_name]
        return None, ToolReading(lambda: parser(names, max_calls), forced=False)
    if choice == "none":
        return None, None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, schema in schemas.items()]
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                 "minItems": 1}
        if max_calls == 1:
            array["maxItems"] = 1
        return array, ToolReading(lambda: ForcedListParser(names, max_calls), forced=True)
    name = choice.function.name
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({', '.join(schemas)})",
                          param="tool_choice")
    return schemas[name], ToolReading(lambda: NamedCallParser(name), forced=True)


def read_answer(reading: ToolReading, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[ToolCall]]:
    """A whole answer: (content, calls). A forced answer that did not end by "stop" is all content."""
    if reading.forced and finish_reason != "stop":
        return text, []
    parser = reading.new_parser()
    read = read_calls(parser.feed(text) + parser.finish())
    return read.content, [_call(name, arguments) for name, arguments in read.calls]


def finish_reason_with_calls(finish_reason: Optional[str], has_calls: bool) -> Optional[str]:
    """"tool_calls" for an answer with calls that ended by itself; a cut one keeps "length"."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


class ToolStream:
    """One streamed choice's answer as chunk parts: content, and ``delta.tool_calls`` the OpenAI way.
    It holds a call until it is complete (the module docstring says why)."""

    def __init__(self, reading: ToolReading) -> None:
        self.reading = reading
        self.parser = reading.new_parser()
        self._held: list[str] = []  # a forced answer's text so far (read whole at its end)
        self._open: dict[int, tuple[str, list[str]]] = {}  # the parser's call index -> (name, argument pieces)
        self._calls_sent = 0  # a sent call's index is its place among the complete calls (a broken one has none)

    def parts(self, text: str, finish_reason: Optional[str]) -> list[str | list[ToolCallDelta]]:
        """What ``text`` (the next piece of the answer) adds, in order: content strings and lists of
        tool-call deltas (one chunk each). ``finish_reason``: the answer ends after it (None: it goes on)."""
        if self.reading.forced:
            return self._forced(text, finish_reason)
        finished = finish_reason is not None
        events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        parts: list[str | list[ToolCallDelta]] = []
        for event in events:
            delta = self._delta(event)
            if isinstance(delta, str):
                parts.append(delta)
            elif delta is not None:
                last = parts[-1] if parts else None
                if isinstance(last, list):
                    last.append(delta)
                else:
                    parts.append([delta])
        return parts

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        """The answer's finish reason once its last part is out, as the whole answer gives it."""
        return finish_reason_with_calls(finish_reason, self._calls_sent > 0)

    def _forced(self, text: str, finish_reason: Optional[str]) -> list[str | list[ToolCallDelta]]:
        self._held.append(text)
        if finish_reason is None:
            return []
        content, calls = read_answer(self.reading, "".join(self._held), finish_reason)
        self._held = []
        self._calls_sent = len(calls)
        deltas = [ToolCallDelta(index=i, id=c.id, type="function",
                                function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(calls)]
        parts: list[str | list[ToolCallDelta]] = [content] if content else []
        return parts + ([deltas] if deltas else [])

    def _delta(self, event: Event) -> str | ToolCallDelta | None:
        if isinstance(event, Text):
            return event.text
        if isinstance(event, CallStart):
            self._open[event.index] = (event.name, [])
        elif isinstance(event, CallArgs):
            self._open[event.index][1].append(event.piece)
        elif isinstance(event, CallEnd):
            name, pieces = self._open.pop(event.index)
            self._calls_sent += 1
            return ToolCallDelta(index=self._calls_sent - 1, id=_call_id(), type="function",
                                 function=FunctionCallDelta(name=name, arguments="".join(pieces)))
        else:  # CallBroken: never sent, so its text is content, as the whole answer has it
            self._open.pop(event.index)
            return event.text
        return None


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall.model_validate({"id": _call_id(), "type": "function",
                                    "function": {"name": name, "arguments": arguments}})


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _shown(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())
