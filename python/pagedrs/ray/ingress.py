"""The HTTP entry of the Ray app: it computes each request's route and relays the replica's answer.

Everything the server decides (validation, limits, the API key, errors, SSE) happens in the
replica, in the server's own app (``replica.py``). The ingress does three things only:
- puts the server's own ``Gate`` in front (``server/guard.py``: the API key, the body bound
  ``max_request_bytes`` and its read timeout at the ASGI level, since uvicorn's protocol layer
  (``server/connection.py``) is not in front of Ray's proxy), which also names the caller's tenant;
- computes the route key (``route_key.route_of``) that ``CacheAffinityRouter`` reads (and, for
  ``routing="ray-prefix"``, the prompt as text, which Ray's ``PrefixCacheAffinityRouter`` reads);
- relays the response, and retries once on another replica when the one it chose died
  before its first byte of body (``first_answer``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedrs.ray.asgi import ForwardedRequest, ResponseStart
from pagedrs.ray.replica import ReplicaInfo
from pagedrs.ray.route_key import route_and_text
from pagedrs.server.errors import error_body
from pagedrs.server.guard import Gate
from pagedrs.server.options import ServerOptions
from pagedrs.server.shutdown import DrainState

logger = logging.getLogger(__name__)

DIED_BEFORE_ANSWER_RETRIES = 1


def _error(status: int, message: str, code: str) -> Any:
    return JSONResponse(error_body(status, message, code=code), status_code=status)


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


class NoAnswer(Exception):
    """The replica gave no response to relay: answered as ``status`` / ``code``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


async def first_answer(call: Callable[[], Any], died: Callable[[BaseException], bool],
                       retries: int) -> tuple[Any, ResponseStart, list[bytes]]:
    """Starts the request on a replica (``call()``: a fresh stream, on the replica Ray picks) and reads
    its status line and first body chunk before anything goes to the client. A replica that dies
    before then (``died(exc)``) is replaced by another call, ``retries`` times: the client has seen
    nothing, so a fresh start elsewhere is invisible to it (for a stream, the first chunk is its first
    token, or a chat stream's role chunk, sent at admission). Later failures are ``_body``'s."""
    for attempt in range(retries + 1):
        stream = call()
        try:
            start = await stream.__anext__()
            if not isinstance(start, ResponseStart):
                raise NoAnswer(502, "the replica answered without a status line", "bad_gateway")
            try:
                head = [await stream.__anext__()]
            except StopAsyncIteration:
                head = []
            return stream, start, head
        except StopAsyncIteration:
            stream.cancel()
            raise NoAnswer(502, "the replica closed the response before its status line", "bad_gateway") from None
        except NoAnswer:
            stream.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - a replica that died before its first byte: once more elsewhere
            stream.cancel()  # a replica that is alive stops the request; a dead one has nothing to stop
            if died(exc) and attempt < retries:
                logger.warning("replica died before answering (%s); retrying on another", exc)
                continue
            raise NoAnswer(503, f"the replica failed before answering: {type(exc).__name__}",
                           "replica_unavailable") from exc
    raise AssertionError("unreachable: the last attempt returns or raises")


class PagedrsIngress:
    def __init__(self, replicas: Any, options_kwargs: dict[str, Any], routing: str = "cache") -> None:
        self._routing = routing  # "ray-prefix": each request also carries its prompt as text
        self._replicas = replicas.options(stream=True)
        self._describe = replicas.describe
        self._options = ServerOptions(**options_kwargs)  # the replicas' own (app.py passes both the same)
        self._info: Optional[ReplicaInfo] = None
        self._info_lock = asyncio.Lock()

    async def _replica_info(self) -> ReplicaInfo:
        async with self._info_lock:
            if self._info is None:
                self._info = await self._describe.remote()
            return self._info

    def __serve_build_asgi_app__(self) -> Any:
        app = FastAPI(title="pagedrs (Ray Serve)", openapi_url=None, docs_url=None, redoc_url=None)

        # Ray's proxy drains the replicas itself (graceful_shutdown_timeout_s): this gate never drains.
        app.add_middleware(Gate, options=self._options, drain=DrainState())

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def relay(request: Request, path: str) -> Any:
            body = await request.body()  # bounded and timed by the Gate (413, 408)
            info = await self._replica_info()
            route, text = route_and_text(request.url.path, body, getattr(request.state, "tenant", None), info,
                                         text=self._routing == "ray-prefix")
            forwarded = ForwardedRequest(
                method=request.method, path=request.url.path, query_string=request.url.query.encode("latin-1"),
                headers=[(k.lower(), v) for k, v in request.headers.raw], body=body,
                client=(request.client.host, request.client.port) if request.client else ("unknown", 0),
                prompt=text,
            )
            try:
                stream, start, head = await first_answer(
                    lambda: self._replicas.handle.remote(forwarded, route=route), _replica_died,
                    DIED_BEFORE_ANSWER_RETRIES)
            except NoAnswer as exc:
                return _error(exc.status, str(exc), exc.code)
            # x-request-id: the ingress's own Gate echoes it (the replica's would make it twice)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                       if k.lower() not in (b"content-length", b"transfer-encoding", b"x-request-id")}
            sse = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(self._body(stream, head, sse), status_code=start.status, headers=headers,
                                     media_type=None)

        return app

    @staticmethod
    async def _body(stream: Any, head: list[bytes], sse: bool) -> AsyncIterator[bytes]:
        """The replica's body chunks (``head``: those already read); a replica that dies mid-stream
        ends an SSE stream with an error event, and cuts any other body short (the client sees a
        truncated response, never a hang)."""
        try:
            for chunk in head:
                yield chunk
            async for chunk in stream:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the stream cannot go on: say so, never hang
            logger.warning("replica failed mid-stream: %s", exc)
            if not sse:
                raise
            yield (b'data: {"error": {"message": "the replica serving this stream failed: '
                   + type(exc).__name__.encode() + b'", "type": "server_error", "code": "replica_failed"}}\n\n')
        finally:
            stream.cancel()  # the client left (or the stream ended): the replica aborts the request
