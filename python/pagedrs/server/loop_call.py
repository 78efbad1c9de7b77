"""A call that runs on the engine thread between two steps: how an admin endpoint (a reset of
the prefix cache) reaches an Engine that only that thread may touch.

The handler awaits ``result``; the loop runs ``fn(engine)`` when it applies its commands, so
the call sees the engine between steps, with the aborts and adds sent before it applied.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedrs.core.protocol import is_engine_fatal


@dataclass
class LoopCall:
    fn: Callable[[Any], Any]  # takes the engine; its return value or exception goes to ``result``
    result: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)

    def run(self, engine: Any) -> None:
        """On the engine thread. An error that ends the engine still ends the loop (re-raised)."""
        try:
            self.result.set_result(self.fn(engine))
        except BaseException as exc:  # noqa: BLE001 - the handler gets it
            self.result.set_exception(exc)
            if is_engine_fatal(exc):
                raise

    def cancel(self, why: str) -> None:
        """The loop stopped before running it."""
        if not self.result.done():
            self.result.set_exception(RuntimeError(why))
