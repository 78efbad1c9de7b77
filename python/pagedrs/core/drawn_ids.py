"""The drawn ids handed to the next step early, and their copy to the host behind it.

Under asynchronous scheduling the core publishes step N's drawn ids while they are on the device
(executor/token_fill.py), and the worker enqueues step N+1's kernels right away. A plain
``ids.tolist()`` after that would queue the device-to-host copy behind N+1's whole forward on the
same stream, and the host would wait a step for tokens it could have had at once. So the copy is
enqueued first, on a side stream ordered after the sampling kernels, into pinned memory, and the
host waits on its event, not on the stream (vLLM's async output copy does the same). On the CPU
there is nothing to overlap: the tensors are the host's already.

Built without a GPU to run it on (no device was lent since): `benches/gpu_check.sh` exercises it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pagedrs.executor.token_fill import DrawnTokens

if TYPE_CHECKING:  # (fast_rows imports this module)
    from pagedrs.core.fast_rows import FastStep


@dataclass
class HostCopy:
    """Tensors on their way to the host; ``wait`` returns them there."""

    tensors: tuple[torch.Tensor, ...]
    done: Optional[torch.cuda.Event] = None  # None: already on the host

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self.done is not None:
            self.done.synchronize()
        return self.tensors


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def to_host_behind(*tensors: torch.Tensor) -> HostCopy:
    """Starts copying ``tensors`` (one device) to the host, ordered after the work already enqueued
    on the current stream and ahead of anything enqueued after this call."""
    device = tensors[0].device
    if device.type != "cuda":
        return HostCopy(tuple(t.cpu() for t in tensors))
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    hosts = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    with torch.cuda.stream(stream):
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the caching allocator keeps t alive until the copy ran
        done = torch.cuda.Event()
        done.record(stream)
    return HostCopy(hosts, done)


class EarlyPublication:
    """Publishes a step's placeholder tokens early, from the plain rows' draw, when it holds them all
    (``finish_step``'s ``on_tokens``): ``done`` once published, after which the draw must not be redone."""

    def __init__(self, on_tokens: Callable[[DrawnTokens], None], placeholders: frozenset[int]) -> None:
        self.on_tokens = on_tokens
        self.placeholders = placeholders
        self.done = False

    def for_draw(self, fast: FastStep) -> Optional[Callable[[torch.Tensor], None]]:
        """The draw's ``on_drawn``: None unless every placeholder's sequence is one of its rows."""
        rows = {row.sample.seq_id: i for i, row in enumerate(fast.rows)}
        if not self.placeholders <= rows.keys():
            return None
        device_rows = {seq_id: rows[seq_id] for seq_id in self.placeholders}

        def on_drawn(ids: torch.Tensor) -> None:
            self.done = True  # from here on the next step may run on these ids: they are the step's tokens
            self.on_tokens(DrawnTokens(device_ids=ids, device_rows=device_rows))

        return on_drawn
