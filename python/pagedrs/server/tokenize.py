"""POST /tokenize and /detokenize, in vLLM's shapes: what the server's tokenizer makes of a text
or a conversation, and back.

Clients use them to count a prompt against ``max_model_len`` before sending it, and to see what
a chat template renders. Both run on the server's tokenizer threads (``PromptTokenizer``), with
its character bound, so a huge text is refused before it is tokenized. ``/detokenize`` checks
every id against the vocabulary: an id out of range is a 400 naming it, not a garbled string.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, Discriminator, Field, StrictBool, StrictInt, Tag

from pagedrs.server.errors import bad_request
from pagedrs.server.protocol import ChatMessage, Text, _Strict
from pagedrs.server.serving import ServerContext

__all__ = ["DetokenizeRequest", "TokenizeChatRequest", "TokenizeCompletionRequest", "detokenize", "tokenize"]

MAX_DETOKENIZE_TOKENS = 1 << 20  # ids in one /detokenize request (a bound on the work, not a context)


class TokenizeCompletionRequest(_Strict):
    model: str
    prompt: Text
    add_special_tokens: StrictBool = True


class TokenizeChatRequest(_Strict):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True


def _kind(body: Any) -> str | None:
    """Which request a body is, by the one of ``prompt`` and ``messages`` it has (None: neither, or
    both). Tried as a plain union, a prompt request with a bad field also failed as a conversation,
    and its error began "messages: Field required"."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        return None
    return "prompt-request" if "prompt" in body else "messages-request"  # tags no field name can be


TokenizeRequest = Annotated[
    Union[Annotated[TokenizeCompletionRequest, Tag("prompt-request")],
          Annotated[TokenizeChatRequest, Tag("messages-request")]],
    Discriminator(_kind, custom_error_type="prompt_or_messages",
                  custom_error_message="the body needs exactly one of prompt (a text to tokenize) and messages "
                  "(a conversation to render with the chat template)"),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(ctx: ServerContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = await ctx.prompts.render_chat(body.messages, body.add_generation_prompt)
    else:
        ids = await ctx.prompts.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)


async def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    for position, token in enumerate(body.tokens):
        if not 0 <= token < ctx.vocab_size:
            raise bad_request(f"tokens[{position}] is {token}: token ids must be in [0, {ctx.vocab_size})",
                              param="tokens")
    text = await ctx.prompts.decode(body.tokens)
    return DetokenizeResponse(prompt=text)
