"""Input validation found lacking by a black-box probe of the server, on the fake engine: each
input here was accepted, coerced, silently ignored, misnamed or answered with a 500.

The rule they all follow: bad input is a 400 naming the field, the value and what is allowed;
a field that is accepted takes effect; nothing is coerced (``"3"`` is not 3, ``false`` is not
0.0); a client's mistake is never a 500.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedrs.sampling_params import MAX_SCHEMA_DEPTH  # noqa: E402
from pagedrs.server.options import ServerOptions  # noqa: E402
from server_fakes import MODEL, FakeEngine, FakeTokenizer, Served, served_factory  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
KEY = "sk-validation-test"
RECURSE = "<recurse>"  # content that DeepTokenizer's template answers with a RecursionError


class DeepTokenizer(FakeTokenizer):
    """A template that walks what it is given recursively, as Jinja's ``tojson`` does in a real
    chat template: a deep enough structure overflows the stack (a RecursionError)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        copy.deepcopy((messages, tools))
        if any(m.get("content") == RECURSE for m in messages):
            raise RecursionError("maximum recursion depth exceeded")
        return super().apply_chat_template(messages, add_generation_prompt, tools)


@pytest.fixture(scope="module")
def make_module_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


@pytest.fixture(scope="module")
def served(make_module_served: Callable[..., Served]) -> Served:
    engine = FakeEngine()
    engine.tokenizer = DeepTokenizer()
    return make_module_served(engine, max_waiting=64)


@pytest.fixture(scope="module")
def keyed(make_module_served: Callable[..., Served]) -> Served:
    return make_module_served(FakeEngine(), options=ServerOptions(api_key=KEY))


