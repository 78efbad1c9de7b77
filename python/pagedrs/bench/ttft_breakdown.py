"""Where a served request's time to first token goes, part by part (``pagedrs bench serve``).

The client stamps when it sent each request and when its first chunk came back; the server's
request trace (``pagedrs serve --request-trace``) stamps the rest on the same clock
(``time.monotonic``). Joined on the request id, a request's TTFT splits into parts that add
up to it exactly::

    client sent ─► API took it ─► engine took it ─► first step starts ─► first token ─► API dispatched ─► client got it
       http + parse + tokenize │ step in flight │  admission wait    │ its step(s)    │ core → API    │ SSE → client
         "client_to_api"       │  "handoff"     │    "queue"         │  "prefill"     │ "core_to_api" │ "api_to_client"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

# (part, the trace/client field it starts at, the one it ends at)
PARTS = (
    ("client_to_api", "client_sent", "api_arrival"),
    ("handoff", "api_arrival", "queued"),
    ("queue", "queued", "first_scheduled"),
    ("prefill", "first_scheduled", "first_token"),
    ("core_to_api", "first_token", "dispatched"),
    ("api_to_client", "dispatched", "client_first"),
)
COUNTS = ("num_steps_queued", "num_prefill_steps")


@dataclass(frozen=True)
class Timeline:
    """One request's stamps, client and server."""

    request_id: str
    stamps: dict[str, float]
    counts: dict[str, int]

    @property
    def ttft(self) -> float:
        return self.stamps["client_first"] - self.stamps["client_sent"]

    def part(self, name: str) -> float:
        _, start, end = next(p for p in PARTS if p[0] == name)
        return self.stamps[end] - self.stamps[start]


def read_trace(path: str) -> dict[str, dict[str, Any]]:
    """Trace lines by the client's X-Request-Id (the server appends ``-<random>-<prompt index>``).

    A line that is not a JSON object with a string ``request_id`` (the torn last line of a server
    killed mid-write, say) is skipped: its request then has no breakdown, and the run's numbers stand."""
    lines: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and isinstance(line.get("request_id"), str):
                lines[line["request_id"].rsplit("-", 2)[0]] = line
    return lines


def join(client_times: dict[str, tuple[float, float, bool]], trace: dict[str, dict[str, Any]],
         steady_only: bool = True) -> list[Timeline]:
    """Timelines of the requests both sides saw (only those that arrived at a full server by default)."""
    timelines = []
    for request_id, (sent, first, steady) in client_times.items():
        line = trace.get(request_id)
        if line is None or (steady_only and not steady) or any(line.get(k) is None for _, _, k in PARTS[1:5]):
            continue
        stamps = {"client_sent": sent, "client_first": first,
                  **{k: float(line[k]) for k in ("api_arrival", "queued", "first_scheduled", "first_token", "dispatched")}}
        timelines.append(Timeline(request_id, stamps, {k: int(line[k] or 0) for k in COUNTS}))
    return timelines


def summarize(timelines: list[Timeline]) -> dict[str, Any]:
    """p50 / p99 of each part and of the TTFT, and the mean parts of the slowest 5% (what the p99 is made of)."""
    if not timelines:
        return {}
    ttfts = np.array([t.ttft for t in timelines])
    slow = [t for t in timelines if t.ttft >= np.percentile(ttfts, 95)]
    out: dict[str, Any] = {"requests": len(timelines)}
    for name in ["ttft", *(p[0] for p in PARTS), *COUNTS]:
        values = np.array([_value(t, name) for t in timelines], dtype=float)
        out[name] = {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
                     "slowest_5pct_mean": float(np.mean([_value(t, name) for t in slow]))}
    return out


def _value(t: Timeline, name: str) -> float:
    if name == "ttft":
        return t.ttft
    if name in COUNTS:
        return float(t.counts[name])
    return t.part(name)


def render(summary: dict[str, Any]) -> list[str]:
    """Markdown rows: part | p50 | p99 | slowest 5% mean."""
    if not summary:
        return ["(no request trace joined)"]
    rows = ["| part | p50 | p99 | mean of the slowest 5% |", "|---|---|---|---|"]
    for name in ["ttft", *(p[0] for p in PARTS), *COUNTS]:
        v = summary[name]
        fmt = "{:.0f}" if name in COUNTS else "{:.3f} s"
        rows.append(f"| {name} | {fmt.format(v['p50'])} | {fmt.format(v['p99'])} | {fmt.format(v['slowest_5pct_mean'])} |")
    return rows
