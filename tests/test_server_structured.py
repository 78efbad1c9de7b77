"""Structured outputs through the server, with the official `openai` client: every way to ask
(response_format, structured_outputs, guided_*), on both endpoints and both core clients;
equal to the offline API; and each bad constraint a 400 naming its field, the server serving on."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from pydantic import BaseModel, Field  # noqa: E402

from pagedrs import LLM, SamplingParams  # noqa: E402
from pagedrs.sampling_params import StructuredOutputsParams  # noqa: E402
from server_fakes import LiveServer, assert_nothing_left, live_server  # noqa: E402

MODEL = "tiny-llama"
ENGINE_KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks=256, max_num_seqs=16,
                                 max_model_len=256, swap_space_gb=0.01)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["cat", "dog"]},
                   "age": {"type": "integer", "minimum": 0, "maximum": 30}},
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


# conftest's template, rendering the tools and an assistant's calls too (their names only: the context,
# 256, must leave 200 tokens to a forced call), as a model with tool calling does: a template that renders neither is refused with tools.
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny Llama, its chat template rendering tools (``TOOLS_TEMPLATE``)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-tools")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def served(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    with live_server(tiny_llama_dir, ENGINE_KW, MODEL, core_process=request.param == "core-process") as live:
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
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), **ENGINE_KW)


def test_response_format_json_schema_answers_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, n=8, seed=3,
                                         temperature=1.0, max_tokens=150)
    assert len(out.choices) == 8
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet,
                                               temperature=1.0, seed=5, max_tokens=150)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.age <= 30
    if hasattr(client, "beta") and hasattr(client.beta.chat.completions, "parse"):  # the older name, same call
        again = client.beta.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet,
                                                   temperature=1.0, seed=5, max_tokens=150)
        assert again.choices[0].message.parsed == pet


def test_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                         temperature=0.0, max_tokens=200)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_response_format_text_is_free_text(client: openai.OpenAI, offline: LLM) -> None:
    out = client.completions.create(model=MODEL, prompt="The quick", temperature=0.0, max_tokens=8,
                                    extra_body={"response_format": {"type": "text"}})
    expected = offline.generate(["The quick"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert out.choices[0].text == expected


# (extra_body, the constraint offline, a pattern every answer matches)
WAYS = {
    "guided_regex": ({"guided_regex": r"(cat|dog)-[0-9]{2,4}"}, StructuredOutputsParams(regex=r"(cat|dog)-[0-9]{2,4}"),
                     r"(cat|dog)-[0-9]{2,4}"),
    "guided_choice": ({"guided_choice": ["red", "green"]}, StructuredOutputsParams(choice=["red", "green"]), "red|green"),
    "guided_grammar": ({"guided_grammar": 'start: "x" /[0-9]/ "y"'}, StructuredOutputsParams(grammar='start: "x" /[0-9]/ "y"'),
                       "x[0-9]y"),
    "guided_json": ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA), None),
    "structured_outputs": ({"structured_outputs": {"regex": "[a-c]{4}"}}, StructuredOutputsParams(regex="[a-c]{4}"),
                           "[a-c]{4}"),
    "structured_outputs_json": ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=SCHEMA),
                                None),
}


def test_beam_search_under_a_grammar_equals_the_offline_api(client: openai.OpenAI, offline: LLM) -> None:
    extra = {"guided_regex": r"(cat|dog)-[0-9]{2,4}", "use_beam_search": True, "best_of": 3}
    out = client.completions.create(model=MODEL, prompt="Answer:", temperature=0.0, max_tokens=12, n=2, extra_body=extra)
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=extra["guided_regex"]))
    expected = offline.generate(["Answer:"], params)[0].outputs
    assert [(c.text, c.finish_reason) for c in out.choices] == [(e.text, e.finish_reason) for e in expected]
    assert any(c.finish_reason == "stop" for c in out.choices)
    for c in out.choices:
        assert c.finish_reason == "length" or re.fullmatch(extra["guided_regex"], c.text), c.text


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_way_to_ask_equals_the_offline_api(client: openai.OpenAI, offline: LLM, way: str, endpoint: str) -> None:
    extra, constraint, pattern = WAYS[way]
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=constraint)
    if endpoint == "completions":
        out = client.completions.create(model=MODEL, prompt="Answer:", temperature=0.0, max_tokens=120, extra_body=extra)
        text, reason = out.choices[0].text, out.choices[0].finish_reason
        expected = offline.generate(["Answer:"], params)[0].outputs[0]
    else:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=120,
                                              extra_body=extra)
        text, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
        expected = offline.chat(MESSAGES, params)[0].outputs[0]
    assert (text, reason) == (expected.text, expected.finish_reason)
    assert reason == "stop"
    if pattern is None:
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(pattern, text), text


def test_streaming_under_a_constraint_equals_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Pet:", temperature=0.0, max_tokens=150, extra_body={"guided_json": SCHEMA})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [whole.finish_reason]


def test_the_second_request_with_the_same_schema_compiles_nothing(served: LiveServer, client: openai.OpenAI) -> None:
    schema = {**SCHEMA, "title": "compiled-once"}  # a schema no other test sends
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, temperature=0.0, max_tokens=4)
    core = getattr(served.engine, "core", None)
    if core is None:
        pytest.skip("the core runs in another process: its compile counter is not readable here")
    before = core.grammars.num_compiles
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, temperature=0.0, max_tokens=4)
    assert core.grammars.num_compiles == before


# ---- bad input: a 400 naming the field, and the server serves on ------------------------------------

DEEP = "[" * 10_000 + "]" * 10_000
BAD = {
    "invalid schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
                       "response_format.json_schema.schema", "objectx"),
    "regex llguidance cannot take": ({"guided_regex": "(?<=a)b"}, "guided_regex", "look-around"),
    "grammar that fails to compile": ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar", "compile"),
    "1 MB schema": ({"guided_json": {"type": "object", "description": "x" * 1_000_000}}, "guided_json", "at most 65536 bytes"),
    "10,000-deep schema text": ({"guided_json": DEEP}, "guided_json", "nesting depth"),
    "schema not an object": ({"guided_json": "[1]"}, "guided_json", "JSON object"),
    "two ways at once": ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "send one"),
    "two kinds in structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
                                        "exactly one"),
    "empty structured_outputs": ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    "unknown key in structured_outputs": ({"structured_outputs": {"regexp": "a"}}, "regexp", "regexp"),
    "json_schema without schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                   "response_format", "json_schema.schema"),
    "unknown response_format type": ({"response_format": {"type": "xml"}}, "type", "json_schema"),
    "empty choice": ({"guided_choice": []}, "guided_choice", "choice"),
    "min_tokens with a grammar": ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "min_tokens"),
    # the grammar ends the answer with EOS where it is complete: ignore_eos could not take effect
    "ignore_eos with a grammar": ({"guided_choice": ["yes", "no"], "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    # a stop cuts the answer before the grammar matched it ('{"name"' came back with finish_reason "stop")
    "stop with a grammar": ({"guided_regex": "a+b", "stop": ["a"]}, "stop", "structured_outputs"),
    "stop_token_ids with a grammar": ({"guided_choice": ["yes"], "stop_token_ids": [5]}, "stop_token_ids",
                                      "structured_outputs"),
}


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("case", sorted(BAD) + ["100-deep schema object"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_constraints_are_400_naming_the_field(served: LiveServer, offline: LLM, case: str, endpoint: str) -> None:
    if case == "100-deep schema object":  # past MAX_SCHEMA_DEPTH; the body nests 200 deep, which JSON parsers take
        extra, param, words = {"guided_json": _deep_schema(100)}, "guided_json", "nesting depth"
    else:
        extra, param, words = BAD[case]
    base = ({"prompt": "Hi", "max_tokens": 4} if endpoint == "completions"
            else {"messages": MESSAGES, "max_tokens": 4})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(served.url + path, json={"model": MODEL, **base, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    if param is not None:
        assert param in (error["param"] or "") + error["message"], error
    ok = httpx.post(served.url + path, json={"model": MODEL, **base, "guided_choice": ["yes", "no"]}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_body_nested_10000_deep_is_a_400(served: LiveServer) -> None:
    """Refused before any field is read: the body is not parsed (the 100-deep case above reaches the schema limit)."""
    deep = '{"a":' * 10_000 + "1" + "}" * 10_000
    body = f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 4, "guided_json": {deep}}}'
    r = httpx.post(served.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text[:500]
    assert "nests arrays or objects deeper than this server parses" in r.json()["error"]["message"]  # not "an error parsing the body"
    assert httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200


# ---- tool calling forced by a grammar ----------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("choice", ["required", "named", "required_one"])
def test_forced_tool_calls_are_well_formed(client: openai.OpenAI, choice: str) -> None:
    kw: dict[str, Any] = {"tool_choice": "required"}
    if choice == "named":
        kw = {"tool_choice": {"type": "function", "function": {"name": "add"}}}
    if choice == "required_one":
        kw["parallel_tool_calls"] = False
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, n=6, seed=5, temperature=1.0,
                                         max_tokens=200, **kw)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.content is None and c.message.tool_calls
        if choice != "required":
            assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name in SCHEMAS and (choice != "named" or call.function.name == "add")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         temperature=0.0, max_tokens=6)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content is not None


def _too_many_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]


TOOL_ERRORS = {
    "auto without a parser": ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "tool-call parser"),
    "tools without tool_choice (auto)": ({"tools": TOOLS}, "tool_choice", "tool-call parser"),
    "unknown named function": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                               "tool_choice", "not in tools"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "invalid tool schema": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                             "tool_choice": "required"}, "tools", "objectx"),
    "10,000 functions": ({"tools": _too_many_tools(), "tool_choice": "required"}, "tools", "128"),
    "duplicate names": ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "same name"),
    "forced call and response_format": ({"tools": TOOLS, "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}, "tool_choice", "not both"),
}


@pytest.mark.parametrize("case", sorted(TOOL_ERRORS))
def test_bad_tool_requests_are_400_naming_the_field(served: LiveServer, case: str) -> None:
    extra, param, words = TOOL_ERRORS[case]
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(served.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


def test_a_tool_call_round_trip(client: openai.OpenAI, offline: LLM) -> None:
    """call -> the tool's result as a 'tool' message -> the answer; the history reaches the template."""
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=8)
    assert answer.choices[0].message.content is not None and answer.choices[0].message.tool_calls is None
    rendered = offline.engine.tokenizer.apply_chat_template([
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "add", "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "content": "42", "tool_call_id": call.id},
    ], tools=TOOLS)
    assert answer.usage.prompt_tokens == len(rendered)
    bad = [*history[:-1], {**history[-1], "tool_calls": history[1]["tool_calls"]}]  # tool_calls on a tool message
    with pytest.raises(openai.BadRequestError, match="tool_calls belongs on 'assistant' messages"):
        client.chat.completions.create(model=MODEL, messages=bad, max_tokens=2)


