"""One HTTP request run through an ASGI app in this process, its response as a stream.

The replica runs the server's own FastAPI app (one implementation of the protocol, its
limits, its errors and its SSE); the ingress hands it the request as a ``ForwardedRequest``
and relays what comes back: a ``ResponseStart``, then body chunks. When the caller stops
reading (the HTTP client went away, so Ray cancels the stream), the app's ``receive``
answers ``http.disconnect``: the server's own disconnect handling aborts the engine request
and frees its pages, as it does behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] = ("ray-ingress", 0)
    # what routing="ray-prefix" matches (Ray's PrefixCacheAffinityRouter reads ``arg.prompt``): the
    # prompt's token ids as one character each; "" for the other routings and for non-prompt requests
    prompt: str = ""


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def scope_of(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": "http", "path": request.path, "raw_path": request.path.encode("latin-1"),
        "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
        "client": request.client, "server": ("pagedrs-replica", 0),
    }


async def forward(app: Any, request: ForwardedRequest) -> AsyncIterator[Union[ResponseStart, bytes]]:
    """Runs ``request`` through ``app``; yields its ResponseStart, then its body chunks."""
    sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope_of(request), receive, send)
        finally:
            await sent.put({"type": "pagedrs.done"})

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await sent.get()
            kind = message["type"]
            if kind == "http.response.start":
                yield ResponseStart(int(message["status"]), [tuple(h) for h in message.get("headers", [])])
            elif kind == "http.response.body":
                chunk = bytes(message.get("body", b""))
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    break
            elif kind == "pagedrs.done":
                break
        await task  # an app error after the body surfaces here
    finally:
        gone.set()  # the reader left early: the app sees the client go
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            task.cancel()
