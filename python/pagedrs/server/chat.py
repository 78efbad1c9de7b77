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
    TopLogprob,
    Usage,
)
from pagedrs.server.serving import (
    Generation,
    OnceValue,
    ServerContext,
    check_stream_options,
    event_stream,
    refuse_unstreamable,
    sse,
)
from pagedrs.server.sinks import LOGPROB_FLOOR
from pagedrs.server.structured import checked, structured_outputs
from pagedrs.server.tokens import token_piece, top_logprobs
from pagedrs.server.tools import ToolStream, finish_reason_with_calls, read_answer, tool_constraint


async def prepare(ctx: ServerContext, body: ChatCompletionRequest) -> Generation:
    """Check the request, render the conversation and build its engine request (not yet submitted)."""
    ctx.check_model(body.model)
    check_stream_options(body)
    ctx.check_fanout(1, body.n, body.best_of)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    schema, reading = tool_constraint(body, ctx.tool_call_parser)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt_ids = await ctx.prompts.render_chat(body.messages, body.add_generation_prompt, tools)
    room = ctx.room(len(prompt_ids), "messages")
    kwargs = body.sampling_kwargs()
    name = _max_tokens_field(body)
    if name is not None:
        kwargs["max_tokens"] = getattr(body, name)
    ctx.check_max_tokens(kwargs.get("max_tokens"), room, len(prompt_ids), name or "max_tokens")
    if "max_tokens" not in kwargs:
        # Unset: until the context is full, as OpenAI does for chat, but never more than the
        # KV pool can hold next to the prompt (the engine refuses a request that can never fit).
        kwargs["max_tokens"] = max(1, min(room, ctx.kv_pool_tokens - len(prompt_ids)))
    if body.logprobs:
        kwargs["logprobs"] = body.top_logprobs or 0
    kwargs["structured_outputs"] = await structured_outputs(body)
    if schema is not None:
        if kwargs["structured_outputs"] is not None:
            raise bad_request("a forced tool call is already a structured output: send tool_choice or "
                              "response_format / structured_outputs / guided_*, not both", param="tool_choice")
        kwargs["structured_outputs"] = await checked("tools", "json", schema)
    if reading is not None and reading.needs_special_tokens and body.skip_special_tokens is None:
        kwargs["skip_special_tokens"] = False  # the parser's marker is a special token: keep it in the text
    params = ctx.make_params(kwargs)
    refuse_unstreamable(body.stream, params)
    gen = Generation(ctx, [prompt_ids], params, priority=body.priority, cache_salt=body.cache_salt)
    gen.tool_reading = reading
    return gen


def _max_tokens_field(body: ChatCompletionRequest) -> str | None:
    """The field the completion's length comes from (None: neither was sent). OpenAI's newer name,
    ``max_completion_tokens``, and the older ``max_tokens`` may come together only when equal: one of
    two different lengths would be ignored (and was: not even range-checked)."""
    if body.max_completion_tokens is None:
        return None if body.max_tokens is None else "max_tokens"
    if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise bad_request(f"max_tokens={body.max_tokens} and max_completion_tokens={body.max_completion_tokens} "
                          "differ: send one of them (max_completion_tokens is the newer name of max_tokens), or "
                          "both with the same value", param="max_completion_tokens")
    return "max_completion_tokens"


