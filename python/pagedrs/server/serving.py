"""What both endpoints share: the server's context and one HTTP request's engine requests.

An HTTP request with P prompts and ``n`` samples becomes P engine requests
(``<id>-0`` .. ``<id>-{P-1}``), each with n samples; its choices are numbered
``prompt_index * n + sample_index``, as OpenAI numbers them. The engine requests
are submitted together, read from one DeltaStream, and aborted together when
the client goes away. One request may add at most ``max_seqs_per_request`` sequences
(prompts x the sequences each runs: ``best_of`` or ``n``, the beam width for beam search).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from fastapi import Request

from pagedrs.server.deltas import DeltaStream, RequestDelta, SampleDelta
from pagedrs.server.engine_loop import EngineLoop
from pagedrs.server.errors import APIError, bad_request
from pagedrs.server.options import DEFAULT_MAX_SEQS_PER_REQUEST
from pagedrs.server.prompts import PromptTokenizer
from pagedrs.server.protocol import random_id
from pagedrs.server.responses import Usage
from pagedrs.server.tenants import engine_salt

T = TypeVar("T")
logger = logging.getLogger("pagedrs.server")


@dataclass
class ServerContext:
    """Everything a handler needs; one per app (``app.state.ctx``)."""

    engine_loop: EngineLoop
    model_name: str
    max_waiting: int  # a request that would make the waiting queue longer than this gets a 503
    max_model_len: int
    kv_pool_tokens: int  # token slots in the device KV pool: no request can grow past this
    vocab_size: int  # token ids are in [0, vocab_size)
    tokenizer: Any
    prompts: PromptTokenizer  # text -> token ids, off the event loop and off the engine thread
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST  # prompts x sequences per prompt, at most
    prefix_cache_isolation: str = "shared"  # or "per-tenant": the engine's cache salt names the tenant
    tool_call_parser: str | None = None  # --tool-call-parser: how tool_choice "auto" reads answers (None: refused)
    tenants: frozenset[str] = frozenset()  # the tenants the API keys name (a pin for another is refused; empty: unchecked)

    def check_model(self, requested: str) -> None:
        if requested != self.model_name:
            raise APIError(
                404,
                f"The model {requested!r} does not exist: this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_fanout(self, num_prompts: int, n: int, best_of: int | None) -> None:
        """A request adds ``num_prompts x max(n, best_of)`` sequences at once; 400 past the cap."""
        per_prompt, name = (best_of, "best_of") if best_of is not None and best_of > n else (n, "n")
        total = num_prompts * per_prompt
        if total > self.max_seqs_per_request:
            raise bad_request(
                f"The request asks for {num_prompts} prompt(s) x {name}={per_prompt} = {total} sequences; a request "
                f"may add at most --max-seqs-per-request={self.max_seqs_per_request}",
                param=name,
            )

    def room(self, prompt_len: int, param: str) -> int:
        """Tokens a prompt of ``prompt_len`` tokens leaves for the completion; 400 when none."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens (max_model_len is "
                f"{self.max_model_len}); {prompt_len} tokens are in the {param}, leaving no room for a completion",
                param=param,
            )
        return room

    def check_max_tokens(self, max_tokens: int | None, room: int, prompt_len: int, param: str) -> None:
        """A requested completion length must fit the context next to the prompt (vLLM also answers 400)."""
        if max_tokens is not None and max_tokens > room:
            raise bad_request(
                f"{param}={max_tokens} is too large: the prompt has {prompt_len} tokens and max_model_len is "
                f"{self.max_model_len}, so at most {room} tokens can be generated",
                param=param,
            )

    def make_params(self, kwargs: dict[str, Any]) -> Any:
        """SamplingParams from request fields; its ValueError (naming field and range) becomes a 400.

        Their ``output_kind`` is DELTA, streaming or not (vLLM streams with DELTA): the Sink reads
        only what each step added (``delta_text``, ``delta_token_ids``), and CUMULATIVE would copy
        every sample's whole token list into each step's output (quadratic in the answer's length).
        Not FINAL_ONLY: the Sink times the first token and each later one when it is dispatched
        (the TTFT and inter-token histograms, ``--request-trace``'s "dispatched"), non-streaming
        requests included. A finished choice is sent once either way (``Sink``)."""
        from pagedrs.sampling_params import RequestOutputKind, SamplingParams

        try:
            return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        except ValueError as exc:
            field_name = re.match(r"SamplingParams\.(\w+)=", str(exc))
            raise bad_request(str(exc), param=field_name.group(1) if field_name else None) from exc


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_from_header(header: str | None, default: str) -> str:
    """The engine request ids' base: ``<X-Request-Id>-<random>`` when the client sent the header, else ``default``.

    It names the request in the logs and the request trace (``--request-trace``), so a client
    finds its own requests there. The random suffix keeps ids unique: a client that reuses an id
    (or another client's) never aborts or collides with a request in flight (vLLM does the same).
    """
    if header is None:
        return default
    if not _REQUEST_ID.fullmatch(header):
        raise bad_request(
            f"X-Request-Id is {header[:40]!r}: it must be 1-128 characters of letters, digits and . _ : -",
            param="X-Request-Id",
        )
    return f"{header}-{uuid.uuid4().hex[:12]}"


