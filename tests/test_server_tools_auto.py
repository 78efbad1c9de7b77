"""tool_choice "auto" end to end: a tiny random Qwen2 model whose chat template renders tools, served
with --tool-call-parser, and the official `openai` client. A random model never writes a call by
itself, so each test steers it with a structured_outputs regex to the exact text of a call in the
parser's format; what proves the parse is that the answer equals the offline engine's text under
the same regex, read by the same parser, and that the stream gives the same calls, arguments and
content as the whole answer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import make_tiny_model  # noqa: E402
from pagedrs import LLM, SamplingParams  # noqa: E402
from pagedrs.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedrs.server.cli import main as serve_main  # noqa: E402
from pagedrs.server.options import ServerOptions  # noqa: E402
from pagedrs.server.tool_parsers import PARSERS, read_text  # noqa: E402
from server_fakes import MODEL as FAKE_MODEL  # noqa: E402
from server_fakes import FakeEngine, LiveServer, Served, assert_nothing_left, live_server, served_factory  # noqa: E402

MODEL = "tiny-qwen"
ENGINE_KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=16, num_gpu_blocks=256, max_num_seqs=8,
                                 max_model_len=1024, swap_space_gb=0.01)
# Qwen2.5's template, cut down: the tools as JSON in a system turn, an assistant's calls as
# <tool_call> blocks, a tool's result as a <tool_response> in a user turn.
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _literal(text: str) -> str:
    """``text`` as a regex matching exactly it (llguidance's regex syntax, Rust's: no escaped spaces)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in text)


DIGIT = "[0-9]"
# Per parser: a regex (literal parts and digits) whose every match is "Sure." and two calls in its format.
CALLS_IN_FORMAT = {
    "hermes": ["Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": ", DIGIT, ", \"b\": ", DIGIT,
               "}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"", "[a-z]{1,5}",
               "\"}}\n</tool_call>"],
    "llama3_json": ["<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": ", DIGIT, ", \"b\": ", DIGIT,
                    "}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"", "[a-z]{1,5}", "\"}}"],
    "mistral": ["Sure. [TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": ", DIGIT, ", \"b\": ", DIGIT,
                "}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"", "[a-z]{1,5}", "\"}}]"],
}


def _regex(parts: list[str]) -> str:
    return "".join(p if p == DIGIT or p.startswith("[a-z]") else _literal(p) for p in parts)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen-tools")
    make_tiny_model("qwen2", folder, max_position_embeddings=1024)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def served(qwen_dir: Path) -> Iterator[LiveServer]:
    with live_server(qwen_dir, ENGINE_KW, MODEL, options=ServerOptions(tool_call_parser="hermes")) as live:
        yield live