def _logprobs(ctx: ServerContext, k: int, token_ids: list[int], entries: list[dict[int, float]]) -> ChatLogprobs:
    """OpenAI's chat logprobs: ``bytes`` is each token's raw bytes (the content's UTF-8 is them end to
    end; null where the tokenizer cannot say), ``token`` its text, or "bytes:\\xe6\\x88" for a token
    that is part of a character (``token_piece``)."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, raw = token_piece(ctx.tokenizer, token_id)
        top = [
            TopLogprob(token=t, logprob=lp, bytes=None if b is None else list(b))
            for t, b, lp in top_logprobs(ctx.tokenizer, entry, k)
        ]
        logprob = entry.get(token_id, LOGPROB_FLOOR)  # (the core puts the sampled token in its entry)
        content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=None if raw is None else list(raw),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


async def complete(ctx: ServerContext, body: ChatCompletionRequest, gen: Generation) -> ChatCompletionResponse:
    """Run a submitted non-streaming request to the end."""
    states = await gen.collect()
    k = body.top_logprobs or 0
    choices = []
    for index, state in states.items():
        message, reason = ChatResponseMessage(content="".join(state.text)), state.finish_reason
        if gen.tool_reading is not None:
            content, calls = read_answer(gen.tool_reading, message.content or "", reason)
            message = ChatResponseMessage(content=content, tool_calls=calls or None)
            reason = finish_reason_with_calls(reason, bool(calls))
        choices.append(ChatChoice(
            index=index,
            message=message,
            logprobs=_logprobs(ctx, k, state.token_ids, state.logprobs) if body.logprobs else None,
            finish_reason=reason,
            stop_reason=state.stop_reason,
            token_ids=body.returned_ids(state.token_ids),
        ))
    completion_tokens = sum(len(s.token_ids) for s in states.values())
    return ChatCompletionResponse(
        id=random_id("chatcmpl"), created=now_s(), model=ctx.model_name, choices=choices,
        usage=gen.usage(completion_tokens), prompt_token_ids=body.returned_ids(gen.prompts[0]),
    )


def stream(ctx: ServerContext, body: ChatCompletionRequest, gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: a role chunk per choice, content chunks, usage if asked, [DONE]."""
    response_id, created, first_id = random_id("chatcmpl"), now_s(), gen.first_event_id()
    # vLLM's return_token_ids: the prompt's ids on the stream's first chunk, each chunk's own ids on its choice
    first_prompt_ids = OnceValue(body.returned_ids(gen.prompts[0]))

    def event(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(id=response_id, created=created, model=ctx.model_name, choices=choices,
                                    usage=usage, request_id=first_id.take(), prompt_token_ids=first_prompt_ids.take())
        return sse(chunk.model_dump_json())

    k = body.top_logprobs or 0

    def render(index: int, sample: SampleDelta) -> str:
        logprobs = _logprobs(ctx, k, sample.token_ids, sample.logprobs or []) if body.logprobs else None
        return event([ChatChunkChoice(index=index, delta=ChatDelta(content=sample.text or None), logprobs=logprobs,
                                      finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                                      token_ids=body.returned_ids(sample.token_ids))])

    tool_streams: dict[int, ToolStream] = {}
    unsent: dict[int, tuple[list[int], list[dict[int, float]]]] = {}  # choice -> tokens, logprobs not yet in a chunk

    def render_tools(index: int, sample: SampleDelta) -> str:
        """The answer through its tool parser: content and ``delta.tool_calls`` chunks, in the
        order the text has them (a call once complete: ``tools.py``); the logprobs of tokens held
        back ride on the next chunk sent."""
        tools = tool_streams.setdefault(index, ToolStream(gen.tool_reading))
        token_ids, entries = unsent.setdefault(index, ([], []))
        token_ids += sample.token_ids
        entries += sample.logprobs or []
        finished = sample.finish_reason is not None
        deltas = [ChatDelta(content=part) if isinstance(part, str) else ChatDelta(tool_calls=part)
                  for part in tools.parts(sample.text, sample.finish_reason)]
        if finished and not deltas:
            deltas = [ChatDelta()]
        events = []
        for i, delta in enumerate(deltas):
            logprobs = _logprobs(ctx, k, token_ids, entries) if body.logprobs and i == 0 else None
            last = finished and i == len(deltas) - 1
            reason = tools.finish_reason(sample.finish_reason) if last else None
            events.append(event([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason,
                                                 stop_reason=sample.stop_reason if last else None,
                                                 token_ids=body.returned_ids(token_ids) if i == 0 else None)]))
        if deltas:
            del unsent[index]
        return "".join(events)

    prologue = [event([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in range(gen.n)]
    usage_event = (lambda usage: event([], usage)) if body.include_usage else None
    return event_stream(gen, prologue, render if gen.tool_reading is None else render_tools, usage_event)
