"""Nothing a client sends is silently ignored (issue 23, items 6, 7, 9 and 10), on the fake engine.

The walk: every field of the OpenAI request types in the pinned ``openai`` package (the
completions and chat bodies, every chat message type, content part and ``stream_options``)
is sent with a plausible value, and must be either honoured (the tables below say how that
shows: the engine's SamplingParams, its prompt, the response) or refused with a 400 naming
it. A field these tables do not know fails the test, so the next field OpenAI adds cannot
slip through. The few accepted and ignored on purpose must be the server's documented list
(``field_policy.IGNORED_FIELDS``) and must not change what reaches the engine.
"""

from __future__ import annotations

import itertools
import json
import typing
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import typing_extensions

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from openai.types import completion_create_params as completion_types  # noqa: E402
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam  # noqa: E402
from openai.types.chat import completion_create_params as chat_types  # noqa: E402

from pagedrs.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedrs.server.field_policy import IGNORED_FIELDS  # noqa: E402
from pagedrs.server.options import ServerOptions  # noqa: E402
from server_fakes import MODEL, FakeEngine, Served, served_factory  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 3},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def make_module_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


@pytest.fixture(scope="module")
def served(make_module_served: Callable[..., Served]) -> Served:
    return make_module_served(FakeEngine(), max_waiting=64)


