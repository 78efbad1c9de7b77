"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedrs.server.deltas import SampleDelta
from pagedrs.server.errors import bad_request
from pagedrs.server.protocol import ChatCompletionRequest, now_s, random_id
from pagedrs.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from pagedrs.server.serving import (
    Generation,
    ServerContext,
    check_stream_options,
    event_stream,
    refuse_unstreamable,
    sse,
)
from pagedrs.server.structured import checked, structured_outputs
from pagedrs.server.tokens import token_text, top_logprobs
from pagedrs.server.tools import tool_calls, tool_constraint


async def prepare(ctx: ServerContext, body: ChatCompletionRequest) -> Generation:
    """Check the request, render the conversation and build its engine request (not yet submitted)."""
    ctx.check_model(body.model)
    check_stream_options(body)
    ctx.check_fanout(1, body.n, body.best_of)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    schema, forced = tool_constraint(body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt_ids = await ctx.prompts.render_chat(body.messages, body.add_generation_prompt, tools)
    room = ctx.room(len(prompt_ids), "messages")
    kwargs = body.sampling_kwargs()
    if body.max_completion_tokens is not None:
        kwargs["max_tokens"] = body.max_completion_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    ctx.check_max_tokens(kwargs.get("max_tokens"), room, len(prompt_ids), name)
    if "max_tokens" not in kwargs:
        # Unset: until the context is full, as OpenAI does for chat, but never more than the
        # KV pool can hold next to the prompt (the engine refuses a request that can never fit).
        kwargs["max_tokens"] = max(1, min(room, ctx.kv_pool_tokens - len(prompt_ids)))
    if body.logprobs:
        kwargs["logprobs"] = body.top_logprobs or 0
    kwargs["structured_outputs"] = await structured_outputs(body)
    if forced is not None:
        if kwargs["structured_outputs"] is not None:
            raise bad_request("a forced tool call is already a structured output: send tool_choice or "
                              "response_format / structured_outputs / guided_*, not both", param="tool_choice")
        kwargs["structured_outputs"] = await checked("tools", "json", schema)
    params = ctx.make_params(kwargs)
    refuse_unstreamable(body.stream, params)
    gen = Generation(ctx, [prompt_ids], params, priority=body.priority, cache_salt=body.cache_salt)
    gen.forced_call = forced
    return gen


def _logprobs(ctx: ServerContext, k: int, token_ids: list[int], entries: list[dict[int, float]]) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(ctx.tokenizer, token_id)
        top = [
            TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
            for t, lp in top_logprobs(ctx.tokenizer, entry, k)
        ]
        logprob = entry.get(token_id, float("-inf"))
        content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


async def complete(ctx: ServerContext, body: ChatCompletionRequest, gen: Generation) -> ChatCompletionResponse:
    """Run a submitted non-streaming request to the end."""
    states = await gen.collect()
    k = body.top_logprobs or 0
    choices = []
    for index, state in states.items():
        message, reason = ChatResponseMessage(content="".join(state.text)), state.finish_reason
        calls = tool_calls(gen.forced_call, message.content or "") if gen.forced_call and reason == "stop" else None
        if calls is not None:
            message = ChatResponseMessage(content=None, tool_calls=[ToolCall.model_validate(c) for c in calls])
            reason = "tool_calls"
        choices.append(ChatChoice(
            index=index,
            message=message,
            logprobs=_logprobs(ctx, k, state.token_ids, state.logprobs) if body.logprobs else None,
            finish_reason=reason,
            stop_reason=state.stop_reason,
        ))
    completion_tokens = sum(len(s.token_ids) for s in states.values())
    return ChatCompletionResponse(
        id=random_id("chatcmpl"), created=now_s(), model=ctx.model_name, choices=choices,
        usage=gen.usage(completion_tokens),
    )


def stream(ctx: ServerContext, body: ChatCompletionRequest, gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: a role chunk per choice, content chunks, usage if asked, [DONE]."""
    response_id, created, first_id = random_id("chatcmpl"), now_s(), gen.first_event_id()

    def event(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(id=response_id, created=created, model=ctx.model_name, choices=choices,
                                    usage=usage, request_id=first_id.take())
        return sse(chunk.model_dump_json())

    k = body.top_logprobs or 0

    def render(index: int, sample: SampleDelta) -> str:
        logprobs = _logprobs(ctx, k, sample.token_ids, sample.logprobs or []) if body.logprobs else None
        return event([ChatChunkChoice(index=index, delta=ChatDelta(content=sample.text or None), logprobs=logprobs,
                                      finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)])

    held: dict[int, tuple[list[str], list[int], list[dict[int, float]]]] = {}  # choice -> text, tokens, logprobs

    def render_forced(index: int, sample: SampleDelta) -> str:
        """A forced tool call is held until it is complete, then sent as one ``delta.tool_calls``
        chunk (a call cut by max_tokens: as text)."""
        text, token_ids, entries = held.setdefault(index, ([], [], []))
        text.append(sample.text)
        token_ids += sample.token_ids
        entries += sample.logprobs or []
        if sample.finish_reason is None:
            return ""
        del held[index]
        whole = SampleDelta(sample.index, "".join(text), token_ids, entries if body.logprobs else None,
                            sample.finish_reason, sample.stop_reason)
        calls = tool_calls(gen.forced_call, whole.text) if sample.finish_reason == "stop" else None
        if calls is None:
            return render(index, whole)
        logprobs = _logprobs(ctx, k, token_ids, entries) if body.logprobs else None
        deltas = [ToolCallDelta(index=i, **call) for i, call in enumerate(calls)]
        return event([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=deltas), logprobs=logprobs,
                                      finish_reason="tool_calls")])

    prologue = [event([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in range(gen.n)]
    usage_event = (lambda usage: event([], usage)) if body.include_usage else None
    return event_stream(gen, prologue, render if gen.forced_call is None else render_forced, usage_event)
