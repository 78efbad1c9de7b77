"""One tool call written as a JSON object, ``{"name": "f", "arguments": {...}}``, read a character
at a time: what every tool-call format of ``tool_parsers`` has inside its markup.

Why character by character: a stream must decide, as the text arrives, whether it is looking at a
call, and send the call's arguments in pieces without ever sending a piece that is not JSON. So
this is a JSON syntax checker (a pushdown automaton: each character is accepted or refused the
moment it arrives, so an accepted text is always a prefix of some valid JSON) that also watches
the top-level object's keys: it decodes the ``name`` string and records the raw text of the
arguments object, exactly as the model wrote it (OpenAI's ``function.arguments`` is that text).

Rules (a refused call is not a call; its parser returns the text as content):

* the top level is an object; its ``name`` must be one of the request's tools; its arguments
  (under any key of ``args_keys``: ``arguments``, and ``parameters`` for Llama 3) must be an object,
  or absent (then ``{}``, for a function without parameters); other keys are checked as JSON and
  ignored; a key given twice, or two argument keys, is refused;
* nesting deeper than ``MAX_DEPTH`` is refused (a bound on the stack, nothing else).
"""

from __future__ import annotations

import json
import re

MAX_DEPTH = 64
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_WS = frozenset(" \t\n\r")


class CallObject:
    """Push characters with ``push``; it returns False at the first one that cannot continue a call.

    After each accepted character: ``name`` (a known tool's name, once its string closed), ``args``
    (the arguments' raw text so far, ``args_started`` once its ``{`` arrived, ``args_done`` once it
    closed) and ``done`` (the object closed: a complete call).
    """

    def __init__(self, tool_names: frozenset[str], args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.tool_names = tool_names
        self.args_keys = args_keys
        self.name: str | None = None
        self.args = ""
        self.args_started = False
        self.args_done = False
        self.done = False
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = "value"  # what the next character may be (see push)
        self._token = ""  # the string, number or literal being read
        self._is_key = False  # the string being read is an object key
        self._unicode_left = 0  # hex digits still due after \u
        self._keys: set[str] = set()  # top-level keys seen
        self._key: str | None = None  # the top-level key whose value comes next

    def push(self, c: str) -> bool:
        """Accept one character, or refuse it (the call is then broken; push nothing more)."""
        if self.done:
            return False
        if self._key in self.args_keys and self.args_started and not self.args_done:
            self.args += c  # inside the arguments: everything is theirs, refused or not
        ok = self._step(c)
        if not ok and self.args_started and not self.args_done:
            self.args = self.args[:-1]
        return ok

    def _step(self, c: str) -> bool:
        state = self._state
        if state == "string":
            return self._string_char(c)
        if state == "number":
            if c in _NUMBER_CHARS:
                self._token += c
                return True
            if not _NUMBER.fullmatch(self._token):
                return False
            if not self._value_end():
                return False
            return self._step(c)
        if state == "literal":
            self._token += c
            word = _LITERALS[self._token[0]]
            if not word.startswith(self._token):
                return False
            return self._value_end() if self._token == word else True
        if c in _WS:
            return True
        if state in ("value", "value_or_end"):
            if state == "value_or_end" and c == "]":
                return self._close()
            return self._value_start(c)
        if state in ("key_or_end", "key"):
            if state == "key_or_end" and c == "}":
                return self._close()
            if c != '"':
                return False
            self._state, self._token, self._is_key = "string", "", True
            return True
        if state == "colon":
            if c != ":":
                return False
            self._state = "value"
            return True
        # state == "comma_or_end"
        top = self._stack[-1]
        if c == ",":
            self._state = "key" if top == "{" else "value"
            return True
        return self._close() if c == ("}" if top == "{" else "]") else False

    def _value_start(self, c: str) -> bool:
        """The first character of a value (after whitespace)."""
        if not self._stack and c != "{":
            return False  # the call itself is an object
        at_top = len(self._stack) == 1
        if at_top and self._key in self.args_keys:
            if c != "{":
                return False  # arguments are an object
            self.args_started, self.args = True, c
        if at_top and self._key == "name" and c != '"':
            return False
        if c in "{[":
            if len(self._stack) >= MAX_DEPTH:
                return False
            self._stack.append(c)
            self._state = "key_or_end" if c == "{" else "value_or_end"
            return True
        if c == '"':
            self._state, self._token, self._is_key = "string", "", False
            return True
        if c in "-0123456789":
            self._state, self._token = "number", c
            return True
        if c in _LITERALS:
            self._state, self._token = "literal", c
            return True
        return False

    def _string_char(self, c: str) -> bool:
        if self._unicode_left:
            if c not in "0123456789abcdefABCDEF":
                return False
            self._unicode_left -= 1
        elif self._token.endswith("\\") and _odd_backslashes(self._token):
            if c not in '"\\/bfnrtu':
                return False
            self._unicode_left = 4 if c == "u" else 0
        elif c == '"':
            return self._string_end()
        elif ord(c) < 0x20:
            return False  # control characters are escaped in JSON strings
        self._token += c
        return True

    def _string_end(self) -> bool:
        at_top = len(self._stack) == 1
        if self._is_key:
            self._state = "colon"
            if at_top:
                key = json.loads(f'"{self._token}"')
                if key in self._keys or (key in self.args_keys and self._keys & set(self.args_keys)):
                    return False  # a key twice, or two argument keys
                self._keys.add(key)
                self._key = key
            return True
        if at_top and self._key == "name":
            name = json.loads(f'"{self._token}"')
            if name not in self.tool_names:
                return False  # not one of the request's tools: not a call
            self.name = name
        return self._value_end()

    def _close(self) -> bool:
        self._stack.pop()
        return self._value_end()

    def _value_end(self) -> bool:
        """A value ended (its last character is pushed); where the next character may go."""
        if not self._stack:
            if self.name is None:
                return False  # an object without a name is no call
            if not self.args_started:
                self.args, self.args_started, self.args_done = "{}", True, True
            self.done, self._state = True, "end"
            return True
        if len(self._stack) == 1 and self._key in self.args_keys and self.args_started:
            self.args_done = True
        self._state = "comma_or_end"
        return True


def _odd_backslashes(text: str) -> bool:
    """The string so far ends in an unfinished escape (an odd run of backslashes)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1
