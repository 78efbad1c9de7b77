"""The server's engine with its core in its own process: ``Engine`` on the multiprocess
client (frontend/mp_client.py), plus what the serving loop needs of a core it cannot see.

``RemoteEngine`` is an ``Engine`` whose core runs in a child process: the API process
validates and tokenizes (InputProcessor), makes every text (OutputProcessor), and talks to
the core through ``MPClient`` on the typed protocol. Everything the serving loop calls is
the Engine's own API (``submit``, ``abort``, ``step``, ``liveness``, ``check_alive``); this
class adds the core process's timings to the stats and its pid and exit code.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedrs.core.protocol import EngineCoreDeadError, EngineCoreError
from pagedrs.engine import Engine
from pagedrs.engine_args import EngineArgs
from pagedrs.frontend.core_pipe import heartbeat_interval
from pagedrs.frontend.mp_client import MPClient
from pagedrs.server.options import DEFAULT_CORE_TIMEOUT_S

__all__ = ["EngineCoreDeadError", "EngineCoreError", "RemoteEngine", "heartbeat_interval"]

class RemoteEngine(Engine):
    """Called from one thread (the EngineLoop's), like the Engine itself, except ``submit``
    (from any thread, as on every Engine)."""

    def __init__(
        self, args: EngineArgs, *, start_timeout_s: float = 600.0, core_timeout_s: float = DEFAULT_CORE_TIMEOUT_S,
    ) -> None:
        # _start, not Engine.__init__: the tests' leak check records in-process engines by their __init__
        self._start(args, "mp", None, {"start_timeout_s": start_timeout_s, "core_timeout_s": core_timeout_s})
        assert isinstance(self.client, MPClient)
        self.mp: MPClient = self.client
        self.core_timeout_s = core_timeout_s
        self.core_pid: int = self.mp.ready.pid

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["core_step_seconds"], stats["core_busy_seconds"] = self.mp.step_seconds, self.mp.busy_seconds
        busy = self.mp.busy_seconds
        stats["core_step_fraction"] = self.mp.step_seconds / busy if busy else 0.0
        return stats

    @property
    def exitcode(self) -> Optional[int]:
        return self.mp.exitcode

    def is_alive(self) -> bool:
        return self.mp.is_alive()

    @property
    def pid(self) -> int:
        return self.core_pid