@pytest.fixture(autouse=True)
def nothing_left(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "served" in request.fixturenames:
        assert_nothing_left(request.getfixturevalue("served").loop)


@pytest.fixture(scope="module")
def client(served: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(qwen_dir: Path) -> LLM:
    return LLM(model=str(qwen_dir), **ENGINE_KW)


@pytest.fixture
def parser_named(served: LiveServer) -> Iterator[Callable[[str], None]]:
    """Switch the running server's --tool-call-parser (the engine stays: one model for every format)."""
    ctx = served.app.state.ctx
    yield lambda name: setattr(ctx, "tool_call_parser", name)
    ctx.tool_call_parser = "hermes"


def _offline_text(offline: LLM, messages: list[dict[str, Any]], regex: str | None, max_tokens: int = 120) -> str:
    prompt = offline.engine.tokenizer.apply_chat_template(messages, tools=TOOLS)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(regex=regex) if regex else None)
    return str(offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].text)


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], finish reasons) joined from a stream as a client joins them,
    checking each chunk's shape: a call comes once complete, in one delta with id, type, name and
    its whole arguments (server/tools.py)."""
    content, calls, finish = "", [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for t in choice.delta.tool_calls or []:
            assert t.id.startswith("call_") and t.type == "function" and t.index == len(calls), t
            json.loads(t.function.arguments)
            calls.append((t.function.name, t.function.arguments))
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    return content, calls, finish


def test_the_template_renders_the_tools_and_an_unsteered_answer_is_text(client: openai.OpenAI, offline: LLM) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=12)
    rendered = offline.engine.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
    assert "get_weather" in offline.engine.tokenizer.decode(rendered)
    assert out.usage.prompt_tokens == len(rendered)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content == _offline_text(offline, MESSAGES, None, max_tokens=12)


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_auto_reads_the_calls_of_each_format_streamed_or_not(
    client: openai.OpenAI, offline: LLM, parser_named: Callable[[str], None], parser: str,
) -> None:
    parser_named(parser)
    regex = _regex(CALLS_IN_FORMAT[parser])
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0.0,
                              max_tokens=200, extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]
    text = _offline_text(offline, MESSAGES, regex, max_tokens=200)
    expected = read_text(PARSERS[parser](frozenset({"add", "get_weather"})), text)
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [name for name, _ in calls] == ["add", "get_weather"], (text, choice.message)
    assert calls == expected.calls and choice.message.content == expected.content
    assert choice.message.content == (None if parser == "llama3_json" else "Sure.")
    assert choice.finish_reason == "tool_calls"
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert json.loads(calls[0][1]).keys() == {"a", "b"}
    content, streamed, finish = _streamed(client, **kw)
    assert (content or None, streamed, finish) == (choice.message.content, calls, ["tool_calls"])


def test_parallel_tool_calls_false_returns_the_first_call(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=200,
                              parallel_tool_calls=False, extra_body={"structured_outputs": {"regex": _regex(CALLS_IN_FORMAT["hermes"])}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["add"] and choice.message.content == "Sure."
    content, streamed, finish = _streamed(client, **kw)
    assert (content, [n for n, _ in streamed], finish) == ("Sure.", ["add"], ["tool_calls"])


def test_each_of_n_sampled_choices_is_read_on_its_own(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=7, n=3, max_tokens=200,
                              extra_body={"structured_outputs": {"regex": _regex(CALLS_IN_FORMAT["hermes"])}})
    out = client.chat.completions.create(**kw)
    args = [[json.loads(c.function.arguments) for c in choice.message.tool_calls] for choice in out.choices]
    assert [choice.finish_reason for choice in out.choices] == ["tool_calls"] * 3
    assert all(a[0].keys() == {"a", "b"} and a[1].keys() == {"city"} for a in args)
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for t in choice.delta.tool_calls or []:
                streamed[choice.index] = streamed.get(choice.index, "") + t.function.arguments
    whole = {i: "".join(c.function.arguments for c in choice.message.tool_calls) for i, choice in enumerate(out.choices)}
    assert streamed == whole  # seeded: the same samples, each choice through its own parser


def test_streamed_logprobs_cover_every_token_held_back_or_not(client: openai.OpenAI) -> None:
    """Tokens of markup are held back from the chunks; their logprobs ride on the next chunk sent."""
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=200, logprobs=True,
                              extra_body={"structured_outputs": {"regex": _regex(CALLS_IN_FORMAT["hermes"])}})
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    streamed = [t.token for c in chunks for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in whole.logprobs.content] and len(streamed) > 20


def test_a_call_cut_by_max_tokens_is_text_streamed_or_not(client: openai.OpenAI, offline: LLM) -> None:
    """The stream holds a call until it is complete, so a cut one goes out as the same content."""
    regex = _regex(CALLS_IN_FORMAT["hermes"])
    prompt = offline.engine.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(regex=regex))
    ids = offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    decode = offline.engine.tokenizer.decode
    cut = next(n for n in range(len(ids)) if '"arguments": {"a": ' in decode(ids[:n]))  # inside the arguments
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=cut,
                              extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (decode(ids[:cut]), None, "length")
    content, streamed, finish = _streamed(client, **kw)
    assert (content, streamed, finish) == (decode(ids[:cut]), [], ["length"])


def test_a_call_of_an_unknown_function_stays_content(client: openai.OpenAI, offline: LLM) -> None:
    regex = _literal('<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>')
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=100,
                              extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]
    text = _offline_text(offline, MESSAGES, regex, max_tokens=100)
    assert "delete_all" in text
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    assert _streamed(client, **kw) == (text, [], ["stop"])


def test_a_round_trip_call_tool_message_answer(client: openai.OpenAI, offline: LLM) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=200,
                                           extra_body={"structured_outputs": {"regex": _regex(CALLS_IN_FORMAT["hermes"][:4]) +
                                                                               _literal("}}\n</tool_call>")}})
    assert first.choices[0].finish_reason == "tool_calls" and len(first.choices[0].message.tool_calls) == 1
    call = first.choices[0].message.tool_calls[0]
    a, b = json.loads(call.function.arguments).values()
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": str(a + b)}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0.0, max_tokens=20,
                                            extra_body={"structured_outputs": {"regex": "The sum is [0-9]{1,2}\\."}})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content.startswith("The sum is ")
    rendered = offline.engine.tokenizer.apply_chat_template([
        *MESSAGES,
        {"role": "assistant", "content": "Sure.", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "add", "arguments": {"a": a, "b": b}}}]},
        {"role": "tool", "content": str(a + b), "tool_call_id": call.id},
    ], tools=TOOLS)
    assert "<tool_response>" in offline.engine.tokenizer.decode(rendered)
    assert answer.usage.prompt_tokens == len(rendered)


def test_a_forced_call_streams_once_complete_in_one_delta(served: LiveServer, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=100,
                              tool_choice={"type": "function", "function": {"name": "add"}})
    whole = client.chat.completions.create(**kw).choices[0]
    with httpx.stream("POST", served.url + "/v1/chat/completions", json={**kw, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [t for e in events for t in e["choices"][0]["delta"].get("tool_calls") or []]
    assert len(deltas) == 1 and deltas[0].keys() == {"index", "id", "type", "function"}
    assert deltas[0]["function"] == {"name": "add", "arguments": whole.message.tool_calls[0].function.arguments}
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["tool_calls"]


# ---- without a parser, and a bad parser name ---------------------------------------------------------------

@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


def test_auto_without_a_parser_is_a_400_saying_how_to_start_the_server(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine())
    for extra in ({"tool_choice": "auto"}, {}):
        r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
            "model": FAKE_MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "--tool-call-parser {hermes,llama3_json,mistral}" in r.json()["error"]["message"]


def test_an_unknown_parser_name_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["--model", "nowhere", "--tool-call-parser", "qwen"]) == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser='qwen'" in err and "allowed hermes, llama3_json, mistral" in err, err
    with pytest.raises(ValueError, match="allowed hermes, llama3_json, mistral"):
        ServerOptions(tool_call_parser="Hermes")
