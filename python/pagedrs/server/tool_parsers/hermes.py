"""``hermes``: Hermes 2 Pro and Qwen2 / Qwen2.5 / Qwen3, whose chat templates ask for each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

anywhere in the answer, any number of them; the text around them is content. The closing tag is
optional at the end of the answer (a model may stop right after the object). Both tags are plain
added tokens of those tokenizers (not special), so the text keeps them.
"""

from __future__ import annotations

from pagedrs.server.tool_parsers.base import ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"


class HermesParser(ToolParser):
    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        super().__init__(tool_names, max_calls)
        self._state = "text"  # text | open (after <tool_call>) | call | close (after the object)

    def _char(self, c: str) -> None:
        if self._state == "text":
            if self._match(c, OPEN):
                self._state, self._raw = "open", OPEN
        elif self._state == "open":
            if c == "{":
                self._begin_call()
                self._state = "call"
                self._call_char(c)
            else:
                self._raw += c
                if c not in _WS:
                    self._refuse_opening()
        elif self._state == "call":
            status = self._call_char(c)
            if status == "refused":
                self._state = "text"
                self._char(c)
            elif status == "done":
                self._state = "close"
        elif c not in _WS or self._held:  # close: whitespace, then </tool_call> (or any other text)
            if self._match_close(c):
                self._state = "text"

    def _refuse_opening(self) -> None:
        """``<tool_call>`` followed by something other than an object: content."""
        self._text(self._raw)
        self._raw, self._state = "", "text"

    def _match_close(self, c: str) -> bool:
        """After a call: True once ``</tool_call>`` is complete, or once the text is anything else
        (then it is read again as text)."""
        candidate = self._held + c
        if CLOSE.startswith(candidate):
            self._held = "" if candidate == CLOSE else candidate
            return candidate == CLOSE
        self._held, self._state = "", "text"
        for ch in candidate:
            self._char(ch)
        return False

    def _flush(self) -> None:
        if self._state == "open":
            self._text(self._raw)
            self._raw = ""
        elif self._state == "close":
            self._held = ""  # a closing tag cut short is still markup
        self._state = "text"
