"""This process's place in the tensor-parallel group, and the one collective the model uses.

Model layers ask ``tp_rank()`` / ``tp_size()`` to size their shards and call
``all_reduce_`` after a row-parallel matmul. With one rank (the default) nothing here
touches ``torch.distributed``, so single-process runs need no process group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1


_STATE = TensorParallel()
_COLLECTIVE_SECONDS = [0.0]  # wall time this process spent inside all_reduce_ (benchmarks read it)


def set_tensor_parallel(rank: int, size: int) -> None:
    """Called once per process, after ``torch.distributed.init_process_group``."""
    global _STATE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} of size {size}: need size >= 1 and 0 <= rank < size")
    _STATE = TensorParallel(rank, size)


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sums ``tensor`` over the group in place (a no-op with one rank)."""
    if _STATE.size > 1:
        start = time.perf_counter()
        torch.distributed.all_reduce(tensor)
        _COLLECTIVE_SECONDS[0] += time.perf_counter() - start
    return tensor


def collective_seconds() -> float:
    """Wall time this process has spent in the model's all-reduces so far."""
    return _COLLECTIVE_SECONDS[0]
