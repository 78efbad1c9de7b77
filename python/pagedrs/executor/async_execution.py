"""``AsyncExecution``: an executor whose steps complete asynchronously, for asynchronous scheduling.

One worker thread runs the steps in the order they are launched (a device stream's order), so
step N+1's transfers, copies and forward come after step N's. ``launch(step, after)`` returns a
``Future`` of the logits at once; the job first waits for ``after`` — the previous step's drawn
tokens, by sequence id — and fills the step's placeholder input ids from it (on a GPU this
fill is a device-side gather from the sampled-ids buffer; here it is the CPU half, the same
contract). If ``after`` fails, the job runs nothing and fails too: a step planned on top of a
failed one must not write anything.

Everything else of the ``Executor`` protocol passes through to the wrapped executor, serialized
with the worker where it touches the runner (``execute`` runs on the worker too).

On a GPU the worker returns once the step's kernels are enqueued (the logits are still being
computed); the core's sampling then waits for them, and the next step's kernels are enqueued as
soon as its tokens are known, while the core makes step N's outputs and plans N+2. The tokens
still make one round trip through the host per step (a device-side fill from the sampled-ids
buffer would remove it; not done yet).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch

from pagedrs._core import PLACEHOLDER_TOKEN
from pagedrs.executor.base import Executor
from pagedrs.step_input import StepInput


def fill_placeholders(step: StepInput, tokens: dict[int, int]) -> StepInput:
    """``step`` with each placeholder input id replaced by its sequence's token (0 for a
    sequence that drew none: it ended meanwhile, and its row is dropped)."""
    where = np.nonzero(step.input_ids == PLACEHOLDER_TOKEN)[0]
    if where.size == 0:
        return step
    rows = np.searchsorted(step.query_start_loc, where, side="right") - 1
    ids = step.input_ids.copy()
    ids[where] = [tokens.get(seq_id, 0) for seq_id in step.seq_ids[rows].tolist()]
    return dataclasses.replace(step, input_ids=ids)


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
        if after is not None:
            step = fill_placeholders(step, after.result())  # raises: the step before failed, run nothing
        try:
            return self._inner.execute(step)
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
