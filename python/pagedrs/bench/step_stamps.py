"""Stamping an engine's step at its part boundaries (``stamped``) and splitting one step's stamps into the
parts ``pagedrs bench overhead`` reports (``split_step``).

Apart from overhead.py, which runs the workload and fits the line through two depths, because this is
the instrument, not the measurement: it wraps the scheduler, the model, the executor and the sampler in
place for as long as a ``with`` lasts and undoes every wrapper on exit, and it is where the part
boundaries (the diagram in overhead.py) are defined.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class _Stamps:
    """Named perf_counter stamps of the step being timed (a name stamped twice keeps its first)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}  # time.perf_counter
        self.cpu: dict[str, float] = {}  # time.thread_time: this thread's CPU time (torch's one thread)
        self.counts: dict[str, int] = {}

    def stamp(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        self.at.setdefault(name, time.perf_counter())
        self.cpu.setdefault(name, time.thread_time())

    def clear(self) -> None:
        self.at.clear()
        self.cpu.clear()
        self.counts.clear()

    def around(self, fn: Callable[..., Any], start: str, end: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.stamp(start)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stamp(end)

        return wrapper


class _TimedScheduler:
    """The core's scheduler with ``schedule`` stamped (a pyclass's methods cannot be patched)."""

    def __init__(self, inner: Any, stamps: _Stamps) -> None:
        self._inner = inner
        self.schedule = stamps.around(inner.schedule, "schedule", "schedule_end")
        self.complete_step = stamps.around(inner.complete_step, "complete", "complete_end")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _TimedModel:
    """The runner's model with the forward pass and the output head stamped."""

    def __init__(self, inner: Any, stamps: _Stamps) -> None:
        self._inner = inner
        self._call = stamps.around(inner, "forward", "forward_end")
        self.compute_logits = stamps.around(inner.compute_logits, "head", "head_end")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def stamped(engine: Any, stamps: _Stamps) -> Iterator[None]:
    """Stamps the part boundaries of every step ``engine`` runs while inside (undone on exit)."""
    import pagedrs.core.step as step_module

    core = engine.core
    runner = core.executor.runner
    scheduler, model, sample_fn = core.scheduler, runner.model, step_module._sample
    core.scheduler = _TimedScheduler(scheduler, stamps)
    runner.model = _TimedModel(model, stamps)
    core.executor.execute = stamps.around(core.executor.execute, "execute", "execute_end")
    core.step = stamps.around(core.step, "core", "core_end")
    step_module._sample = stamps.around(sample_fn, "sampling", "sampling_end")  # type: ignore[attr-defined]
    graphs = runner.graphs  # CUDA graphs: a replay is the forward pass and the head (head stamped as empty)
    if graphs is not None:
        timed_replay = stamps.around(graphs.replay, "forward", "forward_end")

        def replay(step: Any) -> Any:
            out = timed_replay(step)
            stamps.stamp("head")
            stamps.stamp("head_end")
            return out

        graphs.replay = replay
    try:
        yield
    finally:
        core.scheduler, runner.model, step_module._sample = scheduler, model, sample_fn
        del core.executor.execute, core.step
        if graphs is not None:
            del graphs.replay


def split_step(at: dict[str, float], start: float, end: float) -> dict[str, float]:
    """Seconds of each part (PARTS, DETAIL) and of the step, from one step's stamps."""
    parts = {
        "schedule": at["schedule_end"] - at["schedule"],
        "inputs": at["forward"] - at["schedule_end"],
        "runner": at["execute_end"] - at["forward"],
        # the step is reported done (complete_step) after its draw, so that in "output"
        "sampling": at["sampling_end"] - at["execute_end"],
        "output": (at["schedule"] - start) + (at["core_end"] - at["sampling_end"]),
        "frontend": end - at["core_end"],
        "forward": at["forward_end"] - at["forward"],
        "head": at["head_end"] - at["head"],
    }
    parts["step"] = end - start
    parts["core"] = parts["step"] - parts["frontend"]
    return parts