class Reply:
    """One HTTP exchange: the response, and what the fake engine was given for it."""

    def __init__(self, served: Served, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.request_id = f"walk-{next(_ids)}"
        headers = {"X-Request-Id": self.request_id, **(headers or {})}
        self.http = httpx.post(served.url + path, json=body, headers=headers, timeout=60)
        self.added = [v for k, v in served.engine.added.items() if k.startswith(self.request_id + "-")]

    @property
    def status(self) -> int:
        return self.http.status_code

    def json(self) -> Any:
        return self.http.json()

    def events(self) -> list[Any]:
        """The SSE events of a streamed response, decoded, ending with the literal [DONE]."""
        assert self.http.headers["content-type"].startswith("text/event-stream"), self.http.text
        data = [line[len("data: "):] for line in self.http.text.split("\n\n") if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return [json.loads(d) for d in data[:-1]]

    @property
    def params(self) -> Any:
        assert self.status == 200, self.http.text
        assert len(self.added) >= 1
        return self.added[0]["params"]

    def prompt_text(self) -> str:
        return "".join(chr(t) for t in self.added[0]["ids"])


def send(served: Served, path: str, extra: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
    return Reply(served, path, {**BASE[path], **extra}, headers)


def assert_refused(reply: Reply, name: str, param: str | None = None) -> dict[str, Any]:
    """A 400 whose error names ``name`` (its ``param`` is the top-level field), and nothing reached the engine."""
    assert reply.status == 400, f"{name}: expected a 400 naming it, got {reply.status}: {reply.http.text}"
    error = reply.json()["error"]
    assert error["param"] == (param or name.split(".")[0]), error
    assert name in error["message"], error
    assert reply.added == []
    return error


# --- what honoured means, per field -------------------------------------------------------------
# field -> (the request fragment that sets it, a check of the reply)


def _params_has(**expected: Any) -> Callable[[Reply], None]:
    def check(reply: Reply) -> None:
        for name, value in expected.items():
            assert getattr(reply.params, name) == value, (name, getattr(reply.params, name), value)

    return check


def _choices(count: int) -> Callable[[Reply], None]:
    def check(reply: Reply) -> None:
        assert reply.params.n == count and len(reply.json()["choices"]) == count

    return check


def _completion_tokens(count: int) -> Callable[[Reply], None]:
    def check(reply: Reply) -> None:
        assert reply.params.max_tokens == count
        assert reply.json()["usage"]["completion_tokens"] == count

    return check


def _streamed(reply: Reply) -> None:
    events = reply.events()
    # One event per token, or fewer, merged ones when the stream lagged (DeltaStream): the same text.
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])
    assert text == "abc" and all(e["object"].endswith(("chunk", "text_completion")) for e in events)
    assert events[-1]["usage"] is None


def _streamed_usage(reply: Reply) -> None:
    events = reply.events()
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def _echoed(reply: Reply) -> None:
    assert reply.json()["choices"][0]["text"] == "hi" + "abc"


def _completion_logprobs(reply: Reply) -> None:
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert reply.params.logprobs == 2
    assert logprobs["tokens"] == ["a", "b", "c"] and all(len(top) == 2 for top in logprobs["top_logprobs"])


def _chat_logprobs(top: int) -> Callable[[Reply], None]:
    def check(reply: Reply) -> None:
        content = reply.json()["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == ["a", "b", "c"]
        assert all(len(c["top_logprobs"]) == top for c in content)

    return check


def _prompt_is(text: str) -> Callable[[Reply], None]:
    def check(reply: Reply) -> None:
        assert reply.prompt_text() == text

    return check


def _ok(reply: Reply) -> None:
    assert reply.status == 200, reply.http.text


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _prompt_starts(text: str) -> Callable[[Reply], None]:
    def check(reply: Reply) -> None:
        assert reply.prompt_text().startswith(text), reply.prompt_text()

    return check


def _forces_one_call(reply: Reply) -> None:
    schema = reply.params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1, schema


SHARED_HONOURED: dict[str, tuple[dict[str, Any], Callable[[Reply], None]]] = {
    "model": ({"model": MODEL}, _ok),
    "n": ({"n": 2}, _choices(2)),
    "max_tokens": ({"max_tokens": 2}, _completion_tokens(2)),
    "frequency_penalty": ({"frequency_penalty": 0.5}, _params_has(frequency_penalty=0.5)),
    "presence_penalty": ({"presence_penalty": 0.25}, _params_has(presence_penalty=0.25)),
    "seed": ({"seed": 7}, _params_has(seed=7)),
    "stop": ({"stop": ["zz"]}, _params_has(stop=["zz"])),
    "temperature": ({"temperature": 0.5}, _params_has(temperature=0.5)),
    "top_p": ({"top_p": 0.5}, _params_has(top_p=0.5)),
    "logit_bias": ({"logit_bias": {"97": 5, "98": -100}}, _params_has(logit_bias={97: 5.0, 98: -100.0})),
    "stream": ({"stream": True}, _streamed),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, _streamed_usage),
}
HONOURED: dict[str, dict[str, tuple[dict[str, Any], Callable[[Reply], None]]]] = {
    COMPLETIONS: {
        **SHARED_HONOURED,
        "prompt": ({"prompt": "hello"}, _prompt_is("hello")),
        "best_of": ({"best_of": 2}, _params_has(best_of=2, n=1)),
        "echo": ({"echo": True}, _echoed),
        "logprobs": ({"logprobs": 2}, _completion_logprobs),
    },
    CHAT: {
        **SHARED_HONOURED,
        "messages": ({"messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]},
                     _prompt_is("<system>be<user>hi<assistant>")),
        # max_tokens null: BASE's 3 beside it would be refused as two different lengths
        "max_completion_tokens": ({"max_tokens": None, "max_completion_tokens": 2}, _completion_tokens(2)),
        "logprobs": ({"logprobs": True}, _chat_logprobs(0)),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, _chat_logprobs(2)),
        "response_format": ({"response_format": {"type": "json_object"}},
                            _params_has(structured_outputs=StructuredOutputsParams(json_object=True))),
        "tools": ({"tools": [_TOOL], "tool_choice": "none"}, _prompt_starts("<tool:f><user>")),
        "tool_choice": ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
                        _params_has(structured_outputs=StructuredOutputsParams(json={"type": "object"}))),
        "parallel_tool_calls": ({"tools": [_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
                                _forces_one_call),
    },
}
# field -> a plausible value that the server must refuse (not supported yet)
REFUSED: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"suffix": "!"},
    CHAT: {
        "audio": {"voice": "alloy", "format": "mp3"},
        "function_call": "auto",
        "functions": [{"name": "f", "parameters": {"type": "object"}}],
        "modalities": ["text", "audio"],
        "moderation": {"model": "omni-moderation-latest"},
        "prediction": {"type": "content", "content": "abc"},
        "prompt_cache_options": {"ttl": "30m"},
        "prompt_cache_retention": "24h",
        "reasoning_effort": "low",
        "service_tier": "flex",
        "store": True,
        "verbosity": "low",
        "web_search_options": {},
    },
}
# field -> a plausible value accepted and ignored on purpose
IGNORED: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"user": "user-1"},
    CHAT: {"user": "user-1", "metadata": {"k": "v"}, "safety_identifier": "s-1", "prompt_cache_key": "k-1"},
}


