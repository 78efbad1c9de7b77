"""``tools`` and an assistant's ``tool_calls`` reach the model only through the chat template: one
that does not render them makes the request a 400 naming the field (server/tokens.py), whatever
the tool_choice, never a 200 whose prompt silently lacks them. Over the fake engine, with a
tokenizer whose template renders neither, and over a real tokenizer with the tiny test template."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest import make_tiny_tokenizer  # noqa: E402
from pagedrs.server.errors import APIError  # noqa: E402
from pagedrs.server.options import ServerOptions  # noqa: E402
from pagedrs.server.protocol import ChatMessage  # noqa: E402
from pagedrs.server.tokens import render_chat  # noqa: E402
from pagedrs.tokenizer import Tokenizer  # noqa: E402
from server_fakes import MODEL, FakeEngine, FakeTokenizer, Served, served_factory  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


class PlainTokenizer(FakeTokenizer):
    """A template of role and content only (as SmolLM2's): tools and tool calls are not rendered."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


def _engine(tokenizer: FakeTokenizer) -> FakeEngine:
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer = tokenizer
    return engine


@pytest.fixture
def plain(make_served: Callable[..., Served]) -> Served:
    return make_served(_engine(PlainTokenizer()), options=ServerOptions(tool_call_parser="hermes"))


@pytest.fixture
def rendering(make_served: Callable[..., Served]) -> Served:
    return make_served(_engine(FakeTokenizer()), options=ServerOptions(tool_call_parser="hermes"))


def _post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    extra = {"max_tokens": 4} if path.startswith("/v1") else {}
    return httpx.post(served.url + path, json={"model": MODEL, **extra, **body}, timeout=60)


CHOICES: dict[str, Any] = {"none": "none", "auto": "auto", "required": "required", "unset": None,
                           "named": {"type": "function", "function": {"name": "get_weather"}}}


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_tools_the_template_does_not_render_are_a_400_naming_tools(plain: Served, rendering: Served,
                                                                   choice: str) -> None:
    """A forced call too: its grammar fits the schema, but what the function is for reaches the model
    only through the prompt."""
    body: dict[str, Any] = {"messages": [USER], "tools": TOOLS}
    if CHOICES[choice] is not None:
        body["tool_choice"] = CHOICES[choice]
    added = len(plain.engine.added)
    r = _post(plain, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools", error
    assert error["message"].startswith("tools: this model's chat template does not render tools"), error
    assert "Serve a model whose chat template renders them" in error["message"] and "json_schema" in error["message"]
    assert len(plain.engine.added) == added  # nothing reached the engine
    assert _post(rendering, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_tool_calls_the_template_does_not_render_are_a_400_naming_the_message(plain: Served, rendering: Served,
                                                                             path: str) -> None:
    r = _post(plain, path, {"messages": HISTORY})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.1.tool_calls", error
    assert "does not render an assistant message's tool_calls" in error["message"], error
    assert _post(rendering, path, {"messages": HISTORY}).status_code == 200
    assert _post(plain, path, {"messages": [USER]}).status_code == 200  # no tools, no calls: served as before


def test_a_real_template_without_tools_is_refused_and_one_with_them_is_not(tmp_path: Path) -> None:
    """The tiny test tokenizer's template (role and content, as SmolLM2's), then one that renders both."""
    hf = make_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer(hf)
    messages = [ChatMessage.model_validate(m) for m in HISTORY]
    with pytest.raises(APIError) as caught:
        render_chat(tokenizer, messages[:1], True, TOOLS)
    assert caught.value.param == "tools"
    with pytest.raises(APIError) as caught:
        render_chat(tokenizer, messages, True)
    assert caught.value.param == "messages.1.tool_calls"
    hf.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids = render_chat(tokenizer, messages, True, TOOLS)
    assert "[get_weather]" in hf.decode(ids) and "<call>get_weather</call>" in hf.decode(ids)
