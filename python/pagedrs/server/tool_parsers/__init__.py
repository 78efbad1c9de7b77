"""Tool-call parsers for ``tool_choice: "auto"`` (``pagedrs serve --tool-call-parser NAME``), and
the readers of the answers a grammar forces (``"required"``, a named function).

Each format is one module; ``base`` has the events and the rules they share (when a call counts,
what is content). vLLM's parser names and formats: ``hermes`` (Qwen2-style ``<tool_call>`` blocks),
``llama3_json`` (a JSON object per call, ``;`` between them), ``mistral`` (``[TOOL_CALLS]`` and a list).
"""

from __future__ import annotations

from pagedrs.server.tool_parsers.base import (
    CallArgs,
    CallBroken,
    CallEnd,
    CallStart,
    Event,
    ReadCalls,
    Text,
    ToolParser,
    read_calls,
)
from pagedrs.server.tool_parsers.hermes import HermesParser
from pagedrs.server.tool_parsers.llama3_json import Llama3JsonParser
from pagedrs.server.tool_parsers.mistral import ForcedListParser, MistralParser
from pagedrs.server.tool_parsers.named import NamedCallParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
TOOL_CALL_PARSERS = tuple(PARSERS)  # the names --tool-call-parser accepts


def read_text(parser: ToolParser, text: str) -> ReadCalls:
    """A whole answer through ``parser``: its content and calls (what the stream of it sends too)."""
    return read_calls(parser.feed(text) + parser.finish())


__all__ = [
    "PARSERS", "TOOL_CALL_PARSERS", "CallArgs", "CallBroken", "CallEnd", "CallStart", "Event", "ForcedListParser",
    "HermesParser", "Llama3JsonParser", "MistralParser", "NamedCallParser", "ReadCalls", "Text", "ToolParser",
    "read_calls", "read_text",
]