def _fields(typed_dict: Any) -> list[str]:
    return sorted(typing.get_type_hints(typed_dict))


REQUEST_FIELDS = [
    (path, name)
    for path, types in ((COMPLETIONS, completion_types), (CHAT, chat_types))
    for name in sorted({*_fields(types.CompletionCreateParamsStreaming), *_fields(types.CompletionCreateParamsNonStreaming)})
]


@pytest.mark.parametrize("path,name", REQUEST_FIELDS, ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, n in REQUEST_FIELDS])
def test_every_openai_request_field_is_honoured_or_refused(served: Served, path: str, name: str) -> None:
    if name in HONOURED[path]:
        fragment, check = HONOURED[path][name]
        reply = send(served, path, fragment)
        assert reply.status == 200, reply.http.text
        check(reply)
    elif name in REFUSED[path]:
        error = assert_refused(send(served, path, {name: REFUSED[path][name]}), name)
        assert "not supported" in error["message"]
    elif name in IGNORED[path]:
        assert name in IGNORED_FIELDS, f"{name} is ignored but not in the documented list"
        plain, ignored = send(served, path, {}), send(served, path, {name: IGNORED[path][name]})
        assert ignored.status == 200, ignored.http.text
        assert ignored.params == plain.params and ignored.added[0]["ids"] == plain.added[0]["ids"]
    else:
        pytest.fail(f"new OpenAI field {name} ({path}): honour it or refuse it (and add it to this test's tables)")


def test_the_ignored_list_is_exactly_what_the_walk_ignores() -> None:
    assert set(IGNORED_FIELDS) == set(IGNORED[COMPLETIONS]) | set(IGNORED[CHAT])


# --- messages, content parts, stream_options ------------------------------------------------------

REFUSED_ROLES = ("function",)
# role -> field -> how it is treated ("honoured", or a plausible value that must be refused)
MESSAGE_FIELDS: dict[str, dict[str, Any]] = {
    "developer": {"role": "honoured", "content": "honoured", "name": "alice"},
    "system": {"role": "honoured", "content": "honoured", "name": "alice"},
    "user": {"role": "honoured", "content": "honoured", "name": "alice"},
    "assistant": {
        "role": "honoured", "content": "honoured", "name": "alice", "audio": {"id": "audio-1"},
        "function_call": {"name": "f", "arguments": "{}"}, "refusal": "I cannot",
        "tool_calls": "honoured",  # test_server_structured.py: the tool-call round trip
    },
    "tool": {"role": "honoured", "content": "honoured", "tool_call_id": "honoured"},
    "function": {"role": "refused", "content": "moot", "name": "moot"},
}
TEXT_PART_FIELDS = {"type": "honoured", "text": "honoured", "prompt_cache_breakpoint": {"mode": "explicit"}}
STREAM_OPTION_FIELDS = {"include_usage": "honoured", "include_obfuscation": True}


def _role_of(message_type: Any) -> str:
    (role,) = typing.get_args(typing.get_type_hints(message_type)["role"])
    return str(role)


MESSAGE_TYPES = {_role_of(t): t for t in typing.get_args(ChatCompletionMessageParam)}