def check_stream_options(body: Any) -> None:
    """``stream_options`` only mean something on a stream: without ``stream: true`` it is a 400 (as OpenAI's)."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


def refuse_unstreamable(stream: bool, params: Any) -> None:
    """Beam search and ``best_of > n`` know their choices only at the end: no stream (400, as vLLM and OpenAI)."""
    if not stream:
        return
    if params.use_beam_search:
        raise bad_request("use_beam_search=true cannot be streamed: the best hypotheses are known only when the "
                          "search ends; set stream=false", param="use_beam_search")
    if params.best_of is not None and params.best_of > params.n:
        raise bad_request(f"best_of={params.best_of} > n={params.n} cannot be streamed: the best n are known only "
                          "when every sample has finished; set stream=false or best_of=n", param="best_of")


@dataclass
class SampleState:
    """One choice accumulated from deltas (non-streaming responses)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    """The engine requests behind one HTTP request: submitted together, aborted together.

    ``prompts`` are token ids: the server tokenizes text itself (``PromptTokenizer``).
    """

    def __init__(
        self, ctx: ServerContext, prompts: list[list[int]], params: Any, priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.n: int = params.n
        self.echo_texts: list[str | None] = [None] * len(prompts)  # the text of text prompts, for echo
        self.tool_reading: Any = None  # chat: a tools.ToolReading, how to read the answers back as tool calls
        self.id_base = random_id("req")
        self.client_request_id: str | None = None  # X-Request-Id as the client sent it
        self.client_salt = cache_salt  # the request's cache_salt field (validated by the model)
        self.engine_salt: str | None = engine_salt("shared", None, cache_salt)  # bind() makes it the tenant's
        self.stream: DeltaStream | None = None  # made in submit(), on the handler's event loop
        self.prompt_token_ids: dict[int, list[int]] = {}
        self.cached_tokens: dict[int, int] = {}  # prompt index -> prompt tokens the engine reused
        self.cached_by_tier: dict[int, dict[str, int]] = {}  # prompt index -> those tokens by tier
        self.prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}  # prompt index -> its prompt logprobs
        self._unfinished: set[str] = set()

    def bind(self, request: Request) -> None:
        """What the HTTP request adds: its X-Request-Id and its caller's tenant (set by the Gate)."""
        header = request.headers.get("x-request-id")
        self.id_base = request_id_from_header(header, self.id_base)
        self.client_request_id = header
        tenant = getattr(request.state, "tenant", None)
        self.engine_salt = engine_salt(self.ctx.prefix_cache_isolation, tenant, self.client_salt)

    def first_event_id(self) -> OnceValue[str]:
        """The client's request id for the first event of a stream (None afterwards, and without one)."""
        return OnceValue(self.client_request_id)

    async def submit(self) -> None:
        """Add every prompt to the engine, or none: 503 on back-pressure, 400 on invalid input."""
        loop = self.ctx.engine_loop
        waiting = loop.num_waiting()
        if waiting + len(self.prompts) > self.ctx.max_waiting:
            loop.metrics.rejected.labels(status="503").inc()
            raise APIError(
                503,
                f"The server is overloaded: {waiting} requests are waiting and --max-waiting is "
                f"{self.ctx.max_waiting}; retry later",
                code="server_overloaded",
            )
        self.stream = DeltaStream()
        try:
            for tag, prompt in enumerate(self.prompts):
                request_id = f"{self.id_base}-{tag}"
                self._unfinished.add(request_id)
                await loop.add(request_id, {"prompt_token_ids": prompt}, self.params, self.stream, tag=tag,
                               priority=self.priority, cache_salt=self.engine_salt)
        except ValueError as exc:  # a FieldError names the request field at fault
            self.abort()
            loop.metrics.rejected.labels(status="400").inc()
            raise bad_request(str(exc), param=getattr(exc, "param", None)) from exc
        except RuntimeError as exc:  # the engine loop stopped or refuses adds (shutting down)
            self.abort()
            loop.metrics.rejected.labels(status="503").inc()
            raise APIError(503, str(exc), code="server_unavailable") from exc
        except BaseException:  # cancelled while submitting: the client is gone
            self.abort()
            raise

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Every delta until all engine requests finished; aborts the rest if the reader stops early."""
        try:
            assert self.stream is not None, "deltas() before submit()"
            while self._unfinished:
                delta = await self.stream.get()
                if delta.finished:
                    self._unfinished.discard(delta.request_id)
                if delta.error is not None and delta.samples:
                    # Tokens merged into the error delta (the handler lagged) still reach the client first.
                    yield replace(delta, error=None, finished=False)
                if delta.error is not None:
                    code = delta.error_code or ("server_shutting_down" if delta.error_status == 503 else None)
                    raise APIError(delta.error_status, f"request {delta.request_id} failed: {delta.error}",
                                   param=delta.error_param, code=code)
                if delta.prompt_token_ids:
                    self.prompt_token_ids[delta.tag] = delta.prompt_token_ids
                    self.cached_tokens[delta.tag] = delta.num_cached_tokens
                    if delta.cached_tokens_by_tier is not None:
                        self.cached_by_tier[delta.tag] = delta.cached_tokens_by_tier
                if delta.prompt_logprobs is not None:
                    self.prompt_logprobs[delta.tag] = delta.prompt_logprobs
                yield delta
        finally:
            self.abort()

    async def collect(self) -> dict[int, SampleState]:
        """Run to completion; choice index -> accumulated sample."""
        states: dict[int, SampleState] = {}
        async for delta in self.deltas():
            for sample in delta.samples:
                state = states.setdefault(self.choice_index(delta.tag, sample.index), SampleState())
                state.text.append(sample.text)
                state.token_ids.extend(sample.token_ids)
                if sample.logprobs:
                    state.logprobs.extend(sample.logprobs)
                if sample.finish_reason is not None:
                    state.finish_reason, state.stop_reason = sample.finish_reason, sample.stop_reason
        return dict(sorted(states.items()))

    def choice_index(self, tag: int, sample_index: int) -> int:
        return tag * self.n + sample_index

    def usage(self, completion_tokens: int) -> Usage:
        """Summed over the prompts: their tokens, of which the engine found ``cached_tokens`` in its cache."""
        prompt_tokens = sum(len(ids) for ids in self.prompt_token_ids.values())
        by_tier = {tier: sum(split.get(tier, 0) for split in self.cached_by_tier.values()) for tier in ("device", "host", "disk")}
        return Usage.of(prompt_tokens, completion_tokens, cached_tokens=sum(self.cached_tokens.values()), cached_by_tier=by_tier)

    def abort(self) -> None:
        for request_id in self._unfinished:
            self.ctx.engine_loop.abort(request_id)
        self._unfinished.clear()


class OnceValue(Generic[T]):
    """A value handed out once: ``take()`` returns it the first time and None after."""

    def __init__(self, value: T | None) -> None:
        self._value = value

    def take(self) -> T | None:
        value, self._value = self._value, None
        return value


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; cancel it and return None if the client disconnects first.

    For non-streaming requests: Starlette cancels streaming bodies on disconnect
    by itself, but a plain handler would keep generating for nobody. After the
    body is read, the only message ``receive`` can return is ``http.disconnect``.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()  # its finally blocks abort the engine requests
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.cancelled():
        return None
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(exc: APIError) -> str:
    """An error inside a stream that already answered 200: OpenAI's error body as one event."""
    return sse(json.dumps(exc.body()))


