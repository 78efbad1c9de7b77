"""The gate in front of the app: authentication, draining, body limits, and a last-resort JSON 500.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers and
re-wraps streaming responses). In order, for every HTTP request:

1. ``/v1/*`` (and ``/metrics`` unless public) need ``Authorization: Bearer <key>``: 401.
2. While the server drains, new requests get 503 (``/health`` answers for itself).
3. A declared ``Content-Length`` above the limit gets 413 before any byte is read; the
   body as it streams in is counted too, so a chunked upload cannot get past the limit,
   and it must arrive within the read timeout (408).
4. Any exception that escapes the app is logged and answered with a JSON 500 when no
   response has started. It is not re-raised: uvicorn would answer a re-raised exception
   by closing the connection, so one bad request would cost the client its keep-alive.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

from pagedrs.server.errors import APIError
from pagedrs.server.options import ServerOptions
from pagedrs.server.shutdown import DrainState

logger = logging.getLogger("pagedrs.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_OPEN_PATHS = ("/health",)  # answered even while draining, and without a key


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once the streamed body passes the limit.

    An HTTPException, because FastAPI turns any other exception raised while it reads
    the body into a generic 400 "There was an error parsing the body".
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than --max-request-bytes={limit} bytes")


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408, f"The request body did not arrive within --read-timeout={timeout_s:g} s",
            headers={"Connection": "close"},
        )


class Gate:
    def __init__(self, app: Any, options: ServerOptions, drain: DrainState) -> None:
        self.app = app
        self.options = options
        self.drain = drain
        self._key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
            with self.drain.in_flight(scope["path"] not in _OPEN_PATHS):
                await self.app(scope, self._limited(receive), tracked_send)
        except Exception:  # noqa: BLE001 - the last resort: answer JSON, keep the connection
            logger.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if not started:
                error = APIError(500, "internal server error; the server log has the details")
                await error.response()(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        path: str = scope["path"]
        if self._needs_key(path):
            problem = self._key_problem(_header(scope, b"authorization"))
            if problem is not None:
                return APIError(401, problem, code="invalid_api_key")
        if self.drain.draining and path not in _OPEN_PATHS:
            return APIError(503, "The server is shutting down; retry on another instance",
                            code="server_shutting_down")
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, f"Content-Length {length!r} is not a non-negative integer")
            if int(length) > self.options.max_request_bytes:
                return APIError(
                    413, f"The request body has {int(length)} bytes; --max-request-bytes is "
                    f"{self.options.max_request_bytes}", code="request_too_large",
                )
        return None

    def _needs_key(self, path: str) -> bool:
        if self._key is None:
            return False
        return path.startswith("/v1/") or path == "/v1" or (path == "/metrics" and not self.options.metrics_public)

    def _key_problem(self, authorization: str | None) -> str | None:
        """None when the header carries the key; otherwise what is wrong with it."""
        if authorization is None:
            return "Missing API key: send it as the header 'Authorization: Bearer <key>'"
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "Malformed Authorization header: expected 'Bearer <key>'"
        assert self._key is not None
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self._key):
            return "Incorrect API key provided"
        return None

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that counts body bytes against the limit and bounds the time the body takes."""
        limit, timeout_s = self.options.max_request_bytes, self.options.read_timeout_s
        deadline = time.monotonic() + timeout_s
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # later calls only wait for the disconnect: no deadline there
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyTimeout(timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        return limited_receive


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
