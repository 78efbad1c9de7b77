"""Errors that end the engine, as types (a request's own failure ends that request only).

``EngineDeadError``: the engine cannot go on — its executor is gone, or the core's
scheduler failed while it planned a step and may be in no known state. Every request
ends; a server answers 503 and exits (see server/engine_loop.py). ``fatal`` is kept for
the serving loop's existing check.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run another step; every request has ended."""

    fatal = True