def _post(served: Served, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """As a client sends it: JSON text (``json.dumps`` writes NaN as NaN, which Python's parser reads)."""
    return httpx.post(served.url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 3, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


def _refused(response: httpx.Response, param: str | None, *words: str) -> dict[str, Any]:
    """A 400 whose ``param`` is ``param`` and whose message has every one of ``words``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def _nested(depth: int) -> dict[str, Any]:
    """A JSON object ``depth`` levels deep: {"a": {"a": ... {} ...}}."""
    node: dict[str, Any] = {}
    for _ in range(depth - 1):
        node = {"a": node}
    return node


# --- 1: numbers are JSON numbers, never booleans or strings ---------------------------------

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"]
INT_FIELDS = ["n", "max_tokens", "seed", "top_k", "min_tokens", "priority", "best_of"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("name", FLOAT_FIELDS + INT_FIELDS)
@pytest.mark.parametrize("value", [False, True, "0", "3"], ids=["false", "true", "'0'", "'3'"])
def test_a_number_field_refuses_booleans_and_strings(served: Served, path: str, name: str, value: Any) -> None:
    """``"temperature": false`` was read as 0.0 (greedy), ``"max_tokens": "3"`` as 3: a client's typo
    or a wrong type in its code changed what was generated without a word."""
    body = (_completion if path == COMPLETIONS else _chat)(**{name: value})
    kind = "boolean" if isinstance(value, bool) else "string"
    _refused(_post(served, path, body), name, name, kind, repr(value))


@pytest.mark.parametrize(("path", "name", "value"), [
    (COMPLETIONS, "logprobs", True), (COMPLETIONS, "prompt_logprobs", "1"), (CHAT, "top_logprobs", "2"),
    (CHAT, "max_completion_tokens", "3"), (CHAT, "max_completion_tokens", True),
])
def test_endpoint_specific_integers_refuse_booleans_and_strings(served: Served, path: str, name: str,
                                                                 value: Any) -> None:
    extra = {"logprobs": True} if name == "top_logprobs" else {}
    body = (_completion if path == COMPLETIONS else _chat)(**{name: value, **extra})
    _refused(_post(served, path, body), name, name)


@pytest.mark.parametrize("value", ["1", True])
def test_a_logit_bias_value_refuses_booleans_and_strings(served: Served, value: Any) -> None:
    _refused(_post(served, COMPLETIONS, _completion(logit_bias={"5": value})), "logit_bias", "logit_bias.5")


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"prompt": "hi", "add_special_tokens": 1}),
    ("/detokenize", {"tokens": ["104"]}),
    ("/detokenize", {"tokens": [True]}),
])
def test_tokenize_fields_refuse_other_types(served: Served, path: str, body: dict[str, Any]) -> None:
    _refused(_post(served, path, {"model": MODEL, **body}), next(iter(body.keys() - {"prompt"})))


def test_integral_numbers_are_still_numbers(served: Served) -> None:
    """A JSON integer is a number: ``temperature: 1`` is 1.0, as OpenAI's clients send it."""
    body = _completion(temperature=1, top_p=1, presence_penalty=0, n=2, max_tokens=2)
    response = _post(served, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, _completion(n=None, stream=None, echo=None, max_tokens=2)),
    (CHAT, _chat(n=None, stream=None, logprobs=None, max_tokens=2)),
], ids=["completions", "chat"])
def test_an_explicit_null_of_a_nullable_field_is_its_default(served: Served, path: str, body: dict[str, Any]) -> None:
    """OpenAI declares n, stream, echo and chat's logprobs nullable: a client that sends its whole request
    type, nulls for what it leaves unset, got a 400 for a request OpenAI serves."""
    response = _post(served, path, body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 1 and choices[0].get("logprobs") is None


def test_an_integer_of_thousands_of_digits_is_a_400_that_says_so(served: Served) -> None:
    """Python refuses integer literals past 4300 digits with a ValueError, which FastAPI answered "There was
    an error parsing the body"."""
    body = json.dumps(_completion()).replace("\"max_tokens\": 3", "\"max_tokens\": " + "9" * 5000)
    assert '"max_tokens": 999' in body
    response = httpx.post(served.url + COMPLETIONS, content=body.encode(), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "integer of more digits than this server reads" in response.json()["error"]["message"]


# --- 2: logit_bias keys ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["01", "007", "00"])
def test_a_logit_bias_key_with_leading_zeros_is_refused(served: Served, key: str) -> None:
    """``{"1": 100, "01": -100}`` named token 1 twice and kept only the last bias. Keys are token ids
    in their one decimal spelling, so two keys can never name the same token."""
    response = _post(served, COMPLETIONS, _completion(logit_bias={"1": 100, key: -100}))
    _refused(response, "logit_bias", repr(key), str(int(key)), "leading zeros")


@pytest.mark.parametrize("value", [float("nan"), None])
def test_a_bad_logit_bias_value_names_its_key(served: Served, value: Any) -> None:
    _refused(_post(served, COMPLETIONS, _completion(logit_bias={"50": 1, "1234": value})), "logit_bias",
             "logit_bias.1234")


def test_a_canonical_logit_bias_is_accepted(served: Served) -> None:
    assert _post(served, COMPLETIONS, _completion(logit_bias={"0": 1, "1234": -1})).status_code == 200


# --- 3: chat's max_tokens and max_completion_tokens -----------------------------------------


def test_max_tokens_and_max_completion_tokens_that_differ_are_refused(served: Served) -> None:
    """The one not used was ignored, not even range-checked."""
    response = _post(served, CHAT, _chat(max_tokens=99999, max_completion_tokens=3))
    _refused(response, "max_completion_tokens", "max_tokens=99999", "max_completion_tokens=3")


def test_equal_max_tokens_and_max_completion_tokens_are_accepted(served: Served) -> None:
    response = _post(served, CHAT, _chat(max_tokens=2, max_completion_tokens=2))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text


@pytest.mark.parametrize("value", [0, -1])
def test_a_bad_max_completion_tokens_is_named_as_sent(served: Served, value: int) -> None:
    body = _chat(max_completion_tokens=value)
    del body["max_tokens"]
    error = _refused(_post(served, CHAT, body), "max_completion_tokens", "max_completion_tokens")
    assert "max_tokens" not in error["message"].replace("max_completion_tokens", "")


# --- 4: content [] ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_an_empty_list_of_content_parts_is_refused(served: Served, path: str) -> None:
    """Rendered as an empty turn, as ``content: null`` would be, which is refused for that reason."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": []}]
    body = {"model": MODEL, "messages": messages, **({"max_tokens": 3} if path == CHAT else {})}
    _refused(_post(served, path, body), "messages", "messages.1", "content")


# --- 5: top_logprobs --------------------------------------------------------------------------


@pytest.mark.parametrize("value", [25, -1])
def test_top_logprobs_out_of_range_is_named_as_sent(served: Served, value: int) -> None:
    error = _refused(_post(served, CHAT, _chat(logprobs=True, top_logprobs=value)), "top_logprobs", "top_logprobs",
                     "20")
    assert "SamplingParams.logprobs" not in error["message"]


# --- 6: nesting too deep for a chat template --------------------------------------------------


def _tools(parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("depth", [MAX_SCHEMA_DEPTH + 1, 500, 900])
@pytest.mark.parametrize("choice", ["none", "required"])
def test_tool_parameters_nested_too_deep_are_refused(served: Served, depth: int, choice: str) -> None:
    """A 500 from the template's recursion ("none"), or from rendering before the schema's depth was
    checked ("required")."""
    response = _post(served, CHAT, _chat(tools=_tools(_nested(depth)), tool_choice=choice))
    _refused(response, "tools", "tools.0.function.parameters", str(MAX_SCHEMA_DEPTH))


def test_tool_parameters_at_the_depth_limit_are_accepted(served: Served) -> None:
    response = _post(served, CHAT, _chat(tools=_tools(_nested(MAX_SCHEMA_DEPTH)), tool_choice="none"))
    assert response.status_code == 200, response.text


def _with_call_arguments(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
@pytest.mark.parametrize("depth", [MAX_SCHEMA_DEPTH + 1, 2000])
def test_tool_call_arguments_nested_too_deep_are_refused(served: Served, path: str, depth: int) -> None:
    arguments = "[" * depth + "]" * depth
    body = {"model": MODEL, "messages": _with_call_arguments(arguments)}
    _refused(_post(served, path, body), "messages", "messages.1.tool_calls.0.function.arguments",
             str(MAX_SCHEMA_DEPTH))


def test_a_template_that_overflows_the_stack_is_a_400(served: Served) -> None:
    """The last guard: whatever else makes a template recurse too deeply is the conversation's fault."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": RECURSE}]}
    _refused(_post(served, CHAT, body), "messages", "nest")


# --- 7: /tokenize and /detokenize behind the API key -----------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"model": MODEL, "prompt": "hi"}), ("/detokenize", {"model": MODEL, "tokens": [104]}),
])
def test_tokenize_and_detokenize_need_the_api_key(keyed: Served, path: str, body: dict[str, Any]) -> None:
    """They share the tokenizer threads with /v1: without a key anyone could stall the tenants' requests."""
    response = _post(keyed, path, body)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", response.text
    assert _post(keyed, path, body, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200


# --- 8: errors that did not say what to fix -------------------------------------------------


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"}, {}], ids=["text/plain", "none"])
@pytest.mark.parametrize("path", [COMPLETIONS, "/tokenize"])
def test_a_body_not_sent_as_json_says_so(served: Served, path: str, headers: dict[str, str]) -> None:
    content = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    response = httpx.post(served.url + path, content=content, headers=headers, timeout=60)
    _refused(response, None, "JSON object", "Content-Type: application/json")


def test_a_form_body_says_it_must_be_json(served: Served) -> None:
    response = httpx.post(served.url + COMPLETIONS, data={"model": MODEL, "prompt": "hi"}, timeout=60)
    _refused(response, None, "JSON object", "Content-Type: application/json", "application/x-www-form-urlencoded")


def test_a_json_body_that_is_not_an_object_says_so(served: Served) -> None:
    _refused(_post(served, COMPLETIONS, [1, 2]), None, "JSON object")


def test_tokenize_names_the_field_that_is_wrong(served: Served) -> None:
    """The request is a prompt or a conversation: an error in a prompt request is not "messages: Field required"."""
    error = _refused(_post(served, "/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": "no"}),
                     "add_special_tokens", "add_special_tokens")
    assert "messages" not in error["message"]


