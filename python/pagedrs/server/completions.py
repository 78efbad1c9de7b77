"""POST /v1/completions: prompts as text or token ids, streamed or not, with echo and logprobs,
best_of and beam search (``use_beam_search``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from pagedrs.server.deltas import SampleDelta
from pagedrs.server.errors import bad_request
from pagedrs.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest, now_s, random_id
from pagedrs.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, PromptLogprob, Usage
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
from pagedrs.server.tokens import token_piece, token_text, top_logprobs


async def prepare(ctx: ServerContext, body: CompletionRequest) -> Generation:
    """Check the request, tokenize its prompts and build its engine requests (not yet submitted)."""
    ctx.check_model(body.model)
    check_stream_options(body)
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
    if body.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = body.prompt_logprobs
    if _echo_logprobs(body):  # the prompt's tokens lead choices[].logprobs (OpenAI's legacy echo)
        kwargs["prompt_logprobs"] = max(body.logprobs or 0, body.prompt_logprobs or 0)
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


def _echo_logprobs(body: CompletionRequest) -> bool:
    return body.echo and body.logprobs is not None


def _echo_text(ctx: ServerContext, gen: Generation, tag: int) -> str:
    """The prompt as the request sent it: its text, or its token ids decoded as the request decodes its
    answer (``skip_special_tokens``: a token-id prompt's special tokens were dropped from an echo that
    asked to keep them)."""
    text = gen.echo_texts[tag]
    if text is not None:
        return text
    return str(ctx.tokenizer.decode(gen.prompts[tag], skip_special_tokens=gen.params.skip_special_tokens))


class _CharCount:
    """Characters of a text that is bytes decoded as UTF-8 with U+FFFD for each maximal invalid
    part (Rust's ``from_utf8_lossy``, which the tokenizer's decode is, and Python's "replace"),
    counted as the bytes come, a token's at a time: ``feed`` gives the index of the character a
    token's bytes start in, the one before when they continue a character begun earlier."""

    def __init__(self, chars: int) -> None:
        self.chars = chars
        self._need = 0  # continuation bytes the open character still needs
        self._lo, self._hi = 0x80, 0xBF  # the range its next byte must be in

    def feed(self, data: bytes) -> int:
        start = self.chars - 1 if data and self._need and self._lo <= data[0] <= self._hi else self.chars
        for byte in data:
            self._byte(byte)
        return start

    def text(self, text: str) -> int:
        """A token whose bytes are not known: its decoded text's characters (best effort)."""
        start, self._need = self.chars, 0
        self.chars += len(text)
        return start

    def _byte(self, byte: int) -> None:
        if self._need:
            if self._lo <= byte <= self._hi:
                self._need -= 1
                self._lo, self._hi = 0x80, 0xBF
                return
            self._need = 0  # the open character ends here, one U+FFFD (counted at its first byte)
        self.chars += 1
        self._lo, self._hi = 0x80, 0xBF
        if 0xC2 <= byte <= 0xDF:
            self._need = 1
        elif 0xE0 <= byte <= 0xEF:
            self._need = 2
            self._lo, self._hi = (0xA0, 0xBF) if byte == 0xE0 else (0x80, 0x9F) if byte == 0xED else (0x80, 0xBF)
        elif 0xF0 <= byte <= 0xF4:
            self._need = 3
            self._lo, self._hi = (0x90, 0xBF) if byte == 0xF0 else (0x80, 0x8F) if byte == 0xF4 else (0x80, 0xBF)
        # else ASCII, or a byte no character starts with (one U+FFFD of its own)


class _LogprobBuilder:
    """The legacy layout for one choice, built incrementally, streamed or not alike.

    ``tokens`` as ``token_piece`` shows them: a token that is part of a character is
    "bytes:\\xe6\\x88" (as OpenAI's legacy API), every other one its text, so that the tokens
    are the choice's text wherever they are whole characters. ``text_offset[i]`` is the index
    in the choice's text (in characters) of the character token i starts in, counted over the
    tokens' bytes (``_CharCount``), so that a character split over tokens moves nothing after
    it; a special token that the text leaves out (``skip_special_tokens``) takes no room.
    """

    def __init__(self, ctx: ServerContext, gen: Generation, top_k: int, offset: int) -> None:
        self.ctx, self.top_k = ctx, top_k
        self.special: frozenset[int] = getattr(ctx.tokenizer, "special_token_ids", frozenset())
        self.skipped = self.special if gen.params.skip_special_tokens else frozenset()
        self.count = _CharCount(offset)
        self.value = CompletionLogprobs()

    def add(self, token_ids: list[int], logprobs: Sequence[dict[int, float] | None]) -> CompletionLogprobs:
        """The next generated tokens: their text is the tokens' bytes decoded (the detokenizer's)."""
        part = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            text, raw = token_piece(self.ctx.tokenizer, token_id)
            if raw is None:
                offset = self.count.text(text)
            else:
                offset = self.count.feed(b"" if token_id in self.skipped else raw)
            self._append(part, token_id, text, entry, offset)
        return self._extend(part)

    def add_prompt(self, token_ids: list[int], logprobs: Sequence[dict[int, float] | None],
                   text: str) -> CompletionLogprobs:
        """The prompt's tokens, offsets from 0 in its echoed ``text``; an entry None (the first
        token) has null logprobs. Matched against the text's bytes: a special token not in it (a
        BOS the encode added, or one a decode skipped) takes no room, nor does the leading space
        a SentencePiece encode prepends (its decode strips it). Which of the two readings holds (the
        first piece's space in the text or not) is the one whose pieces spell the whole text: a
        prompt that starts with a space has both (``"\u2581"`` then ``"\u2581T"``), and the first
        space matched the text's own, moving every offset after it one character on."""
        data = text.encode()
        pieces = [token_piece(self.ctx.tokenizer, token_id) for token_id in token_ids]
        offsets = (self._spelled_offsets(token_ids, pieces, data, dummy_space=False)
                   or self._spelled_offsets(token_ids, pieces, data, dummy_space=True)
                   or self._matched_offsets(token_ids, pieces, data))
        part = CompletionLogprobs()
        for token_id, (shown, _), entry, offset in zip(token_ids, pieces, logprobs, offsets, strict=True):
            self._append(part, token_id, shown, entry, offset)
        return self._extend(part)

    def _spelled_offsets(self, token_ids: list[int], pieces: list[tuple[str, bytes | None]], data: bytes, *,
                         dummy_space: bool) -> list[int] | None:
        """Offsets where the pieces spell ``data`` exactly (special tokens present or not), the first
        ordinary piece less its leading space when ``dummy_space``; None where they do not."""
        count, pos, offsets, first = _CharCount(0), 0, [], True
        for token_id, (_, raw) in zip(token_ids, pieces, strict=True):
            if raw is None:
                return None
            if first and token_id not in self.special:
                first = False
                if dummy_space:
                    if not raw.startswith(b" "):
                        return None
                    raw = raw[1:]
            if data.startswith(raw, pos):
                offsets.append(count.feed(raw))
                pos += len(raw)
            elif token_id in self.special:
                offsets.append(count.feed(b""))
            else:
                return None
        return offsets if pos == len(data) else None

    def _matched_offsets(self, token_ids: list[int], pieces: list[tuple[str, bytes | None]],
                         data: bytes) -> list[int]:
        """Best effort where the pieces do not spell the text (bytes unknown, a normalizer's change)."""
        pos, count, offsets = 0, _CharCount(0), []
        for token_id, (shown, raw) in zip(token_ids, pieces, strict=True):
            found = raw is not None and data.startswith(raw, pos)
            if raw is None:  # bytes unknown: its decoded text's characters (best effort)
                offsets.append(count.text(shown))
                pos += len(shown.encode())
            elif not found and token_id in self.special:  # not in the text
                offsets.append(count.feed(b""))
            elif not found and pos == 0 and raw[:1] == b" " and data.startswith(raw[1:]):
                offsets.append(count.feed(raw[1:]))  # the first space, which a SentencePiece decode strips
                pos += len(raw) - 1
            else:
                offsets.append(count.feed(raw))
                pos += len(raw)
        return offsets

    def _append(self, part: CompletionLogprobs, token_id: int, text: str, entry: dict[int, float] | None,
                offset: int) -> None:
        part.tokens.append(text)
        part.token_logprobs.append(None if entry is None else entry.get(token_id))
        top = [(t, lp) for t, _, lp in top_logprobs(self.ctx.tokenizer, entry, self.top_k)] if entry is not None else []
        # keyed by text: distinct tokens with the same text keep the likeliest one
        part.top_logprobs.append(dict(reversed(top)) if self.top_k and entry is not None else None)
        part.text_offset.append(offset)

    def _extend(self, part: CompletionLogprobs) -> CompletionLogprobs:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.value, name).extend(getattr(part, name))
        return part


