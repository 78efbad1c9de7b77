"""Run an app under uvicorn on a background thread, with a bounded start and stop."""

from __future__ import annotations

import threading
import time
from typing import Any

from pagedrs.net import free_port
from pagedrs.server.connection import uvicorn_config
from pagedrs.server.options import ServerOptions

__all__ = ["BackgroundServer", "free_port"]  # free_port is pagedrs.net's, also importable from here


class BackgroundServer:
    """``with BackgroundServer(app) as server: server.url ...`` — uvicorn on a daemon thread.

    The same protocol, timeouts and drain as `pagedrs serve` (``options`` default to the
    app's own); ``drain()`` does what SIGTERM does there, since signals reach only the
    main thread.
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
        options: ServerOptions | None = None,
    ) -> None:
        from pagedrs.server.shutdown import draining_server

        self.host = host
        self.port = port or free_port(host)
        options = options or getattr(app.state, "options", None) or ServerOptions()
        config = uvicorn_config(app, self.host, self.port, log_level, options)
        ctx = app.state.ctx
        self._server = draining_server(config, app.state.drain, ctx.engine_loop, options.shutdown_timeout_s)
        self._thread = threading.Thread(target=self._server.run, name="pagedrs-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"uvicorn exited before listening on {self.url}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start listening on {self.url} within {timeout_s} s")
            time.sleep(0.02)
        return self

    def drain(self) -> None:
        """Begin the graceful drain (what the first SIGTERM does); the server stops by itself after."""
        self._server.begin_drain()

    def join(self, timeout_s: float) -> bool:
        """Wait for the server thread to end; True when it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
