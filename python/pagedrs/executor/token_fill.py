"""Step N's drawn tokens into step N+1's placeholder input ids, without a host round trip.

Under asynchronous scheduling (core/async_step.py) step N+1 is planned before step N is sampled:
each sequence that goes on in place holds a placeholder input id, to be filled with the token it
draws at step N. The core publishes those tokens as ``DrawnTokens`` as soon as they exist, which
for the plain rows' batched draw (core/fast_rows.py) is a tensor still on the device that drew it,
before any device-to-host copy; rows drawn the generic way (per request) arrive as host values.

The worker that launches N+1 (executor/async_execution.py) splits them (``fill_placeholders``):
host values are written into the plan's input ids at once, device values become a ``DeviceFill``
that the runner applies where the step's input ids live (``DeviceFill.apply``: one gather and one
scatter on the device), so N+1's kernels are enqueued while N's tokens are still on their way to the
host (vLLM's async scheduling keeps the sampled ids on the device the same way). On the CPU the
device is the host and the same code runs, which is how ``make test`` covers the contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedrs._core import PLACEHOLDER_TOKEN
from pagedrs.step_input import StepInput


@dataclass(frozen=True)
class DrawnTokens:
    """A step's tokens for the sequences that hold a placeholder in the next step.

    ``host``: tokens by sequence id, known on the host. ``device_ids`` (int64 ``[n]``, on the
    device that drew them) with ``device_rows`` (sequence id -> row of ``device_ids``): tokens
    not yet copied to the host. A sequence in neither drew nothing (it ended meanwhile)."""

    host: Mapping[int, int] = field(default_factory=dict)
    device_ids: Optional[torch.Tensor] = None
    device_rows: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device_rows and self.device_ids is None:
            raise ValueError("DrawnTokens.device_rows names rows of device_ids, which is None")
        if self.device_ids is not None and (self.device_ids.dim() != 1 or self.device_ids.dtype != torch.int64):
            raise ValueError(f"DrawnTokens.device_ids must be int64 [n]; got {self.device_ids.dtype} "
                             f"{tuple(self.device_ids.shape)}")


@dataclass(frozen=True)
class DeviceFill:
    """Placeholder input ids the runner fills on the device: position ``where[i]`` of the step's
    input ids takes ``ids[rows[i]]``."""

    where: np.ndarray  # int64 [k]: positions in the step's input ids
    rows: np.ndarray  # int64 [k]: rows of ``ids``
    ids: torch.Tensor  # int64 [n], on the device that drew them

    def apply(self, input_ids: torch.Tensor) -> None:
        """``input_ids[where] = ids[rows]`` on ``input_ids``' device, in place; no host sync (the
        index arrays travel host-to-device, the tokens never leave the device)."""
        device = input_ids.device
        where, rows = _to_device(self.where, device), _to_device(self.rows, self.ids.device)
        input_ids.index_copy_(0, where, self.ids.index_select(0, rows).to(device, non_blocking=True))

    def materialize(self, step: StepInput) -> StepInput:
        """``step`` with these ids written into its host input ids (a copy; on a GPU this waits for
        the tokens: for paths that read the ids on the host, such as a draft model's mirror)."""
        ids = step.input_ids.copy()
        ids[self.where] = self.ids.index_select(0, torch.from_numpy(self.rows).to(self.ids.device)).cpu().numpy()
        return dataclasses.replace(step, input_ids=ids)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting for it: on a GPU from pinned memory, since a copy from
    pageable memory may hold the host until it is done (torch's ``non_blocking`` only promises
    overlap for pinned memory), and the worker must not wait on step N's forward."""
    t = torch.from_numpy(array)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def fill_placeholders(step: StepInput, tokens: DrawnTokens | Mapping[int, int]) -> tuple[StepInput, Optional[DeviceFill]]:
    """``step`` with each placeholder input id whose token is on the host replaced by it (0 for a
    sequence that drew none: it ended meanwhile, and its row is dropped), and the ``DeviceFill`` of
    those whose token is still on the device (None if there are none). The plan itself is not
    written: a copy of its input ids is."""
    if not isinstance(tokens, DrawnTokens):
        tokens = DrawnTokens(host=tokens)
    where = np.nonzero(step.input_ids == PLACEHOLDER_TOKEN)[0]
    if where.size == 0:
        return step, None
    owners = step.seq_ids[np.searchsorted(step.query_start_loc, where, side="right") - 1].tolist()
    ids = step.input_ids.copy()
    on_device: list[int] = []
    device_rows: list[int] = []
    for at, seq_id in zip(where.tolist(), owners):
        row = tokens.device_rows.get(seq_id)
        if row is not None:
            on_device.append(at)
            device_rows.append(row)
            ids[at] = 0  # until the device writes it (the host copy never reads a placeholder)
        else:
            ids[at] = tokens.host.get(seq_id, 0)
    step = dataclasses.replace(step, input_ids=ids)
    if not on_device:
        return step, None
    assert tokens.device_ids is not None  # (DrawnTokens checks it)
    return step, DeviceFill(np.asarray(on_device, dtype=np.int64), np.asarray(device_rows, dtype=np.int64),
                            tokens.device_ids)