@pytest.mark.parametrize("body", [{}, {"model": MODEL}, {"model": MODEL, "prompt": "a", "messages": []}])
def test_tokenize_without_one_of_prompt_and_messages_says_so(served: Served, body: dict[str, Any]) -> None:
    error = _refused(_post(served, "/tokenize", body), None, "prompt", "messages")
    assert "function-" not in error["message"]


def test_priority_is_bounded_as_the_engine_bounds_it(served: Served) -> None:
    """2**31 passed the request model and was refused later by the engine (int32)."""
    _refused(_post(served, CHAT, _chat(priority=2**31)), "priority", "priority", str(2**31 - 1))
    _refused(_post(served, CHAT, _chat(priority=-(2**31) - 1)), "priority", "priority", str(-(2**31)))
    for priority in (2**31 - 1, -(2**31)):
        assert _post(served, CHAT, _chat(priority=priority)).status_code == 200


def test_an_unknown_pin_field_is_named(make_module_served: Callable[..., Served]) -> None:
    admin = make_module_served(FakeEngine(), options=ServerOptions(api_key=KEY))
    response = _post(admin, "/v1/cache/pin", {"prompt": "hi", "banana": 1}, {"Authorization": f"Bearer {KEY}"})
    _refused(response, "banana", "banana is not a field this server knows", "a pin takes prompt, messages, ttl_s")
