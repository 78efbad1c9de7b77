"""uvicorn's HTTP/1.1 protocol with a deadline on request heads, and the uvicorn config around it.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not a
connection that sends part of a request head and then nothing: it stays open until
the client goes, and only the process's file-descriptor limit bounds how many do.
Here a connection has ``read_timeout_s`` to deliver a complete request head,
counted from when it opened or from the end of its previous response; past that it
is closed (with a JSON 408 when part of a head had arrived). The body is bounded
separately, by the Gate (guard.py). Head size is bounded by h11 (``MAX_HEAD_BYTES``),
and a malformed head gets a JSON 400 instead of uvicorn's plain text.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedrs.server.errors import error_body
from pagedrs.server.options import ServerOptions

MAX_HEAD_BYTES = 64 * 1024  # request line + headers
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's default)
CLOSE_GRACE_S = 2  # once the drain (shutdown.py) is over, how long uvicorn waits for connections to close


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for use outside h11's state machine."""
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    read_timeout_s: float = ServerOptions().read_timeout_s

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._head_timer: Any = None
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a complete request head arrived
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_head_timer()  # before super(): it may go on to a pipelined request
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw_json_response(400, "Bad Request", f"{msg} (malformed HTTP request head)"))
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # gone already, or the app is answering a request
        partial_head = self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
        if partial_head:
            message = f"The request head did not arrive within --read-timeout={self.read_timeout_s:g} s"
            self.transport.write(_raw_json_response(408, "Request Timeout", message))
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, log_level: str, options: ServerOptions) -> Any:
    """The one uvicorn configuration for `pagedrs serve` and BackgroundServer alike."""
    import uvicorn

    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout_s": options.read_timeout_s})
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="off", http=protocol,
        timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=CLOSE_GRACE_S,
    )