@pytest.mark.parametrize("role", sorted(MESSAGE_TYPES))
def test_every_message_field_is_honoured_or_refused(served: Served, role: str) -> None:
    known = MESSAGE_FIELDS.get(role)
    if known is None:
        pytest.fail(f"new OpenAI message role {role!r}: honour it or refuse it")
    for name in _fields(MESSAGE_TYPES[role]):
        if name not in known:
            pytest.fail(f"new OpenAI field {name} of {role!r} messages: honour it or refuse it")
    if role in REFUSED_ROLES:
        message = {"role": role, "content": "x", **({"tool_call_id": "c1"} if role == "tool" else {"name": "f"})}
        error = assert_refused(send(served, CHAT, {"messages": [message]}), "messages.0.role")
        assert "not supported yet" in error["message"]
        return
    rendered = send(served, CHAT, {"messages": [{"role": role, "content": "yo"}]})
    assert rendered.status == 200 and rendered.prompt_text() == f"<{role}>yo<assistant>"  # role and content
    for name, value in known.items():
        if value != "honoured":
            reply = send(served, CHAT, {"messages": [{"role": role, "content": "yo", name: value}]})
            assert "not supported" in assert_refused(reply, f"messages.0.{name}")["message"]


def _typed_dicts(annotation: Any) -> list[Any]:
    """Every TypedDict inside a type annotation (unions, Iterable[...], Required[...] unwrapped)."""
    if typing_extensions.is_typeddict(annotation):
        return [annotation]
    return [t for arg in typing.get_args(annotation) for t in _typed_dicts(arg)]


def _content_part_types() -> dict[str, Any]:
    parts = {}
    for message_type in MESSAGE_TYPES.values():
        for part in _typed_dicts(typing.get_type_hints(message_type).get("content")):
            (kind,) = typing.get_args(typing.get_type_hints(part)["type"])
            parts[str(kind)] = part
    return parts


def test_every_content_part_is_honoured_or_refused(served: Served) -> None:
    parts = _content_part_types()
    assert "text" in parts and len(parts) >= 3  # the walk found the union (text, image_url, ...)
    for name in _fields(parts["text"]):
        if name not in TEXT_PART_FIELDS:
            pytest.fail(f"new OpenAI field {name} of text content parts: honour it or refuse it")
    joined = send(served, CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}]})
    assert joined.status == 200 and joined.prompt_text() == "<user>ab<assistant>"
    for name, value in TEXT_PART_FIELDS.items():
        if value != "honoured":
            part = {"type": "text", "text": "a", name: value}
            reply = send(served, CHAT, {"messages": [{"role": "user", "content": [part]}]})
            assert_refused(reply, name, param="messages")
    for kind in sorted(set(parts) - {"text"}):
        reply = send(served, CHAT, {"messages": [{"role": "user", "content": [{"type": kind, kind: {}}]}]})
        assert "only 'text' parts" in assert_refused(reply, "messages.0.content")["message"], kind


def test_every_stream_option_is_honoured_or_refused(served: Served) -> None:
    for name in _fields(ChatCompletionStreamOptionsParam):
        if name not in STREAM_OPTION_FIELDS:
            pytest.fail(f"new OpenAI field {name} of stream_options: honour it or refuse it")
    for path in (COMPLETIONS, CHAT):
        reply = send(served, path, {"stream": True, "stream_options": {"include_obfuscation": True}})
        assert "not supported" in assert_refused(reply, "stream_options.include_obfuscation")["message"]


# --- refusals with no OpenAI type to walk ---------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("name,value", [
    ("banana", 1),                                  # a name nobody defines
    ("guided_decoding_backend", "xgrammar"),
    ("guided_whitespace_pattern", " *"),
])
def test_extensions_and_unknown_fields_are_refused(served: Served, path: str, name: str, value: Any) -> None:
    error = assert_refused(send(served, path, {name: value}), name)
    assert ("not a field this server knows" if name == "banana" else "not supported yet") in error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_an_unknown_response_format_type_is_refused(served: Served, path: str) -> None:
    error = assert_refused(send(served, path, {"response_format": {"type": "banana"}}), "response_format")  # the issue's example
    assert "json_schema" in error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fragment, expected", [
    ({"guided_json": {"type": "object"}}, StructuredOutputsParams(json={"type": "object"})),
    ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),  # GBNF
    ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputsParams(choice=["a"])),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
     StructuredOutputsParams(json={"type": "object"})),
    ({"guided_regex": "a+", "guided_decoding_backend": "llguidance"}, StructuredOutputsParams(regex="a+")),
])
def test_structured_outputs_reach_the_engine(served: Served, path: str, fragment: Any, expected: Any) -> None:
    """vLLM's names and OpenAI's response_format (server/structured.py), as the engine's SamplingParams."""
    reply = send(served, path, fragment)
    assert reply.status == 200, reply.http.text
    assert reply.params.structured_outputs == expected