async def complete(ctx: ServerContext, body: CompletionRequest, gen: Generation) -> CompletionResponse:
    """Run a submitted non-streaming request to the end."""
    states = await gen.collect()
    choices: list[CompletionChoice] = []
    for index, state in states.items():
        tag = index // gen.n
        prefix = _echo_text(ctx, gen, tag) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            builder = _LogprobBuilder(ctx, gen, body.logprobs, len(prefix))
            if _echo_logprobs(body):
                _add_prompt(builder, gen, tag, prefix)
            builder.add(state.token_ids, state.logprobs)
            logprobs = builder.value
        choice = _choice(index, prefix + "".join(state.text), logprobs, state)
        choice.prompt_logprobs = _vllm_prompt_logprobs(ctx, body, gen, tag)
        choice.prompt_token_ids, choice.token_ids = body.returned_ids(gen.prompts[tag]), body.returned_ids(state.token_ids)
        choices.append(choice)
    completion_tokens = sum(len(s.token_ids) for s in states.values())
    return CompletionResponse(
        id=random_id("cmpl"), created=now_s(), model=ctx.model_name, choices=choices, usage=gen.usage(completion_tokens)
    )


def _add_prompt(builder: _LogprobBuilder, gen: Generation, tag: int, text: str) -> CompletionLogprobs:
    """The prompt's tokens first (offsets from 0 in the echoed ``text``); the generated ones then
    start at the echo's length."""
    return builder.add_prompt(gen.prompts[tag], _prompt_entries(gen, tag), text)


