"""``AsyncExecution``: an executor whose steps complete asynchronously, for asynchronous scheduling.

One worker thread runs the steps in the order they are launched (a device stream's order), so
step N+1's transfers, copies and forward come after step N's. ``launch(step, after)`` returns a
``Future`` of the logits at once; the job first waits for ``after`` — the previous step's drawn
tokens (``token_fill.DrawnTokens``) — and fills the step's placeholder input ids from them: host
values at once, tokens still on the device by a ``DeviceFill`` the runner applies on the device
(executor/token_fill.py). If ``after`` fails, the job runs nothing and fails too: a step planned
on top of a failed one must not write anything.

Everything else of the ``Executor`` protocol passes through to the wrapped executor, serialized
with the worker where it touches the runner (``execute`` runs on the worker too).

On a GPU the worker returns once the step's kernels are enqueued (the logits are still being
computed); the core's sampling then waits for them. When every placeholder's token comes from the
plain rows' batched draw (a steady decode batch), the core publishes the drawn ids while they are
still on the device, so the next step's kernels are enqueued right behind the sampling kernels,
and the tokens' one copy to the host (on a side stream, core/drawn_ids.py) overlaps them; rows
drawn the generic way are published once drawn on the host.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, cast

import torch

from pagedrs.executor.base import Executor
from pagedrs.executor.token_fill import DeviceFill, fill_placeholders
from pagedrs.step_input import StepInput

__all__ = ["AsyncExecution", "fill_placeholders"]


class AsyncExecution:
    """Wraps an ``Executor``; see the module docs."""

    def __init__(self, inner: Executor) -> None:
        self._inner = inner
        device = getattr(inner, "device", None)
        # a thread's current CUDA device is its own: the worker runs on the executor's
        initializer = (lambda: torch.cuda.set_device(device)) if isinstance(device, torch.device) and device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrs-step", initializer=initializer)
        self._lock = threading.Lock()
        self._completed: list[int] = []

    def __getattr__(self, name: str) -> Any:  # loaded, plan_kv_memory, disk_tier, memory_bytes, ...
        return getattr(self._inner, name)

    @property
    def inner(self) -> Executor:
        return self._inner

    def launch(self, step: StepInput, after: Optional[Future]) -> Future:
        """Future[torch.Tensor]: the step's logits, once the worker ran it after ``after``."""
        return self._worker.submit(self._run, step, after)

    def execute(self, step: StepInput) -> torch.Tensor:
        return self.launch(step, None).result()

    def _run(self, step: StepInput, after: Optional[Future]) -> torch.Tensor:
        fill: Optional[DeviceFill] = None
        if after is not None:
            step, fill = fill_placeholders(step, after.result())  # raises: the step before failed, run nothing
        try:
            if fill is None:
                return self._inner.execute(step)
            if getattr(self._inner, "fills_on_device", False):  # (not in the Executor protocol: an opt-in)
                return cast(Any, self._inner).execute(step, fill=fill)
            return self._inner.execute(fill.materialize(step))  # an executor that reads its ids on the host
        finally:
            done = self._inner.take_completed_transfers()
            with self._lock:
                self._completed.extend(done)

    def take_completed_transfers(self) -> list[int]:
        with self._lock:
            done, self._completed = self._completed, []
        return done

    def stop(self) -> None:
        """Waits for the steps launched and stops the worker (the wrapped executor stays up)."""
        self._worker.shutdown(wait=True)

    def shutdown(self) -> None:
        self.stop()
        self._inner.shutdown()