@pytest.mark.parametrize("path,fragment", [
    (CHAT, {"response_format": {"type": "text"}}),
    (CHAT, {"store": False}),
    (CHAT, {"service_tier": "auto"}),
    (CHAT, {"tool_choice": "none", "tools": None, "function_call": "none"}),
    (CHAT, {"modalities": ["text"]}),
    (CHAT, {"logit_bias": {}}),
    (COMPLETIONS, {"suffix": "", "logit_bias": None}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_obfuscation": False}}),
])
def test_values_that_ask_for_what_pagedrs_does_are_accepted(served: Served, path: str, fragment: Any) -> None:
    assert send(served, path, {}).params == send(served, path, fragment).params


def test_store_zero_is_not_false(served: Served) -> None:
    assert_refused(send(served, CHAT, {"store": 0}), "store")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_a_400(served: Served, path: str, stream: bool | None) -> None:
    fragment = {"stream_options": {"include_usage": True}, **({} if stream is None else {"stream": stream})}
    assert "only allowed when stream is true" in assert_refused(send(served, path, fragment), "stream_options")["message"]


def test_an_unknown_role_is_a_400_listing_the_roles(served: Served) -> None:
    error = assert_refused(send(served, CHAT, {"messages": [{"role": "narrator", "content": "x"}]}), "messages.0.role")
    assert "unknown role 'narrator'" in error["message"] and "'developer'" in error["message"]


# --- cached tokens (item 7) ---------------------------------------------------------------------


def test_usage_counts_cached_prompt_tokens_on_both_endpoints_streamed_or_not(
    make_served: Callable[..., Served],
) -> None:
    client = make_served(FakeEngine()).client()  # its own engine: an empty prefix cache
    prompt = "cached tokens!"  # 14 tokens: 3 full pages of 4 can be reused, never the last token's
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=[prompt, prompt + "?", "fresh text"], max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 12 + 12 + 0  # summed over the prompts
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    messages = [{"role": "user", "content": "a chat prompt"}]  # 6 + 13 + 11 = 30 tokens, 7 full pages before the last
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2) \
        .usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 28


# --- sequences per request (item 9) ---------------------------------------------------------------


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


def test_the_issue_request_of_64_prompts_x_n_128_is_refused_by_default(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), max_waiting=64)
    reply = Reply(served, COMPLETIONS, {"model": MODEL, "prompt": [[5, 6]] * 64, "n": 128, "max_tokens": 1})
    error = assert_refused(reply, "n")
    assert "64 prompt(s) x n=128 = 8192 sequences" in error["message"]
    assert "--max-seqs-per-request=256" in error["message"]
    assert served.count("add") == 0


def test_the_cap_counts_prompts_times_n_or_best_of(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), max_waiting=64, options=ServerOptions(max_seqs_per_request=16))

    def completions(prompts: int, **fields: Any) -> Reply:
        return Reply(served, COMPLETIONS, {"model": MODEL, "prompt": [[5, 6]] * prompts, "max_tokens": 1, **fields})

    assert completions(4, n=4).status == 200  # 16: at the cap
    assert "5 prompt(s) x n=4 = 20" in assert_refused(completions(5, n=4), "n")["message"]
    assert "2 prompt(s) x best_of=10 = 20" in assert_refused(completions(2, best_of=10), "best_of")["message"]
    chat = Reply(served, CHAT, {**BASE[CHAT], "n": 17})
    assert "1 prompt(s) x n=17 = 17" in assert_refused(chat, "n")["message"]


