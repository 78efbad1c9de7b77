"""How the engine loop refuses or ends a request it cannot serve: the exception types a handler
gets from ``EngineLoop.add`` and the ``error_code`` values of error deltas.

Their own module so that ``server/errors.py`` maps them to HTTP answers without importing the
loop itself.
"""

from __future__ import annotations

__all__ = ["ENGINE_DEAD", "ENGINE_UNRESPONSIVE", "REQUEST_TIMEOUT", "DeadEngineRefusal", "RequestTimeoutError",
           "UnresponsiveEngineRefusal"]


class DeadEngineRefusal(Exception):
    """A request refused because the engine is dead (an ``EngineDeadError``).

    Not a RuntimeError, as ``EngineDeadError`` is: handlers answer a RuntimeError from a
    stopped loop as "shutting down, retry later" (503 server_unavailable, "overloaded"),
    and a dead engine is not overloaded (the app answers this one 503 engine_dead).
    """


class UnresponsiveEngineRefusal(Exception):
    """A request refused because the engine core has been silent past ``--core-timeout`` (stopped, hung,
    starved): answered 503 ``engine_unresponsive`` at once, as ``/health`` is, instead of queued behind a
    core that may never answer (the client waited until it gave up)."""


class RequestTimeoutError(TimeoutError):
    """A request had no finished output within the loop's ``request_timeout_s`` (HTTP 504)."""


# error_code of the error deltas (OpenAI's `code`)
ENGINE_DEAD, ENGINE_UNRESPONSIVE, REQUEST_TIMEOUT = "engine_dead", "engine_unresponsive", "request_timeout"
