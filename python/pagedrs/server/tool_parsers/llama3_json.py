"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 with JSON tool calling, whose answer is the call itself:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>`` (a special token: kept in the text for this parser), several
separated by ``;``. ``parameters`` is Llama's key, ``arguments`` is accepted too. Calls are read
only at the start of the answer: an answer that begins with other text is content, all of it (a
JSON object further on is text the model wrote, not a call). An answer that begins with an object
which is no call (no ``name``, or a name not among the tools) is content as well.
"""

from __future__ import annotations

from pagedrs.server.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")
_WS = " \t\n\r"


class Llama3JsonParser(ToolParser):
    needs_special_tokens = True

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        super().__init__(tool_names, max_calls)
        # start | tagged (after <|python_tag|>) | call | between (after a call) | next (after ";") | plain
        self._state = "start"

    def _char(self, c: str) -> None:
        state = self._state
        if state == "plain":
            self._text(c)
        elif state == "start":
            if c == "{" and not self._held:
                self._start_call(c)
            elif c in _WS and not self._held:
                self._text(c)
            elif self._match_tag(c):
                self._state, self._raw = "tagged", PYTHON_TAG
        elif state in ("tagged", "next"):
            if c == "{":
                self._start_call(c)
            elif c in _WS:
                self._raw += c
            else:
                self._text(self._raw)
                self._raw, self._state = "", "plain"
                self._text(c)
        elif state == "call":
            status = self._call_char(c)
            if status == "refused":
                self._state = "plain"
                self._text(c)
            elif status == "done":
                self._state = "between"
        elif c == ";":  # between
            self._state, self._raw = "next", ""
        elif c in _WS:
            self._raw += c  # the text after the calls keeps its leading whitespace
        else:
            self._state = "plain"
            self._text(self._raw + c)
            self._raw = ""

    def _match_tag(self, c: str) -> bool:
        """At the start: True once <|python_tag|> is complete; other text makes the answer plain."""
        candidate = self._held + c
        if PYTHON_TAG.startswith(candidate):
            self._held = "" if candidate == PYTHON_TAG else candidate
            return candidate == PYTHON_TAG
        self._held, self._state = "", "plain"
        self._text(candidate)
        return False

    def _start_call(self, c: str) -> None:
        self._begin_call(ARGS_KEYS)
        self._state = "call"
        self._call_char(c)

    def _flush(self) -> None:
        if self._state == "tagged":
            self._text(self._raw)  # <|python_tag|> and nothing after it: content
        self._raw, self._state = "", "plain"
