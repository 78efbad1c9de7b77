"""The tool-call parsers (server/tool_parsers) on hand-written model outputs: exact calls and content
for every format, and the same result however the text is cut (1-character pieces, random pieces);
the call reader checked against Python's json on thousands of random, mutated call objects."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pagedrs.server.tool_parsers import (
    PARSERS,
    CallArgs,
    CallBroken,
    CallStart,
    ForcedListParser,
    NamedCallParser,
    ReadCalls,
    Text,
    ToolParser,
    read_calls,
    read_text,
)
from pagedrs.server.tool_parsers.call_object import MAX_DEPTH, CallObject

TOOLS = frozenset({"get_weather", "add", "ünï"})
W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
A = '{"name":"add","arguments":{"a":1,"b":-2.5e3}}'


def _parser(name: str, max_calls: int | None = None) -> ToolParser:
    if name == "forced":
        return ForcedListParser(TOOLS, max_calls)
    if name == "named":
        return NamedCallParser("add")
    return PARSERS[name](TOOLS, max_calls)


def _pieces(text: str, how: str, rng: random.Random) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def _read(name: str, text: str, how: str = "whole", seed: int = 0, max_calls: int | None = None) -> ReadCalls:
    parser = _parser(name, max_calls)
    events = [e for piece in _pieces(text, how, random.Random(seed)) for e in parser.feed(piece)]
    return read_calls(events + parser.finish())


# (parser, model output, content, [(name, arguments)])
CASES: dict[str, tuple[str, str, str | None, list[tuple[str, str]]]] = {
    "hermes: text, two calls, text": (
        "hermes", f"Sure.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>{A}</tool_call>\nDone.",
        "Sure.\nDone.", [("get_weather", '{"city": "Paris", "unit": "C"}'), ("add", '{"a":1,"b":-2.5e3}')]),
    "hermes: calls only": ("hermes", f"<tool_call>\n{A}\n</tool_call>\n", None, [("add", '{"a":1,"b":-2.5e3}')]),
    "hermes: no closing tag at the end": ("hermes", f"<tool_call>{A}", None, [("add", '{"a":1,"b":-2.5e3}')]),
    "hermes: arguments before the name": (
        "hermes", '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', None, [("add", '{"a": 1}')]),
    "hermes: no arguments": ("hermes", '<tool_call>{"name": "add"}</tool_call>', None, [("add", "{}")]),
    "hermes: unicode and escapes": (
        "hermes", 'Ok 🙂 <tool_call>{"name": "\\u00fcn\\u00ef", "arguments": {"city": "東京 \\"q\\" \\\\ \\ud83d\\ude80"}}'
        "</tool_call>", "Ok 🙂", [("ünï", '{"city": "東京 \\"q\\" \\\\ \\ud83d\\ude80"}')]),
    "hermes: nested arguments": (
        "hermes", '<tool_call>{"name": "add", "arguments": {"a": [1, {"b": [true, false, null]}], "c": {}}}</tool_call>',
        None, [("add", '{"a": [1, {"b": [true, false, null]}], "c": {}}')]),
    "hermes: plain text with a < and a cut marker": ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    "hermes: trailing whitespace of a plain answer is kept": ("hermes", "Hello \n", "Hello \n", []),
    "hermes: unknown function is content": (
        "hermes", 'x <tool_call>{"name": "nope", "arguments": {}}</tool_call> y',
        'x <tool_call>{"name": "nope", "arguments": {}}</tool_call> y', []),
    "hermes: bad JSON is content": (
        "hermes", 'x <tool_call>{"name": "add", "arguments": {"a": tru}}</tool_call> y',
        'x <tool_call>{"name": "add", "arguments": {"a": tru}}</tool_call> y', []),
    "hermes: arguments not an object": (
        "hermes", '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', []),
    "hermes: not an object after the tag": ("hermes", "<tool_call> add(1, 2)", "<tool_call> add(1, 2)", []),
    "hermes: cut inside the arguments": (
        "hermes", 'I will.\n<tool_call>{"name": "add", "arguments": {"a": 1',
        'I will.\n<tool_call>{"name": "add", "arguments": {"a": 1', []),
    "hermes: a good call after a bad one": (
        "hermes", f'<tool_call>{{"name": "nope"}}</tool_call><tool_call>{A}</tool_call>',
        '<tool_call>{"name": "nope"}</tool_call>', [("add", '{"a":1,"b":-2.5e3}')]),
    "hermes: duplicate name key": (
        "hermes", '<tool_call>{"name": "add", "name": "add", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "name": "add", "arguments": {}}</tool_call>', []),
    "llama3: tagged, two calls": (
        "llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", '
        '"arguments": {"city": "Zürich"}}', None, [("add", '{"a": 1}'), ("get_weather", '{"city": "Zürich"}')]),
    "llama3: bare call": ("llama3_json", ' {"name": "add", "parameters": {}}', None, [("add", "{}")]),
    "llama3: a JSON answer is content": ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    "llama3: text first is all content": (
        "llama3_json", 'Hello {"name": "add", "parameters": {}}', 'Hello {"name": "add", "parameters": {}}', []),
    "llama3: text after the calls": (
        "llama3_json", '{"name": "add", "parameters": {"a": 2}}\nthat is all', "\nthat is all", [("add", '{"a": 2}')]),
    "llama3: both argument keys": (
        "llama3_json", '{"name": "add", "parameters": {}, "arguments": {}}',
        '{"name": "add", "parameters": {}, "arguments": {}}', []),
    "mistral: text, list of two, text": (
        "mistral", f'Let me see. [TOOL_CALLS] [{W}, {A}] ok', "Let me see. ok",
        [("get_weather", '{"city": "Paris", "unit": "C"}'), ("add", '{"a":1,"b":-2.5e3}')]),
    "mistral: empty list": ("mistral", "[TOOL_CALLS][]", None, []),
    "mistral: no list after the marker": ("mistral", "[TOOL_CALLS]add{}", "[TOOL_CALLS]add{}", []),
    "mistral: bad first object": (
        "mistral", '[TOOL_CALLS][{"name": 1}]', '[TOOL_CALLS][{"name": 1}]', []),
    "forced list": ("forced", '[{"name": "add", "parameters": {"a": 1}}, {"name": "ünï", "parameters": {}}]', None,
                    [("add", '{"a": 1}'), ("ünï", "{}")]),
    "named": ("named", '{"a": 1, "b": [2]}', None, [("add", '{"a": 1, "b": [2]}')]),
    "named cut short": ("named", '{"a": 1, "b": ', '{"a": 1, "b": ', []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_format_reads_exactly_these_calls(case: str) -> None:
    name, text, content, calls = CASES[case]
    assert read_text(_parser(name), text) == ReadCalls(content, calls)


@pytest.mark.parametrize("how", ["chars", "random"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_any_cut_of_the_text_reads_the_same(case: str, how: str) -> None:
    name, text, _, _ = CASES[case]
    whole = _read(name, text)
    for seed in range(5 if how == "random" else 1):
        assert _read(name, text, how, seed) == whole


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    text = f"Sure.\n<tool_call>{W}</tool_call>\n<tool_call>{A}</tool_call>\nthen <tool_call>{A}</tool_call>"
    assert _read("hermes", text, "chars", max_calls=1) == ReadCalls(
        "Sure.\nthen", [("get_weather", '{"city": "Paris", "unit": "C"}')])
    assert _read("mistral", f"[TOOL_CALLS][{A}, {W}]", max_calls=1) == ReadCalls(None, [("add", '{"a":1,"b":-2.5e3}')])


def test_a_stream_never_shows_markup_and_announces_a_call_once_its_name_is_known() -> None:
    text = f"Sure.\n<tool_call>\n{W}\n</tool_call>\nDone."
    parser = _parser("hermes")
    seen: list[tuple[int, Any]] = []
    for i, c in enumerate(text):
        seen += [(i, e) for e in parser.feed(c)]
    seen += [(len(text), e) for e in parser.finish()]
    content = "".join(e.text for _, e in seen if isinstance(e, Text))
    assert content == "Sure.\nDone." and "<" not in content
    start = [(i, e) for i, e in seen if isinstance(e, CallStart)]
    assert [e for _, e in start] == [CallStart(0, "get_weather")]
    assert start[0][0] == text.index('"arguments": {') + len('"arguments": ')  # at the arguments' "{"
    pieces = [e.piece for _, e in seen if isinstance(e, CallArgs)]
    assert len(pieces) == len('{"city": "Paris", "unit": "C"}') and "".join(pieces) == '{"city": "Paris", "unit": "C"}'
    assert [i for i, e in seen if isinstance(e, Text)][:5] == [0, 1, 2, 3, 4]  # content is sent as it comes


def test_a_call_broken_after_its_start_is_content_when_read_whole() -> None:
    text = 'x <tool_call>{"name": "add", "arguments": {"a": 1]'
    parser = _parser("hermes")
    events = parser.feed(text) + parser.finish()
    assert [type(e) for e in events] == [Text, CallStart, CallArgs, CallBroken, Text]  # the refused "]" is text
    assert read_calls(events) == ReadCalls(text, [])


def test_nesting_past_the_bound_is_refused() -> None:
    deep = '{"name": "add", "arguments": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}"
    assert read_text(_parser("hermes"), f"<tool_call>{deep}</tool_call>").calls == []
    ok = '{"name": "add", "arguments": {"a": ' + "[" * (MAX_DEPTH - 3) + "]" * (MAX_DEPTH - 3) + "}}"
    assert len(read_text(_parser("hermes"), f"<tool_call>{ok}</tool_call>").calls) == 1


# ---- the call reader against Python's json ----------------------------------------------------------------

def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 12, 3.25, -0.5e-3, 1e21])
    if kind == 2:
        return "".join(rng.choice('ab "\\/\n\tü東🙂\u0001') for _ in range(rng.randrange(5)))
    if kind == 3:
        return rng.randrange(100)
    if kind in (4, 5):
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(3))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]


class _Refused(Exception):
    pass


def _reference(text: str) -> tuple[str, Any] | None:
    """What a call object means by Python's json: (name, arguments), or None when it is no call."""
    def top_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise _Refused  # only the top level's duplicates matter; a nested duplicate keeps the last
        return dict(pairs)

    def no_constant(name: str) -> Any:
        raise _Refused  # NaN, Infinity: not JSON

    try:
        obj = json.loads(text, parse_constant=no_constant)
        pairs = json.loads(text, object_pairs_hook=lambda p: p, parse_constant=no_constant)
    except (ValueError, _Refused):
        return None
    if not isinstance(obj, dict):
        return None
    try:
        top_keys(pairs)
    except _Refused:
        return None
    if not isinstance(obj.get("name"), str) or obj["name"] not in TOOLS:
        return None
    arguments = obj.get("arguments", {})
    return (obj["name"], arguments) if isinstance(arguments, dict) else None


