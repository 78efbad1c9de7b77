"""Token-level helpers for responses: token strings for logprobs and chat prompt rendering."""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from pagedrs.sampling_params import MAX_SCHEMA_DEPTH, json_depth
from pagedrs.server.errors import APIError, bad_request
from pagedrs.server.protocol import ChatMessage


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of ``token_piece``."""
    return token_piece(tokenizer, token_id)[0]


def token_piece(tokenizer: Any, token_id: int) -> tuple[str, bytes | None]:
    """One token as logprobs show it, special tokens included (OpenAI lists them too): its text
    and its raw bytes (``Tokenizer.token_bytes``; the bytes of an output's tokens end to end are
    its text's UTF-8, a multi-byte character split across tokens included).

    The text is the bytes as UTF-8 where they are whole characters; a token that is part of
    a character (an emoji's or a CJK character's first bytes) shows as "bytes:" and its bytes
    escaped, "bytes:\\xe6\\x88", as OpenAI's legacy completions show it, never as U+FFFD, which
    would hide which bytes it has. The bytes are None where the tokenizer cannot say: then
    the text is a decode of the token alone (may have U+FFFD). A tokenizer without
    ``token_bytes`` (a test's fake) gets that decode's UTF-8 when it has no U+FFFD, else None.
    """
    read = getattr(tokenizer, "token_bytes", None)
    if read is None:
        text = str(tokenizer.decode([token_id], skip_special_tokens=False))
        return text, (None if "\ufffd" in text else text.encode())
    raw: bytes | None = read(token_id)
    if raw is None:
        return str(tokenizer.decode([token_id], skip_special_tokens=False)), None
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def top_logprobs(tokenizer: Any, entry: dict[int, float], k: int) -> list[tuple[str, bytes | None, float]]:
    """The k most likely tokens of one position (``token_piece``'s text and bytes, and logprob),
    most likely first (ties by token id, for determinism)."""
    ranked = sorted(entry.items(), key=lambda item: (-item[1], item[0]))[:k]
    return [(*token_piece(tokenizer, token_id), logprob) for token_id, logprob in ranked]


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The conversation through the model's chat template, as prompt token ids.

    The template is given each message's role and content (its text parts joined), an
    assistant's ``tool_calls``, a tool message's ``tool_call_id``, and the request's ``tools``
    when it has some (transformers' ``apply_chat_template(tools=...)``); every other message
    field is refused by the request model, so nothing a client sent is lost here.

    Many templates render neither tools nor tool calls (SmolLM2's, Llama 2's): they would be
    dropped, the model never told of the functions or of the calls it made, and the answer a
    200 all the same. So whether the template renders them is tried, not guessed from its text:
    the prompt is rendered once more without the tools, and once more without each message's
    calls; the same ids mean the template left them out, a 400 naming ``tools`` or
    ``messages.N.tool_calls``. This holds for every ``tool_choice``, a forced one included: its
    grammar makes the answer a call that fits a schema, but what the function is for (its
    description, even its name) reaches the model only through the prompt; a client that wants
    the schema alone says so with ``response_format`` ``json_schema``.
    """
    if not messages:
        raise bad_request("messages is empty: send at least one message", param="messages")
    plain = [_for_template(i, m) for i, m in enumerate(messages)]
    ids = _render(tokenizer, plain, add_generation_prompt, tools)
    _check_rendered(tokenizer, plain, add_generation_prompt, tools, ids)
    return ids


def _check_rendered(tokenizer: Any, plain: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None, ids: list[int]) -> None:
    """400 when leaving the tools, or one message's calls, out gives the same prompt ``ids``
    (one render more for the tools and per message with calls, on the tokenizer threads)."""
    if tools and _render_or_none(tokenizer, plain, add_generation_prompt, None) == ids:
        raise bad_request(NOT_RENDERED.format(what="tools", field="tools", lost="the functions it may call")
                          + '; or send no tools: for an answer that only follows a schema, send response_format '
                          '{"type": "json_schema", ...} instead', param="tools")
    for i, message in enumerate(plain):
        if "tool_calls" in message:
            without = [*plain[:i], {k: v for k, v in message.items() if k != "tool_calls"}, *plain[i + 1:]]
            if _render_or_none(tokenizer, without, add_generation_prompt, tools) == ids:
                field = f"messages.{i}.tool_calls"
                raise bad_request(NOT_RENDERED.format(what="an assistant message's tool_calls", field=field,
                                                      lost="the calls it made"), param=field)


NOT_RENDERED = ("{field}: this model's chat template does not render {what} (the prompt is the same without "
                "them), so the model would never see {lost}. Serve a model whose chat template renders them (the "
                "template is the model's own, chat_template.jinja or tokenizer_config.json's chat_template in its "
                "folder; pagedrs serve has no --chat-template option)")


def _render(tokenizer: Any, plain: list[dict[str, Any]], add_generation_prompt: bool,
            tools: list[dict[str, Any]] | None) -> list[int]:
    extra = {"tools": tools} if tools else {}
    try:
        return list(tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra))
    except (ValueError, TemplateError) as exc:  # no chat template, or the template rejected the conversation
        raise bad_request(str(exc), param="messages") from exc
    except RecursionError:  # the last guard: the request model bounds the nesting it knows of
        raise bad_request("the chat template recursed too deeply on this conversation: its messages or tools "
                          "nest too deeply to render", param="messages") from None


def _render_or_none(tokenizer: Any, plain: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None) -> list[int] | None:
    """``_render`` of the conversation with something left out; None where the template refuses it
    (then what was left out mattered to it)."""
    try:
        return _render(tokenizer, plain, add_generation_prompt, tools)
    except APIError:
        return None


def _for_template(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: role and content; an assistant's tool calls with their
    arguments as an object (transformers' convention); a tool message's ``tool_call_id``."""
    plain: dict[str, Any] = {"role": message.role, "content": _content_text(message)}
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        calls = []
        for j, call in enumerate(message.tool_calls):
            arguments = _arguments(f"messages.{index}.tool_calls.{j}.function.arguments", call.function.arguments)
            calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
        plain["tool_calls"] = calls
    return plain


def _arguments(field: str, text: str) -> Any:
    """A call's arguments parsed, for the template; 400 naming ``field`` when they are not JSON or
    nest deeper than a tool's schema may (the template recurses through them: a deep value would
    overflow its stack)."""
    too_deep = f"{field} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; allowed at most " \
        f"{MAX_SCHEMA_DEPTH}"
    try:
        arguments = json.loads(text)
    except RecursionError:
        raise bad_request(too_deep, param="messages") from None
    except ValueError as exc:
        raise bad_request(f"{field} is not JSON: {exc}", param="messages") from None
    if json_depth(arguments) > MAX_SCHEMA_DEPTH:
        raise bad_request(too_deep, param="messages")
    return arguments


def _content_text(message: ChatMessage) -> str:
    """Message content as text: a string, or the concatenation of its text parts (the only kind accepted)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)