# --- X-Request-Id (item 10) -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_x_request_id_is_echoed_in_the_header_and_the_first_event(served: Served, path: str) -> None:
    given = f"client.id:{next(_ids)}"
    plain = send(served, path, {}, headers={"X-Request-Id": given})
    assert plain.status == 200 and plain.http.headers["x-request-id"] == given
    assert "request_id" not in plain.json()
    streamed = send(served, path, {"stream": True}, headers={"X-Request-Id": given})
    assert streamed.http.headers["x-request-id"] == given
    events = streamed.events()
    assert events[0]["request_id"] == given and all("request_id" not in e for e in events[1:])
    refused = send(served, path, {"banana": 1}, headers={"X-Request-Id": given})
    assert refused.status == 400 and refused.http.headers["x-request-id"] == given
    # the engine's ids keep a random suffix: a reused id never collides
    ids = [k for k in served.engine.added if k.startswith(given + "-")]
    assert len(ids) == 2 and len(set(ids)) == 2
    without = httpx.post(served.url + path, json={**BASE[path], "stream": True}, timeout=60)
    assert "x-request-id" not in without.headers and '"request_id"' not in without.text


# --- bodies and messages that would have lost something silently ----------------------------------


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool", "assistant"])
@pytest.mark.parametrize("content", ["null", "absent"])
def test_a_message_without_content_is_a_400(served: Served, role: str, content: str) -> None:
    """Rendered as "", a missing turn would pass for an empty one; only an assistant's tool call may omit it."""
    message: dict[str, Any] = {"role": role, **({"tool_call_id": "c1"} if role == "tool" else {})}
    if content == "null":
        message["content"] = None
    error = assert_refused(send(served, CHAT, {"messages": [message]}), "messages.0")
    assert f"a '{role}' message needs content" in error["message"]


def test_an_assistant_tool_call_may_leave_content_null(served: Served) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert send(served, CHAT, {"messages": messages}).status == 200


def _raw(served: Served, body: bytes) -> httpx.Response:
    return httpx.post(served.url + COMPLETIONS, content=body, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body, words", [
    (b'{"model": "%s", "prompt": "hi", "max_tokens": 3, "max_tokens": 4}', "the key 'max_tokens' twice in one object"),
    (b'{"model": "%s", "prompt": "hi", "logit_bias": {"5": 1, "5": 2}}', "the key '5' twice in one object"),
    (b'{"model": "%s", "prompt": "\xff\xfe"}', "not UTF-8 text: byte 0xff at offset"),
    (b'{"model": "%s", "prompt": "hi",}', "not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    (b'\xef\xbb\xbf{"model": "%s", "prompt": "hi"}', "not valid JSON: Unexpected UTF-8 BOM"),
])
def test_a_body_that_would_lose_a_value_or_cannot_be_read_is_a_400_saying_why(served: Served, body: bytes,
                                                                              words: str) -> None:
    added = len(served.engine.added)
    r = _raw(served, body.replace(b"%s", MODEL.encode()))
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert len(served.engine.added) == added
    ok = _raw(served, b'{"model": "%s", "prompt": "hi", "max_tokens": 3}'.replace(b"%s", MODEL.encode()))
    assert ok.status_code == 200, ok.text  # the server goes on
    nested = {**BASE[CHAT], "metadata": {"max_tokens": "x"}}  # the same key in another object
    assert httpx.post(served.url + CHAT, json=nested, timeout=60).status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_schema_that_matches_nothing_is_a_400_naming_its_field(served: Served, path: str) -> None:
    schema = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    fragment = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}} \
        if path == CHAT else {"structured_outputs": {"json": schema}}
    reply = send(served, path, fragment)
    field = "response_format.json_schema.schema" if path == CHAT else "structured_outputs.json"
    error = assert_refused(reply, field, param=field)
    assert "accepts no output" in error["message"] and "refers to itself" in error["message"]
