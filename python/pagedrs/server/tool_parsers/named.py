"""The answer to a named ``tool_choice``: the function's arguments object and nothing else (a grammar
forces it), read as that one call.

It reuses the call reader by giving it what the answer leaves out: the object is read as if
it were ``{"name": <the function>, "arguments": <the answer>}``, so the arguments stream in pieces
and are checked exactly as the other formats' are.
"""

from __future__ import annotations

import json

from pagedrs.server.tool_parsers.base import Event, ToolParser


class NamedCallParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__(frozenset([name]), max_calls=1)
        self._begin_call()
        for c in '{"name": ' + json.dumps(name) + ', "arguments": ':
            self._call_char(c)
        self._raw = ""  # refused, the answer's own text is the content

    def _char(self, c: str) -> None:
        if self._call is None or self._call_char(c) == "refused":
            self._text(c)

    def finish(self) -> list[Event]:
        if self._call is not None and self._call.args_done:
            self._call_char("}")
        return super().finish()