def _mutated(text: str, rng: random.Random) -> str:
    i = rng.randrange(len(text) + 1)
    op = rng.randrange(3)
    if op == 0:
        return text[:i] + text[i + 1:]
    junk = rng.choice(list('{}[]",:\\ 0-.eEtfnug\n\x01') + ["true", "null", "1e", '"name"', "NaN"])
    return text[:i] + junk + text[i + (op == 2):]


def test_the_call_reader_agrees_with_json_on_random_mutated_calls() -> None:
    rng = random.Random(20261202)
    refused = accepted = 0
    for _ in range(4000):
        arguments = {f"k{i}": _random_value(rng) for i in range(rng.randrange(4))}
        call: dict[str, Any] = {"name": rng.choice([*sorted(TOOLS), "nope"]), "arguments": arguments}
        if rng.random() < 0.3:
            call = dict(reversed(list(call.items())))
        text = json.dumps(call, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        for _ in range(rng.randrange(3)):
            text = _mutated(text, rng)
        text = text.strip(" \t\n\r")  # the formats take the whitespace around a call object
        reader = CallObject(TOOLS)
        ok = all(reader.push(c) for c in text) and reader.done
        expected = _reference(text)
        assert (expected is not None) == ok, text
        if ok:
            assert (reader.name, json.loads(reader.args)) == expected, text
            accepted += 1
        else:
            refused += 1
    assert accepted > 1000 and refused > 1000  # both sides of the rule were exercised
