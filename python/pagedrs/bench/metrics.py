"""Turn a run's per-step timeline into the numbers every throughput table reports.

One definition serves every system (pagedrs paged, pagedrs contiguous, transformers):

* ``tokens_per_s``      generated tokens / wall seconds of the generation loop
* ``requests_per_s``    finished requests / wall seconds
* ``peak_concurrency``  most sequences holding KV memory in one step
* ``kv_utilization``    live token slots / reserved token slots, weighted by step duration
  (the share of the memory-time a system held that stored a token it needed);
  ``kv_waste_pct`` = 100 * (1 - kv_utilization)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Timeline:
    """One entry per step, all the same length."""

    t: list[float]  # seconds since start, at the end of the step
    running: list[int]  # sequences holding KV memory
    reserved_slots: list[int]  # token slots allocated to sequences
    live_slots: list[int]  # token slots holding a token some sequence still needs

    def __post_init__(self) -> None:
        n = len(self.t)
        if not (len(self.running) == len(self.reserved_slots) == len(self.live_slots) == n):
            raise ValueError(
                f"Timeline fields must have equal length; got t={n}, running={len(self.running)}, "
                f"reserved_slots={len(self.reserved_slots)}, live_slots={len(self.live_slots)}"
            )

    def durations(self) -> np.ndarray:
        t = np.asarray(self.t, dtype=np.float64)
        return np.diff(np.concatenate([[0.0], t])) if len(t) else t

    def step_utilization(self) -> np.ndarray:
        """Per-step live/reserved, over the steps that reserved anything."""
        res = np.asarray(self.reserved_slots, dtype=np.float64)
        live = np.asarray(self.live_slots, dtype=np.float64)
        mask = res > 0
        return live[mask] / res[mask]


def time_weighted_utilization(tl: Timeline) -> float:
    dt = tl.durations()
    reserved = float(np.dot(dt, np.asarray(tl.reserved_slots, dtype=np.float64)))
    live = float(np.dot(dt, np.asarray(tl.live_slots, dtype=np.float64)))
    return live / reserved if reserved > 0 else 0.0


def downsample(tl: Timeline, max_points: int = 240) -> dict[str, list[float]]:
    """The timeline as JSON-ready lists, at most ``max_points`` evenly spaced steps."""
    n = len(tl.t)
    idx = np.unique(np.linspace(0, n - 1, num=min(n, max_points)).astype(int)) if n else np.array([], int)
    return {
        "t": [round(tl.t[i], 4) for i in idx],
        "running": [tl.running[i] for i in idx],
        "reserved_slots": [tl.reserved_slots[i] for i in idx],
        "live_slots": [tl.live_slots[i] for i in idx],
    }


def summarize(
    *,
    wall_s: float,
    num_requests: int,
    num_output_tokens: int,
    num_prompt_tokens: int,
    timeline: Timeline,
    bytes_per_token: int,
) -> dict[str, object]:
    util = time_weighted_utilization(timeline)
    dt = timeline.durations()
    seq_time = float(np.dot(dt, np.asarray(timeline.running, dtype=np.float64)))
    live_time = float(np.dot(dt, np.asarray(timeline.live_slots, dtype=np.float64)))
    step_ms = np.diff(np.concatenate([[0.0], np.asarray(timeline.t)])) * 1e3 if timeline.t else np.zeros(1)
    return {
        "tokens_per_s": num_output_tokens / wall_s,
        "total_tokens_per_s": (num_output_tokens + num_prompt_tokens) / wall_s,
        "requests_per_s": num_requests / wall_s,
        "peak_concurrency": int(max(timeline.running, default=0)),
        "mean_concurrency": float(np.mean(timeline.running)) if timeline.running else 0.0,
        "kv_utilization": util,
        "kv_waste_pct": 100.0 * (1.0 - util),
        # paged waste is the unfilled tail of each last block, ~ (block_size / 2) / this
        "mean_live_tokens_per_seq": live_time / seq_time if seq_time > 0 else 0.0,
        "median_step_ms": float(np.median(step_ms)),
        "peak_kv_reserved_bytes": int(max(timeline.reserved_slots, default=0)) * bytes_per_token,
        "wall_s": wall_s,
        "num_steps": len(timeline.t),
        "num_output_tokens": num_output_tokens,
        "num_requests": num_requests,
        "utilization_per_step": [round(float(u), 4) for u in timeline.step_utilization()],
        "timeline": downsample(timeline),
    }