def _prompt_entries(gen: Generation, tag: int) -> list[dict[int, float] | None]:
    entries = gen.prompt_logprobs.get(tag)
    if entries is None:  # the engine sends them with the first token, before anything is rendered
        raise RuntimeError(f"prompt {tag}: the engine sent no prompt logprobs")
    return entries


def _vllm_prompt_logprobs(ctx: ServerContext, body: CompletionRequest, gen: Generation,
                          tag: int) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` of a choice: per position token id -> Logprob; rank 1.. among the top k."""
    if body.prompt_logprobs is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for position, entry in enumerate(_prompt_entries(gen, tag)):
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        prompt_token = gen.prompts[tag][position]
        values = {}
        for rank, (token_id, logprob) in enumerate(ranked[: body.prompt_logprobs], start=1):
            values[str(token_id)] = PromptLogprob(logprob=logprob, rank=rank,
                                                  decoded_token=token_text(ctx.tokenizer, token_id))
        if str(prompt_token) not in values:
            values = {str(prompt_token): PromptLogprob(logprob=entry[prompt_token], rank=None,
                                                       decoded_token=token_text(ctx.tokenizer, prompt_token)),
                      **values}
        out.append(values)
    return out


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

    started: set[int] = set()  # choices that sent a chunk
    ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)

    def prompt_ids(index: int) -> list[int] | None:
        """vLLM's return_token_ids: the prompt's ids ride on a choice's first chunk only."""
        if not body.return_token_ids or index in ids_sent:
            return None
        ids_sent.add(index)
        return list(gen.prompts[index // gen.n])

    def render(index: int, sample: SampleDelta) -> str:
        """A choice's chunk; its first also carries vLLM's prompt_logprobs, and with echo and logprobs it is
        preceded by the echo with the prompt's logprobs (known only now, after the prefill)."""
        tag, head = index // gen.n, ""
        prompt_logprobs = None
        if index not in started:
            started.add(index)
            prompt_logprobs = _vllm_prompt_logprobs(ctx, body, gen, tag)
            if _echo_logprobs(body):
                assert body.logprobs is not None
                text = _echo_text(ctx, gen, tag)
                builders[index] = _LogprobBuilder(ctx, gen, body.logprobs, len(text))
                head = event([CompletionChoice(index=index, text=text,
                                               logprobs=_add_prompt(builders[index], gen, tag, text),
                                               prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids(index))])
                prompt_logprobs = None
        logprobs = None
        if body.logprobs is not None:
            builder = builders.setdefault(index, _LogprobBuilder(ctx, gen, body.logprobs, 0))
            logprobs = builder.add(sample.token_ids, sample.logprobs or [])
        return head + event([CompletionChoice(index=index, text=sample.text, logprobs=logprobs,
                                              finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                                              prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids(index),
                                              token_ids=body.returned_ids(sample.token_ids))])

    prologue = []
    if body.echo and not _echo_logprobs(body):  # with logprobs the echo waits for them (render)
        for tag in range(len(gen.prompts)):
            text = _echo_text(ctx, gen, tag)
            prologue += [event([CompletionChoice(index=index, text=text, prompt_token_ids=prompt_ids(index))])
                         for index in (gen.choice_index(tag, i) for i in range(gen.n))]
    usage_event = (lambda usage: event([], usage)) if body.include_usage else None
    return event_stream(gen, prologue, render, usage_event)
