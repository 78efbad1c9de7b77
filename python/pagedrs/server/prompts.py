"""Prompts to token ids, on a small pool of worker threads, with the cheap length checks first.

Tokenizing a large text takes long enough to matter: on the event loop it stalls
every connection (``/health`` included), on the engine thread every generation.
So the server tokenizes text prompts and chat conversations itself, on
``tokenizer_threads`` worker threads, and hands the engine token ids only.

Before tokenizing, a text that cannot fit the context whatever it tokenizes to is
refused. No token covers more characters than ``chars_per_token`` (the larger of
64 and 4 x the longest vocabulary entry; the factor 4 leaves room for normalizers
that merge characters), so a text longer than ``max_model_len * chars_per_token``
characters has more than ``max_model_len`` tokens. Characters >= tokens does not
hold in general (a byte-level BPE may spend several tokens on one character), which
is why the rule is this direction only; the exact check runs on the token ids.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedrs.server.errors import bad_request
from pagedrs.server.options import MIN_CHARS_PER_TOKEN_BOUND
from pagedrs.server.protocol import ChatMessage
from pagedrs.server.tokens import render_chat
from pagedrs.tokenizer import TokenIdsOnly

T = TypeVar("T")


def chars_per_token_bound(tokenizer: Any) -> int:
    """An upper bound on the characters one token of ``tokenizer`` stands for (see the module docstring)."""
    hf = getattr(tokenizer, "hf", None)
    vocab = hf.get_vocab() if hf is not None and hasattr(hf, "get_vocab") else {}
    longest = max((len(token) for token in vocab), default=0)
    return max(MIN_CHARS_PER_TOKEN_BOUND, 4 * longest)


class PromptTokenizer:
    """Tokenizes on its own threads; one per app."""

    def __init__(self, tokenizer: Any, max_model_len: int, threads: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * chars_per_token_bound(tokenizer)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedrs-tokenize")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self._check_has_tokenizer("a text prompt", param)
        self._check_chars(len(text), param)
        if add_special_tokens:
            return await self._run(self.tokenizer.encode, text)
        return await self._run(functools.partial(self.tokenizer.encode, add_special_tokens=False), text)

    async def decode(self, ids: list[int]) -> str:
        """Token ids to text (special tokens kept: what the ids are), off the event loop."""
        self._check_has_tokenizer("detokenizing", "tokens")
        return await self._run(functools.partial(self.tokenizer.decode, skip_special_tokens=False), ids)

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        self._check_has_tokenizer("a chat conversation", "messages")
        chars = sum(_content_chars(m) for m in messages)
        self._check_chars(chars, "messages")
        return await self._run(render_chat, self.tokenizer, messages, add_generation_prompt, tools)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_has_tokenizer(self, what: str, param: str) -> None:
        if isinstance(self.tokenizer, TokenIdsOnly):
            raise bad_request(str(TokenIdsOnly.refuse(what)), param=param)

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise bad_request(
                f"The {param} has {chars} characters, more than the context can hold whatever they tokenize to: "
                f"max_model_len is {self.max_model_len} tokens, and a token of this tokenizer covers at most "
                f"{self.max_chars // self.max_model_len} characters",
                param=param,
            )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))


def _content_chars(message: ChatMessage) -> int:
    content = message.content
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content)
