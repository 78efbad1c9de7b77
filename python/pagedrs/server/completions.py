"""POST /v1/completions: prompts as text or token ids, streamed or not, with echo and logprobs,
best_of and beam search (``use_beam_search``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedrs.server.deltas import SampleDelta
from pagedrs.server.errors import bad_request
from pagedrs.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest, now_s, random_id
from pagedrs.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from pagedrs.server.serving import (
    Generation,
    SampleState,
    ServerContext,
    check_stream_options,
    event_stream,
    refuse_unstreamable,
    sse,
)
from pagedrs.server.structured import structured_outputs
from pagedrs.server.tokens import token_text, top_logprobs


async def prepare(ctx: ServerContext, body: CompletionRequest) -> Generation:
    """Check the request, tokenize its prompts and build its engine requests (not yet submitted)."""
    ctx.check_model(body.model)
    check_stream_options(body)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", param="echo")
    prompts = _prompts(body.prompt)
    if len(prompts) > max(1, ctx.max_waiting):  # 400, not 503: no amount of waiting would admit it
        raise bad_request(
            f"The request has {len(prompts)} prompts; a request may have at most --max-waiting={ctx.max_waiting}",
            param="prompt",
        )
    ctx.check_fanout(len(prompts), body.n, body.best_of)
    prompt_ids = [await ctx.prompts.encode(p, "prompt") if isinstance(p, str) else p for p in prompts]
    for ids in prompt_ids:
        if not ids:
            raise bad_request("the prompt is empty; at least 1 token is needed", param="prompt")
    longest = max(len(ids) for ids in prompt_ids)
    room = ctx.room(longest, "prompt")
    kwargs = body.sampling_kwargs()
    ctx.check_max_tokens(kwargs.get("max_tokens"), room, longest, "max_tokens")
    # OpenAI's default of 16, shortened where the context has less room.
    kwargs.setdefault("max_tokens", min(DEFAULT_COMPLETION_MAX_TOKENS, room))
    if body.logprobs is not None:
        kwargs["logprobs"] = body.logprobs
    kwargs["structured_outputs"] = await structured_outputs(body)
    params = ctx.make_params(kwargs)
    refuse_unstreamable(body.stream, params)
    gen = Generation(ctx, prompt_ids, params, priority=body.priority, cache_salt=body.cache_salt)
    gen.echo_texts = [p if isinstance(p, str) else None for p in prompts]
    return gen


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """Normalize OpenAI's four prompt forms into a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty: send a string, a list of strings or token ids", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[int(t) for t in prompt]]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]


def _echo_text(ctx: ServerContext, gen: Generation, tag: int) -> str:
    text = gen.echo_texts[tag]
    return text if text is not None else str(ctx.tokenizer.decode(gen.prompts[tag]))


class _LogprobBuilder:
    """The legacy layout for one choice, built incrementally (offsets count characters of the choice text)."""

    def __init__(self, ctx: ServerContext, top_k: int, offset: int) -> None:
        self.ctx, self.top_k, self.offset = ctx, top_k, offset
        self.value = CompletionLogprobs()

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> CompletionLogprobs:
        part = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            text = token_text(self.ctx.tokenizer, token_id)
            part.tokens.append(text)
            part.token_logprobs.append(entry.get(token_id))
            top = top_logprobs(self.ctx.tokenizer, entry, self.top_k)
            # keyed by text: distinct tokens with the same text keep the likeliest one
            part.top_logprobs.append(dict(reversed(top)) if self.top_k else None)
            part.text_offset.append(self.offset)
            self.offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.value, name).extend(getattr(part, name))
        return part


async def complete(ctx: ServerContext, body: CompletionRequest, gen: Generation) -> CompletionResponse:
    """Run a submitted non-streaming request to the end."""
    states = await gen.collect()
    choices: list[CompletionChoice] = []
    for index, state in states.items():
        prefix = _echo_text(ctx, gen, index // gen.n) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = _LogprobBuilder(ctx, body.logprobs, len(prefix)).add(state.token_ids, state.logprobs)
        choices.append(_choice(index, prefix + "".join(state.text), logprobs, state))
    completion_tokens = sum(len(s.token_ids) for s in states.values())
    return CompletionResponse(
        id=random_id("cmpl"), created=now_s(), model=ctx.model_name, choices=choices, usage=gen.usage(completion_tokens)
    )


def _choice(index: int, text: str, logprobs: CompletionLogprobs | None, state: SampleState) -> CompletionChoice:
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=state.finish_reason, stop_reason=state.stop_reason
    )


def stream(ctx: ServerContext, body: CompletionRequest, gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: echoed prompts, one chunk per choice and step, usage if asked, [DONE]."""
    response_id, created, first_id = random_id("cmpl"), now_s(), gen.first_event_id()

    def event(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        response = CompletionResponse(
            id=response_id, created=created, model=ctx.model_name, choices=choices, usage=usage,
            request_id=first_id.take(),
        )
        return sse(response.model_dump_json())

    builders: dict[int, _LogprobBuilder] = {}

    def render(index: int, sample: SampleDelta) -> str:
        logprobs = None
        if body.logprobs is not None:
            builder = builders.setdefault(index, _LogprobBuilder(ctx, body.logprobs, 0))
            logprobs = builder.add(sample.token_ids, sample.logprobs or [])
        return event([CompletionChoice(index=index, text=sample.text, logprobs=logprobs,
                                       finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)])

    prologue = []
    if body.echo:
        for tag in range(len(gen.prompts)):
            text = _echo_text(ctx, gen, tag)
            prologue += [event([CompletionChoice(index=gen.choice_index(tag, i), text=text)]) for i in range(gen.n)]
    usage_event = (lambda usage: event([], usage)) if body.include_usage else None
    return event_stream(gen, prologue, render, usage_event)
