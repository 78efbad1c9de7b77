"""POST /tokenize and /detokenize (vLLM's shapes): counts, chat templates, special tokens, and
bad input as 400s naming the field; the fake engine's tokenizer is one token per character."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

pytest.importorskip("pagedrs._core")

from server_fakes import MODEL, FakeEngine, Served, served_factory  # noqa: E402


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    """As a client sends it: JSON with ASCII escapes (a lone surrogate travels as its \\u escape)."""
    return httpx.post(served.url + path, content=json.dumps(body).encode(), timeout=30,
                      headers={"content-type": "application/json"})


def test_tokenize_a_prompt_and_a_conversation_and_back(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(max_model_len=64))
    got = _post(served, "/tokenize", {"model": MODEL, "prompt": "héllo"}).json()
    assert got == {"count": 5, "max_model_len": 64, "tokens": [ord(c) for c in "héllo"]}
    chat = _post(served, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == [ord(c) for c in "<user>hi<assistant>"] and chat["count"] == len(chat["tokens"])
    bare = _post(served, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "add_generation_prompt": False}).json()
    assert bare["tokens"] == [ord(c) for c in "<user>hi"]
    back = _post(served, "/detokenize", {"model": MODEL, "tokens": got["tokens"]}).json()
    assert back == {"prompt": "héllo"}


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/detokenize", {"tokens": [104, -1]}, "tokens", "tokens[1] is -1"),
    ("/detokenize", {"tokens": [0x110000]}, "tokens", "tokens[0] is 1114112"),
    ("/detokenize", {"tokens": ["a"]}, "tokens", ""),
    ("/tokenize", {"prompt": "x" * 10**6}, "prompt", "characters"),
    ("/tokenize", {"prompt": "a\ud800"}, "prompt", "lone surrogate"),  # was a 500 from the tokenizer
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens", ""),
    ("/tokenize", {"prompt": "hi", "temperature": 1.0}, "temperature", ""),
])
def test_bad_input_is_a_400_naming_the_field(make_served: Callable[..., Served], path: str, body: dict,
                                             param: str, says: str) -> None:
    served = make_served(FakeEngine(max_model_len=64))
    response = _post(served, path, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"] and says in error["message"]
    assert _post(served, "/tokenize", {"model": MODEL, "prompt": "ok"}).json()["count"] == 2  # still serving


def test_an_unknown_model_is_a_404(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine())
    response = _post(served, "/tokenize", {"model": "other", "prompt": "hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
