"""What a tool-call parser emits, the machinery every format shares, and the non-streaming reading.

A parser reads one answer's text as it arrives (``feed``, then ``finish``) and turns it into
events: ``Text`` (content), and per call ``CallStart`` (its name), ``CallArgs`` (a piece of its
arguments, raw JSON text), then ``CallEnd`` or ``CallBroken``. It works a character at a time,
so how the text is cut into pieces never changes what it emits (only how events are grouped):
a stream and the same text read whole (``read_calls``) give the same calls, the same arguments
and the same content. That is the one definition of what a call is; the stream and the
non-streaming answer both use it.

When a call counts (the rules every format follows):

* markup (``<tool_call>``, ``[TOOL_CALLS]``...) is held back, never sent as content, until the
  parser knows what it is: a prefix of a marker at the end of the text so far is held too;
* a call is announced (``CallStart``) once its function name is complete and is one of the
  request's tools, and its arguments object has begun; from then on its arguments come as
  events as they arrive, each piece checked as JSON syntax first (``call_object``); a stream
  sends none of it before ``CallEnd`` (``server/tools.py``: any later character may break it);
* a block refused before that (not JSON, no name, a name that is not one of the request's tools,
  arguments that are not an object) is not a call: its text, markup included, is content;
* a call that breaks after it was announced (invalid JSON further on, or the answer ends before
  the call closes, e.g. at ``max_tokens``) is ``CallBroken``: ``read_calls`` returns its text as
  content, as if it had been refused, and so does a stream (it had sent none of the call);
* whitespace between a call and the text before it, between two calls and after the last call at
  the end is markup, not content (the text after a call keeps its own leading whitespace);
* with ``max_calls`` (``parallel_tool_calls: false``: 1) calls past the first ``max_calls`` are
  read and dropped: neither calls nor content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from pagedrs.server.tool_parsers.call_object import CallObject


@dataclass(frozen=True)
class Text:
    text: str  # content: the answer's text outside the calls


@dataclass(frozen=True)
class CallStart:
    index: int  # which call of the answer (0, 1, ...)
    name: str  # the function, one of the request's tools


@dataclass(frozen=True)
class CallArgs:
    index: int
    piece: str  # the next characters of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int  # the call's arguments are complete, valid JSON


@dataclass(frozen=True)
class CallBroken:
    index: int
    text: str  # the call's whole text, markup included: content after all


Event = Union[Text, CallStart, CallArgs, CallEnd, CallBroken]


class ToolParser:
    """One answer's reader. A subclass is one format: it implements ``_char`` (and ``_flush`` for
    what it holds at the end), using ``_text``, ``_match``, ``_begin_call`` and ``_call_char``."""

    needs_special_tokens = False  # its markers are special tokens: the answer's text must keep them

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        self.tool_names = tool_names
        self.max_calls = max_calls
        self._events: list[Event] = []
        self._ws = ""  # whitespace after content, sent once more content follows (dropped before a call)
        self._after_call = False  # the whitespace held follows a call: dropped if the answer ends
        self._ws_dropped = ""  # the whitespace dropped before the current call (its text if it breaks)
        self._held = ""  # a marker's prefix, not yet known to be one
        self._raw = ""  # the current block's text, for content if it is refused
        self._call: CallObject | None = None
        self._index = -1  # the current (or last) announced call
        self._announced = False  # the current block is an announced call
        self._sent = 0  # characters of the current call's arguments sent

    def feed(self, text: str) -> list[Event]:
        for c in text:
            self._char(c)
        return self._take()

    def finish(self) -> list[Event]:
        """The answer ended: what was held is content, an unfinished call is refused or broken."""
        if self._call is not None:
            self._end_block(None)
        self._flush()
        if self._held:
            self._text(self._held)
            self._held = ""
        if self._ws and not self._after_call:
            self._emit(Text(self._ws))
        self._ws = ""
        return self._take()

    # ---- for the formats -------------------------------------------------------------------

    def _char(self, c: str) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """The answer ended in the format's state: put what the state holds into ``_raw`` or ``_held``."""

    def _text(self, text: str) -> None:
        """Content, with the whitespace next to calls left out: trailing whitespace is held until
        more content follows, and dropped when a call or (after a call) the end comes first."""
        body = text.rstrip()
        if body:
            self._emit(Text(self._ws + body))
            self._ws, self._after_call = "", False
        self._ws += text[len(body):]

    def _match(self, c: str, marker: str) -> bool:
        """Text state: True when ``c`` completes ``marker``; what cannot begin it becomes content."""
        candidate = self._held + c
        while candidate and not marker.startswith(candidate):
            self._text(candidate[0])
            candidate = candidate[1:]
        if candidate == marker:
            self._held = ""
            return True
        self._held = candidate
        return False

    def _begin_call(self, args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self._call = CallObject(self.tool_names, args_keys)
        self._announced, self._sent = False, 0

    def _call_char(self, c: str) -> str:
        """Push ``c`` into the current call: "more", "done" (it ended), or "refused" (``c`` was not
        taken: the block ended as content or broken; the caller reads ``c`` again as text)."""
        call = self._call
        assert call is not None
        if not call.push(c):
            self._end_block(None)
            return "refused"
        self._raw += c
        if not self._announced and call.name is not None and call.args_started:
            self._announced = True
            self._index += 1
            self._ws_dropped, self._ws = self._ws, ""  # whitespace before a call is markup
            self._emit_call(CallStart(self._index, call.name))
        if self._announced and len(call.args) > self._sent:
            self._emit_call(CallArgs(self._index, call.args[self._sent:]))
            self._sent = len(call.args)
        if call.done:
            self._end_block(CallEnd(self._index))
            return "done"
        return "more"

    def _end_block(self, end: CallEnd | None) -> None:
        """The current block is over: a complete call (``end``), or refused / broken (None)."""
        raw, announced = self._raw, self._announced
        self._call, self._raw, self._announced = None, "", False
        if end is not None:
            self._emit_call(end)
        elif announced:
            self._emit_call(CallBroken(self._index, self._ws_dropped + raw))
        else:
            self._text(raw)
            return
        self._ws, self._after_call = "", True

    def _emit_call(self, event: Event) -> None:
        if self.max_calls is None or self._index < self.max_calls:
            self._emit(event)

    def _emit(self, event: Event) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, Text) and isinstance(last, Text):
            self._events[-1] = Text(last.text + event.text)
        elif isinstance(event, CallArgs) and isinstance(last, CallArgs) and last.index == event.index:
            self._events[-1] = CallArgs(event.index, last.piece + event.piece)
        else:
            self._events.append(event)

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


@dataclass(frozen=True)
class ReadCalls:
    """A whole answer read: its content (None when there is none) and its complete calls."""

    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), in order


def read_calls(events: list[Event]) -> ReadCalls:
    """Fold one answer's events (feed + finish) into content and calls: the non-streaming reading."""
    content: list[str] = []
    calls: list[tuple[str, str]] = []
    open_calls: dict[int, tuple[str, list[str]]] = {}
    for event in events:
        if isinstance(event, Text):
            content.append(event.text)
        elif isinstance(event, CallStart):
            open_calls[event.index] = (event.name, [])
        elif isinstance(event, CallArgs):
            open_calls[event.index][1].append(event.piece)
        elif isinstance(event, CallEnd):
            name, pieces = open_calls.pop(event.index)
            calls.append((name, "".join(pieces)))
        else:
            open_calls.pop(event.index)
            content.append(event.text)
    text = "".join(content)
    return ReadCalls(text or None, calls)
