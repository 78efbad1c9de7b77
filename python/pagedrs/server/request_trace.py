"""``pagedrs serve --request-trace PATH``: one JSON line per request with where its first token's time went.

The /metrics histograms say how long the parts take across requests; a benchmark that wants
each request's parts next to its own client-side times (``pagedrs bench serve``) reads this
file instead, joined on the request id (the ``X-Request-Id`` header it sent). vLLM exports the
same timestamps as OpenTelemetry spans. Every time is ``time.monotonic()``, one clock for
every process on the machine, so the client's own stamps line up with the server's.

A line: ``{"request_id", "api_arrival", "queued", "first_scheduled", "first_token", "dispatched",
"num_steps_queued", "num_prefill_steps"}``: the API process took the request (after parsing and
tokenizing); the engine took it (between two steps, so after the step in flight); its first
step started; its first token was sampled (the end of that step); the API process handed the
token to the HTTP handler; steps that ran without it while it waited; steps it was in up to
and including its first token's.
"""

from __future__ import annotations

import json
import threading
from typing import IO


class RequestTrace:
    """Appends request timing lines to a file; any thread may call ``record``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def record(self, request_id: str, api_arrival: float, metrics: dict[str, float], dispatched: float) -> None:
        line = {
            "request_id": request_id,
            "api_arrival": api_arrival,
            "queued": metrics.get("queued_time"),
            "first_scheduled": metrics.get("first_scheduled_time"),
            "first_token": metrics.get("first_token_time"),
            "dispatched": dispatched,
            "num_steps_queued": metrics.get("num_steps_queued"),
            "num_prefill_steps": metrics.get("num_prefill_steps"),
        }
        with self._lock:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
