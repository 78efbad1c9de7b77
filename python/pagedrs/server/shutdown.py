"""Graceful drain on SIGTERM / SIGINT, with a deadline.

::

    signal 1 ──► draining: new requests get 503, in-flight ones keep generating
                 │
                 ├─ all in-flight requests done ─────────────────────────────► exit 0
                 └─ --shutdown-timeout passed: abort the rest in the engine ──┐
    signal 2 ──► (at once) abort the rest in the engine ──────────────────────┤
                   each client gets an OpenAI error (JSON, or an SSE error     │
                   event then [DONE]); every page is freed                     ▼
                                                     responses written (≤ FLUSH_S) ► exit 0

A dead engine (its core process killed, a worker failed) stops a server built with
``exit_when_engine_dies`` (``pagedrs serve``): the failed requests' error responses get up
to FLUSH_S to be written, then the server stops and ``engine_died`` tells the CLI to exit
non-zero, so that its supervisor restarts it. An embedded server keeps answering, /health 503.

uvicorn's own handling would wait for every generation (its graceful shutdown has
no deadline by default) and then re-raise the signal, so the process would end
"killed by SIGTERM" rather than exit 0; a forced stop cancels handlers, which
uvicorn answers with a plain-text 500.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("pagedrs.server")

# After aborting, how long the handlers get to write their error responses before the
# server stops anyway.
FLUSH_S = 2.0
SHUTDOWN_MESSAGE = "The server is shutting down: the request was aborted before it finished"


class DrainState:
    """Whether the server drains, and how many requests are in flight (event-loop thread only)."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0

    @contextlib.contextmanager
    def in_flight(self, counted: bool = True) -> Iterator[None]:
        self.active += counted
        try:
            yield
        finally:
            self.active -= counted


def draining_server(
    config: Any, drain: DrainState, engine_loop: Any, shutdown_timeout_s: float, *, exit_when_engine_dies: bool = False,
) -> Any:
    """A ``uvicorn.Server`` that drains as the module docstring says (uvicorn imported lazily)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self.signals_received = 0
            self._deadline: float | None = None  # when in-flight requests get aborted
            self._stop_at: float | None = None  # set once aborted: stop even if handlers lag
            self.engine_died = False  # stopped because the engine can never step again

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach the main thread only (BackgroundServer runs elsewhere)
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals_received += 1
            if self.signals_received == 1:
                self.begin_drain()
            else:
                logger.warning("second signal: aborting %d in-flight requests now", drain.active)
                self._deadline = time.monotonic()

        def begin_drain(self) -> None:
            if drain.draining:
                return
            drain.draining = True
            self._deadline = time.monotonic() + shutdown_timeout_s
            logger.warning(
                "draining: %d requests in flight, new ones get 503; aborting what is left in %g s",
                drain.active, shutdown_timeout_s,
            )

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            now = time.monotonic()
            if exit_when_engine_dies and not self.engine_died and engine_loop.engine_dead:
                self.engine_died = True
                self._deadline = self._stop_at = now + FLUSH_S  # its requests failed: let their errors out
                logger.error("the engine is dead (%s): stopping the server so that its supervisor restarts it",
                             engine_loop.fatal_error)
            if self._deadline is None:
                return False
            if drain.active == 0:
                return True
            if self._stop_at is None and now >= self._deadline:
                logger.warning("drain deadline: aborting %d in-flight requests", drain.active)
                engine_loop.fail_all(SHUTDOWN_MESSAGE, status=503)
                self._stop_at = now + FLUSH_S
            return self._stop_at is not None and now >= self._stop_at

    return DrainingServer()
