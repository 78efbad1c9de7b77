"""``mistral``: Mistral 7B Instruct v0.3 and its kin (tokenizers before mistral-common v11), whose
calls come as one JSON list after the ``[TOOL_CALLS]`` special token (kept in the text for this
parser):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Text before ``[TOOL_CALLS]`` (and after the list) is content. The v11 form, ``[TOOL_CALLS]name{...}``
without a list, is not read (it stays content). ``ForcedListParser`` reads the same list without
the marker: the answer to ``tool_choice: "required"`` (its objects say ``parameters``, vLLM's form).
"""

from __future__ import annotations

from pagedrs.server.tool_parsers.base import ToolParser

TOOL_CALLS = "[TOOL_CALLS]"
_WS = " \t\n\r"


class JsonListParser(ToolParser):
    """A JSON list of call objects after ``marker``; other text is content."""

    marker = TOOL_CALLS
    args_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        super().__init__(tool_names, max_calls)
        self._state = "text" if self.marker else "open"  # text | open | item | call | after

    def _char(self, c: str) -> None:
        state = self._state
        if state == "text":
            if not self.marker:
                self._text(c)  # after the list: the rest is content
            elif self._match(c, self.marker):
                self._state, self._raw = "open", self.marker
        elif state == "open" or (state == "item" and c != "{" and c != "]"):
            self._raw += c
            if state == "open" and c == "[":
                self._state = "item"
            elif c not in _WS:
                self._text(self._raw)  # not a list of calls: content
                self._raw, self._state = "", "text"
        elif state == "item":
            if c == "]":
                self._raw, self._state = "", "text"  # an empty list: nothing to call
            else:
                self._begin_call(self.args_keys)
                self._state = "call"
                self._call_char(c)
        elif state == "call":
            status = self._call_char(c)
            if status == "refused":
                self._state = "text"
                self._char(c)
            elif status == "done":
                self._state = "after"
        elif c == ",":  # after
            self._raw, self._state = "", "item"
        elif c == "]":
            self._state = "text"
        elif c not in _WS:
            self._state = "text"
            self._char(c)

    def _flush(self) -> None:
        if self._state in ("open", "item"):
            self._text(self._raw)
        self._raw, self._state = "", "text"


class MistralParser(JsonListParser):
    needs_special_tokens = True


class ForcedListParser(JsonListParser):
    """The answer to ``tool_choice: "required"``: ``[{"name": ..., "parameters": {...}}, ...]``."""

    marker = ""
    args_keys = ("parameters",)
