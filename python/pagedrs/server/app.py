"""The FastAPI application: routes only; the work is in completions, chat and engine_loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

import pagedrs
from pagedrs.server import cache_admin, cache_pins, chat, completions, tokenize
from pagedrs.server.engine_loop import EngineLoop
from pagedrs.server.errors import APIError, install_error_handlers
from pagedrs.server.guard import Gate
from pagedrs.server.json_body import StrictJSONRoute
from pagedrs.server.metrics import CONTENT_TYPE_LATEST
from pagedrs.server.options import ServerOptions
from pagedrs.server.prompts import PromptTokenizer
from pagedrs.server.protocol import ChatCompletionRequest, CompletionRequest, now_s
from pagedrs.server.responses import ModelCard, ModelList
from pagedrs.server.serving import Generation, ServerContext, unless_disconnected
from pagedrs.server.shutdown import DrainState

# Not an HTTP status anyone reads: the client is gone (nginx's "client closed request").
_CLIENT_CLOSED = 499


class _EventStream(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends.

    The body generator's own ``finally`` does not run if the client disconnects
    before the first chunk is pulled (a never-started generator is just dropped).
    """

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _warm_token_bytes(tokenizer: Any) -> None:
    """Builds the tokenizer's token-bytes table (logprobs' ``bytes``) now, at startup: built on the
    first logprobs request, it held the event loop ~0.3 s for SmolLM2's 49k tokens (more for 150k
    vocabularies), stalling every stream at once. Test fakes without the table are left alone."""
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is not None:
        token_bytes(0)


def build_app(
    engine_loop: EngineLoop, model_name: str, max_waiting: int, options: ServerOptions | None = None
) -> FastAPI:
    """The OpenAI-compatible app over a started ``engine_loop``; the caller starts and stops the loop.

    ``app.state.ctx`` is the ServerContext, ``app.state.drain`` the DrainState that a
    draining server (``shutdown.draining_server``) flips, ``app.state.options`` the limits.
    """
    options = options or ServerOptions()
    engine = engine_loop.engine
    stats = engine_loop.stats()
    max_model_len = int(engine.max_model_len)
    ctx = ServerContext(
        engine_loop=engine_loop,
        model_name=model_name,
        max_waiting=max_waiting,
        max_model_len=max_model_len,
        kv_pool_tokens=int(stats.get("num_gpu_blocks", 0)) * int(stats.get("block_size", 0)) or max_model_len,
        vocab_size=int(engine.vocab_size),
        tokenizer=engine.tokenizer,
        prompts=PromptTokenizer(engine.tokenizer, max_model_len, options.tokenizer_threads),
        max_seqs_per_request=options.max_seqs_per_request,
        prefix_cache_isolation=options.prefix_cache_isolation,
        tool_call_parser=options.tool_call_parser,
        tenants=frozenset(options.tenants().values()),
    )
    _warm_token_bytes(engine.tokenizer)
    drain = DrainState()
    app = FastAPI(title="pagedrs", version=pagedrs.__version__)
    app.router.route_class = StrictJSONRoute  # before any route: every JSON body is parsed strictly
    app.state.ctx, app.state.drain, app.state.options = ctx, drain, options
    install_error_handlers(app)
    app.add_middleware(Gate, options=options, drain=drain)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes (it was a 405)
    async def health() -> Response:
        if drain.draining:
            return APIError(503, "the server is shutting down", code="server_shutting_down").response()
        problem = engine_loop.health()  # dead, stopped, or its core silent for --core-timeout
        if problem is not None:
            code, reason = problem
            return APIError(503, reason, code=code).response()
        return JSONResponse({"status": "ok"})

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name, created=now_s(), max_model_len=ctx.max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine_loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response | Any:
        return await _serve(completions, ctx, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | Any:
        return await _serve(chat, ctx, body, request)

    @app.post("/tokenize")
    async def create_tokenize(body: tokenize.TokenizeRequest) -> tokenize.TokenizeResponse:
        return await tokenize.tokenize(ctx, body)

    @app.post("/detokenize")
    async def create_detokenize(body: tokenize.DetokenizeRequest) -> tokenize.DetokenizeResponse:
        return await tokenize.detokenize(ctx, body)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> cache_admin.PrefixCacheResetResponse:
        await cache_admin.check_reset_request(request)
        return await cache_admin.reset_prefix_cache(ctx)

    @app.post("/v1/cache/pin")
    async def pin_prefix(body: cache_pins.PinRequest) -> cache_pins.PinResponse:
        return await cache_pins.pin(ctx, body)

    @app.delete("/v1/cache/pin/{pin_id}")
    async def unpin_prefix(pin_id: str) -> cache_pins.PinDeleted:
        return await cache_pins.unpin(ctx, pin_id)

    @app.get("/v1/cache")
    async def cache_info() -> cache_pins.CacheInfo:
        return await cache_pins.cache_info(ctx)

    return app


async def _serve(endpoint: ModuleType, ctx: ServerContext, body: Any, request: Request) -> Response | Any:
    """Submit, then stream or answer at the end. ``endpoint`` is the chat or completions module."""
    gen: Generation = await endpoint.prepare(ctx, body)
    gen.bind(request)  # X-Request-Id, and the caller's tenant for the cache salt
    await gen.submit()
    if body.stream:
        return _EventStream(endpoint.stream(ctx, body, gen), gen.abort)
    try:
        result = await unless_disconnected(request, endpoint.complete(ctx, body, gen))
    finally:
        gen.abort()  # no-op when it finished
    if result is None:
        return Response(status_code=_CLIENT_CLOSED)
    return result
