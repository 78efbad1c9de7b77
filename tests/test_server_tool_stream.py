"""A streamed tool-calling answer equals the whole one (server/tools.py): the same calls, arguments,
content and finish_reason for every answer text, whether it ended by EOS or a stop string ("stop")
or was cut by max_tokens ("length"), in the middle of a call included; a stream never sends a call
the whole answer does not have. End to end over a scripted fake engine (the answer is the script),
and, for every cut of every parser case of test_tool_parsers, ``ToolStream`` against ``read_answer``."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedrs.server.options import ServerOptions  # noqa: E402
from pagedrs.server.tool_parsers import PARSERS, ForcedListParser, NamedCallParser  # noqa: E402
from pagedrs.server.tools import ToolReading, ToolStream, finish_reason_with_calls, read_answer  # noqa: E402
from server_fakes import MODEL, FakeEngine, Served, served_factory  # noqa: E402
from test_tool_parsers import CASES, TOOLS  # noqa: E402

F = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
NAMED = {"tool_choice": {"type": "function", "function": {"name": "f"}}}
REQUIRED = {"tool_choice": "required"}
AUTO = {"tool_choice": "auto"}
Answer = tuple[str | None, list[tuple[str, str]], str]  # content, [(name, arguments)], finish_reason


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


@pytest.fixture
def served(make_served: Callable[..., Served]) -> Served:
    return make_served(FakeEngine(max_model_len=512), options=ServerOptions(tool_call_parser="hermes"))


def _body(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": F, "max_tokens": 200, **extra}


def _whole(served: Served, body: dict[str, Any]) -> Answer:
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"] or []]
    return choice["message"]["content"], calls, choice["finish_reason"]


def _streamed(served: Served, body: dict[str, Any]) -> Answer:
    """Joined as a client joins it; each call must come whole in one delta: id, type, name, JSON arguments."""
    content, calls, finish = "", [], []
    with httpx.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for event in events:
        for choice in event["choices"]:
            content += choice["delta"].get("content") or ""
            for t in choice["delta"].get("tool_calls") or []:
                assert t["index"] == len(calls) and t["id"].startswith("call_") and t["type"] == "function", t
                json.loads(t["function"]["arguments"])
                calls.append((t["function"]["name"], t["function"]["arguments"]))
            if choice["finish_reason"]:
                finish.append(choice["finish_reason"])
    assert len(finish) == 1, finish
    return content or None, calls, finish[0]


CALL = '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>'
# (the answer's text, the request's extra fields, what both answers must be; None: the text as content, "stop")
SCRIPTED: dict[str, tuple[str, dict[str, Any], Answer | None]] = {
    "hermes: a call": (f"pre {CALL} post", AUTO, ("pre post", [("f", '{"x":1}')], "tool_calls")),
    "hermes: EOS mid-call": ('<tool_call>{"name":"f","arguments":{"x":1}', AUTO, None),
    "hermes: NaN arguments": ('<tool_call>{"name":"f","arguments":{"x":NaN}}</tool_call>', AUTO, None),
    "hermes: arguments twice": ('<tool_call>{"name":"f","arguments":{"x":1},"arguments":{"x":2}}</tool_call>',
                                AUTO, None),
    "hermes: a stop string cut the closing tag": ('<tool_call>{"name":"f","arguments":{"x":1}}</tool_call', AUTO,
                                                  (None, [("f", '{"x":1}')], "tool_calls")),
    "hermes: a broken call, then a call": ('<tool_call>{"name":"f","arguments":{"x":NaN}}</tool_call>' + CALL, AUTO,
                                           ('<tool_call>{"name":"f","arguments":{"x":NaN}}</tool_call>',
                                            [("f", '{"x":1}')], "tool_calls")),
    "hermes: max_tokens mid-call": (f"ok {CALL}", {**AUTO, "max_tokens": 30},
                                    ('ok <tool_call>{"name":"f","arg', [], "length")),
    "hermes: max_tokens after a call": (f"{CALL} and more", {**AUTO, "max_tokens": len(CALL) + 5},
                                        (" and ", [("f", '{"x":1}')], "length")),
    "named: a call": ('{"x": 3}', NAMED, (None, [("f", '{"x": 3}')], "tool_calls")),
    "named: a stop string cut it": ('{"x":', NAMED, None),
    "named: max_tokens cut it": ('{"x": 3}', {**NAMED, "max_tokens": 4}, ('{"x"', [], "length")),
    "required: a stop string cut it": ('[{"name": "f", "parameters": {"', REQUIRED, None),
    "required: two calls": ('[{"name": "f", "parameters": {"x": 1}}, {"name": "f", "parameters": {"x": 2}}]', REQUIRED,
                            (None, [("f", '{"x": 1}'), ("f", '{"x": 2}')], "tool_calls")),
    "required: max_tokens after the first call": (
        '[{"name": "f", "parameters": {"x": 1}}, {"name": "f", "parameters": {"x": 2}}]', {**REQUIRED, "max_tokens": 45},
        ('[{"name": "f", "parameters": {"x": 1}}, {"nam', [], "length")),
}


@pytest.mark.parametrize("case", sorted(SCRIPTED))
def test_the_stream_gives_the_whole_answers_calls_content_and_finish_reason(served: Served, case: str) -> None:
    script, extra, expected = SCRIPTED[case]
    served.engine.script = script
    body = _body(extra)
    whole = _whole(served, body)
    assert whole == (expected or (script, [], "stop"))
    assert _streamed(served, body) == whole


# ---- every cut of every parser case, without a server ---------------------------------------------------------

def _reading(name: str) -> ToolReading:
    if name == "forced":
        return ToolReading(lambda: ForcedListParser(TOOLS), forced=True)
    if name == "named":
        return ToolReading(lambda: NamedCallParser("add"), forced=True)
    return ToolReading(lambda: PARSERS[name](TOOLS), forced=False)


def _stream_of(reading: ToolReading, pieces: list[str], finish_reason: str) -> Answer:
    stream = ToolStream(reading)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        for part in stream.parts(piece, finish_reason if i == len(pieces) - 1 else None):
            if isinstance(part, str):
                content += part
            else:
                assert [d.index for d in part] == list(range(len(calls), len(calls) + len(part)))
                calls += [(d.function.name, d.function.arguments) for d in part]
    return content or None, calls, str(stream.finish_reason(finish_reason))


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_cut_of_every_answer_streams_as_it_reads_whole(case: str) -> None:
    """Each prefix of the text (an answer ended there by a stop string, EOS or max_tokens), cut in
    random pieces: the stream's calls, content and finish reason are the whole answer's."""
    parser, text = CASES[case][0], CASES[case][1]
    rng = random.Random(case)
    for end in range(len(text) + 1):
        prefix = text[:end]
        cuts = sorted(rng.sample(range(1, end), min(end - 1, 3))) if end > 1 else []
        pieces = [prefix[i:j] for i, j in zip([0, *cuts], [*cuts, end])] or [""]
        for reason in ("stop", "length"):
            content, calls = read_answer(_reading(parser), prefix, reason)
            whole = (content or None, [(c.function.name, c.function.arguments) for c in calls],
                     str(finish_reason_with_calls(reason, bool(calls))))
            assert _stream_of(_reading(parser), pieces, reason) == whole, (prefix, pieces, reason)