def test_a_streamed_forced_call_equals_the_non_streamed_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0.0,
                              max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    joined: dict[int, tuple[str, str]] = {}  # index -> (name, arguments), joined the way a client joins them
    for t in (t for c in chunks for t in (c.choices[0].delta.tool_calls or [])):
        name, arguments = joined.get(t.index, (t.function.name, ""))
        joined[t.index] = (name, arguments + t.function.arguments)
    assert [(i, *joined[i]) for i in sorted(joined)] == [
        (i, t.function.name, t.function.arguments) for i, t in enumerate(whole.message.tool_calls)]
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) == len(joined)  # each call whole, once
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks)


DEAD_END = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
            "additionalProperties": False, "$defs": {"a": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_dead_ends_midway_is_the_requests_400_not_a_stop(served: LiveServer, stream: bool) -> None:
    """'{"x":' and then nothing can follow: the request ends with its error as a 400 (its own schema is at
    fault: a 500 would tell a client to retry), streamed as an error event, never finish_reason "stop"."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEAD_END}}}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]
        assert all(c["finish_reason"] != "stop" for e in events[:-1] for c in e.get("choices", []))
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "no token can continue" in error["message"], error
    ok = httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert ok.status_code == 200  # the server goes on


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logprobs_under_a_grammar_are_finite_numbers(served: LiveServer, stream: bool, endpoint: str) -> None:
    """Under a grammar the logprobs are the constrained distribution's (vLLM's order): a token it forbids
    has -inf, which JSON cannot carry (a 500 before, or null in a stream). They are shown at vLLM's floor,
    -9999.0; the forced choice's own tokens keep their real values."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": stream,
                            "guided_choice": ["yes", "no"]}
    if endpoint == "completions":
        body, path = {**base, "prompt": "Answer yes or no:", "logprobs": 5}, "/v1/completions"
    else:
        body, path = {**base, "messages": MESSAGES, "logprobs": True, "top_logprobs": 5}, "/v1/chat/completions"
    r = httpx.post(served.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    else:
        chunks = [r.json()]
    numbers: list[Any] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            lp = choice.get("logprobs")
            if not lp:
                continue
            if endpoint == "completions":
                numbers += lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()]
            else:
                for entry in lp["content"]:
                    numbers += [entry["logprob"]] + [t["logprob"] for t in entry["top_logprobs"]]
    assert numbers and all(isinstance(x, float) and -9999.0 <= x <= 0.0 for x in numbers), numbers
    assert -9999.0 in numbers  # a choice of two words leaves some of the top 5 forbidden


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_token_ids_the_grammar_forbids_are_the_requests_400(served: LiveServer, offline: LLM,
                                                                    stream: bool) -> None:
    """The grammar and allowed_token_ids together leave nothing to draw: the request's own settings
    conflict, so it ends with a 400 naming allowed_token_ids (a 500 before), and the server serves on."""
    eos = min(offline.engine.tokenizer.eos_token_ids)  # the choice grammar forbids EOS before "yes" or "no"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": stream, "guided_choice": ["yes", "no"],
            "allowed_token_ids": [eos]}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    if stream:
        assert r.status_code == 200
        error = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]["error"]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "allowed_token_ids" in error["message"], error
    ok = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_error_met_mid_answer_names_its_field_in_param(served: LiveServer, endpoint: str) -> None:
    """An allowed_token_ids the grammar leaves nothing of is found while the request runs (the core's
    FieldError): the 400's ``param`` was null, the field's name only in the message."""
    base = ({"prompt": "Hi", "max_tokens": 4} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    body = {"model": MODEL, **base, "guided_choice": ["yes", "no"], "allowed_token_ids": [1, 2, 3]}
    r = httpx.post(served.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "allowed_token_ids" and "every allowed token is masked" in error["message"], error
