"""The OpenAI-shaped response bodies the server sends: completions, chat completions and their
stream chunks, usage, logprobs, tool calls, and the model list.

The request side (what a client may send, and how each field is validated or refused) is
``server/protocol.py``; these are plain output models, built by the server only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class CachedTokensByTier(BaseModel):
    """A pagedrs extension of OpenAI's usage: where the cached prompt tokens were found. A host
    or disk hit was copied back to the device instead of recomputed; the three add up to
    ``cached_tokens``."""

    device: int = 0
    host: int = 0
    disk: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V the engine reused from its prefix cache
    cached_tokens_by_tier: CachedTokensByTier = Field(default_factory=CachedTokensByTier)  # pagedrs extension


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           cached_by_tier: dict[str, int] | None = None) -> Usage:
        """``cached_by_tier``: {"device", "host", "disk"} tokens (None: all zero)."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=cached_tokens, cached_tokens_by_tier=CachedTokensByTier(**(cached_by_tier or {}))),
        )


def _unset(value: Any) -> bool:
    return value is None


# The client's X-Request-Id, as given, in the first event of a stream (absent otherwise).
FirstEventRequestId = Annotated[str | None, Field(default=None, exclude_if=_unset)]
# vLLM's ``return_token_ids``: token ids beside the text, absent unless the request asked for them.
TokenIds = Annotated[list[int] | None, Field(default=None, exclude_if=_unset)]


class CompletionLogprobs(BaseModel):
    """The legacy completions layout: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's log-probability at one prompt position."""

    logprob: float
    rank: int | None = None  # 1-based among the top alternatives; None: the prompt token, outside them
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's prompt_logprobs (asked for with prompt_logprobs=k): per prompt token, token id -> its Logprob;
    # the first token's entry null
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: TokenIds = None  # return_token_ids: the prompt as the engine saw it (a stream: first chunk)
    token_ids: TokenIds = None  # return_token_ids: the generated ids (a stream: this chunk's), stop tokens included


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    request_id: FirstEventRequestId = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds = None  # return_token_ids: the generated ids, stop tokens included


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: TokenIds = None  # return_token_ids: the rendered conversation's ids


class FunctionCallDelta(BaseModel):
    """A stream's tool-call chunks carry only what they add: the fields left out are absent, not null."""

    name: str | None = Field(default=None, exclude_if=_unset)  # the call's first chunk only
    arguments: str | None = Field(default=None, exclude_if=_unset)  # the next piece of the JSON text


class ToolCallDelta(BaseModel):
    """One chunk of one call: the first has ``id``, ``type``, ``function.name`` and ``arguments: ""``,
    the next ones ``index`` and pieces of ``function.arguments`` (a client joins them by ``index``)."""

    index: int  # which call of the message
    id: str | None = Field(default=None, exclude_if=_unset)
    type: Literal["function"] | None = Field(default=None, exclude_if=_unset)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds = None  # return_token_ids: the ids this chunk adds


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    request_id: FirstEventRequestId = None
    prompt_token_ids: TokenIds = None  # return_token_ids: the stream's first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedrs"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
