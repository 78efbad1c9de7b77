"""One helper for the engine's hardening rule: a failed operation leaves nothing behind.

    with Rollback() as undo:
        core.add_sequence(...)               # a change the core made
        undo(lambda: core.finish(seq_id))    # how to take it back
        registry[key] = value
        undo(lambda: registry.pop(key))

On any exception inside the block the undo actions run newest first, then the exception
propagates. Build every Python-side object before the block and touch the core last
inside it, so the only changes to undo are the few made after the core call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Optional

logger = logging.getLogger("pagedrs.engine")


class Rollback:
    def __init__(self) -> None:
        self._actions: list[Callable[[], object]] = []

    def __call__(self, action: Callable[[], object]) -> None:
        """Registers how to undo a change that just succeeded."""
        self._actions.append(action)

    def __enter__(self) -> Rollback:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if exc_type is None:
            return
        for action in reversed(self._actions):
            try:
                action()
            except Exception:  # noqa: BLE001 - keep undoing; the original error is what the caller sees
                logger.exception("rollback action failed while undoing after %s", exc_type.__name__)