async def event_stream(
    gen: Generation,
    prologue: Iterable[str],
    render: Callable[[int, SampleDelta], str],
    usage_event: Callable[[Usage], str] | None,
) -> AsyncIterator[str]:
    """The SSE frame both endpoints share.

    ``prologue`` events first, then ``render(choice_index, sample)`` for every sample
    that gained text or tokens or finished, then ``usage_event`` (when the client asked
    for usage), then ``data: [DONE]``. An engine failure becomes an error event; a
    client that goes away cancels this generator, and ``finally`` aborts its requests.
    """
    completion_tokens = 0
    try:
        for event in prologue:
            yield event
        async for delta in gen.deltas():
            for sample in delta.samples:
                if sample.text or sample.token_ids or sample.finish_reason:
                    completion_tokens += len(sample.token_ids)
                    yield render(gen.choice_index(delta.tag, sample.index), sample)
        if usage_event is not None:
            yield usage_event(gen.usage(completion_tokens))
    except APIError as exc:
        yield sse_error(exc)
    except Exception as exc:  # noqa: BLE001 - the 200 is sent: end the stream in the OpenAI shape
        logger.exception("error while streaming %s", gen.id_base)
        yield sse_error(APIError(500, f"internal error while streaming: {type(exc).__name__}"))
    finally:
        gen.abort()
    yield SSE_DONE
