"""The block hashes of a request's prompt, computed at the ingress as a replica will.

The server renders a request to token ids (``completions.prepare`` / ``chat.prepare``);
this does the part routing needs with the same pieces (the protocol's models, the same
tokenizer, ``tokens.render_chat``, ``tenants.engine_salt``) and hashes full blocks with
the engine's own chain (``pagedrs._core.prompt_block_hashes``). A body that does not
parse gets no key (``[]``: routed by load alone); the replica then answers it with the
server's own 400, so nothing here decides what is valid.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pagedrs._core import prompt_block_hashes
from pagedrs.ray.replica import ReplicaInfo

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def prompt_ids(path: str, body: dict[str, Any], tokenizer: Any) -> Optional[list[int]]:
    """The first prompt's token ids, or None when the body names none the router can read."""
    from pagedrs.server.protocol import ChatCompletionRequest, CompletionRequest
    from pagedrs.server.tokens import render_chat

    if path == CHAT_PATH:
        chat = ChatCompletionRequest.model_validate(body)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        return list(render_chat(tokenizer, chat.messages, chat.add_generation_prompt, tools))
    if path == COMPLETIONS_PATH:
        prompt: Any = CompletionRequest.model_validate(body).prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: the first one's route
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        return [int(t) for t in prompt] if isinstance(prompt, list) else None
    return None


# Token id -> one character for Ray's text router: past the BMP's surrogates, every id of a
# vocabulary below ~1.05 million has its own code point.
_TEXT_BASE = 0x10000


def route_text(ids: list[int]) -> str:
    """The prompt's token ids as one character each: what ``routing="ray-prefix"`` matches."""
    return "".join(chr(_TEXT_BASE + t) for t in ids if 0 <= t < 0x10FFFF - _TEXT_BASE)


def route_of(path: str, raw_body: bytes, tenant: Optional[str], info: ReplicaInfo) -> list[int]:
    """The prompt's block hashes under the salt the replica will use; [] when there is none.
    ``tenant``: the caller's, as the server's Gate found it from the API key (None: no key)."""
    return route_and_text(path, raw_body, tenant, info, text=False)[0]


def route_and_text(path: str, raw_body: bytes, tenant: Optional[str], info: ReplicaInfo,
                   text: bool) -> tuple[list[int], str]:
    """``route_of`` and, when ``text``, the prompt as ``route_text`` (one tokenization for both)."""
    from pagedrs.server.tenants import engine_salt

    if not info.enable_prefix_caching:
        return [], ""
    try:
        body = json.loads(raw_body)
        if not isinstance(body, dict):
            return [], ""
        ids = prompt_ids(path, body, info.tokenizer)
        if not ids:
            return [], ""
        if info.prefix_cache_isolation == "per-tenant" and tenant is None:
            return [], ""  # no tenant: the Gate answers 401 before anything is routed
        words = route_text(ids) if text else ""
        client_salt = body.get("cache_salt")
        salt = engine_salt(info.prefix_cache_isolation, tenant, client_salt if isinstance(client_salt, str) else None)
        return prompt_block_hashes(ids, info.block_size, None if salt is None else salt.encode("utf-8")), words
    except (ValueError, TypeError, KeyError, OverflowError):  # pydantic's ValidationError is a ValueError
        return [], ""
