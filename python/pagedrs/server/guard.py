"""The gate in front of the app: authentication, draining, body limits, and a last-resort JSON 500.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers and
re-wraps streaming responses). In order, for every HTTP request:

1. When keys are configured, every path but ``/health`` and the API's own description
   (``/openapi.json``, ``/docs``, ``/redoc``) needs ``Authorization: Bearer <key>`` with one of
   the tenants' keys (401), as vLLM does: ``/v1/*``, and ``/tokenize`` and ``/detokenize`` too,
   which share the tokenizer threads with ``/v1`` (open, they would let anyone stall the tenants'
   requests with huge texts). The request's tenant goes to ``scope["state"]["tenant"]``
   (``request.state.tenant``). Admin endpoints (``/metrics``, unless public) take the admin key
   when one is set, else any key.
2. While the server drains, new requests get 503 (``/health`` answers for itself).
3. A declared ``Content-Length`` above the limit gets 413 before any byte is read; the
   body as it streams in is counted too, so a chunked upload cannot get past the limit,
   and it must arrive within the read timeout (408).
4. Any exception that escapes the app is logged and answered with a JSON 500 when no
   response has started. It is not re-raised: uvicorn would answer a re-raised exception
   by closing the connection, so one bad request would cost the client its keep-alive.

Every response to a request with an ``X-Request-Id`` header carries that header back, as given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

from pagedrs.server.errors import APIError
from pagedrs.server.options import ServerOptions
from pagedrs.server.shutdown import DrainState
from pagedrs.server.tenants import tenant_of

logger = logging.getLogger("pagedrs.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_OPEN_PATHS = ("/health",)  # answered even while draining, and without a key
# Open without a key too (the docs say so): what the API is, never anything it does.
_PUBLIC_PATHS = (*_OPEN_PATHS, "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
ADMIN_PATHS = ("/metrics",)  # the operator's: the admin key when one is set (the counters span every tenant)
# The cache's admin endpoints (server/cache_admin.py): the admin key when one is set, else any
# tenant's key, and never open: a server started without any key refuses them (403).
CACHE_ADMIN_PATHS = ("/reset_prefix_cache", "/v1/cache")


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
        self._keys = options.tenants()  # key -> tenant
        self._admin = {options.admin_api_key: "admin"} if options.admin_api_key else {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        request_id = _raw_header(scope, b"x-request-id")

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if request_id is not None:
                    message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, tracked_send)
                return
            with self.drain.in_flight(scope["path"] not in _OPEN_PATHS):
                await self.app(scope, self._limited(receive), tracked_send)
        except Exception:  # noqa: BLE001 - the last resort: answer JSON, keep the connection
            logger.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if not started:
                error = APIError(500, "internal server error; the server log has the details")
                await error.response()(scope, receive, tracked_send)

    def _refusal(self, scope: Scope) -> APIError | None:
        path: str = scope["path"]
        keys = self._keys_for(path)
        if not keys and _is_cache_admin(path):
            return APIError(403, f"{path} is an admin endpoint and this server has no key to open it: start it "
                            "with --admin-api-key (or --api-key)", code="admin_key_required")
        if keys:
            tenant, problem = self._authenticate(_header(scope, b"authorization"), keys)
            if problem is not None:
                return APIError(401, problem, code="invalid_api_key")
            scope.setdefault("state", {})["tenant"] = tenant
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

    def _keys_for(self, path: str) -> dict[str, str]:
        """The keys that open ``path`` (key -> tenant); empty when it is open to anyone."""
        if path in ADMIN_PATHS:
            return {} if self.options.metrics_public else (self._admin or self._keys)
        if _is_cache_admin(path):
            return self._admin or self._keys
        return {} if path in _PUBLIC_PATHS else self._keys

    @staticmethod
    def _authenticate(authorization: str | None, keys: dict[str, str]) -> tuple[str | None, str | None]:
        """(tenant, None) when the header carries one of ``keys``; otherwise (None, what is wrong with it)."""
        if authorization is None:
            return None, "Missing API key: send it as the header 'Authorization: Bearer <key>'"
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "Malformed Authorization header: expected 'Bearer <key>'"
        tenant = tenant_of(token.strip(), keys)
        if tenant is None:
            return None, "Incorrect API key provided"
        return tenant, None

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


def _is_cache_admin(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in CACHE_ADMIN_PATHS)


def _raw_header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    value = _raw_header(scope, name)
    return None if value is None else value.decode("latin-1")
