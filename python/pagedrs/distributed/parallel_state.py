"""This process's place in the tensor-parallel group, and the one collective the model uses.

Model layers ask ``tp_rank()`` / ``tp_size()`` to size their shards and call
``all_reduce_`` after a row-parallel matmul. With one rank (the default) nothing here
touches ``torch.distributed``, so single-process runs need no process group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1


_STATE = TensorParallel()
# The group rank 0's commands travel in (step buffers, headers, the pool's MIN, barriers): gloo,
# beside the model's default group. Those are CPU tensors, which an NCCL group refuses, so on CUDA
# the model's all-reduces take NCCL and the control messages this one (vLLM does the same).
_CONTROL: list[Optional[ProcessGroup]] = [None]
_COLLECTIVE_SECONDS = [0.0]  # wall time this process spent inside all_reduce_ (benchmarks read it)


def set_tensor_parallel(rank: int, size: int) -> None:
    """Called once per process, after ``torch.distributed.init_process_group``."""
    global _STATE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} of size {size}: need size >= 1 and 0 <= rank < size")
    _STATE = TensorParallel(rank, size)


def set_control_group(group: Optional[ProcessGroup]) -> None:
    """None when leaving the group (joining is ``join_control_group``)."""
    _CONTROL[0] = group


def join_control_group() -> None:
    """Every rank, in the same order, right after joining the default group."""
    group = torch.distributed.new_group(backend="gloo")
    if not isinstance(group, ProcessGroup):  # every rank is a member: this cannot be NON_GROUP_MEMBER
        raise RuntimeError(f"this rank is not in the tensor-parallel control group ({group!r})")
    _CONTROL[0] = group


def control_group() -> Optional[ProcessGroup]:
    """The control messages' gloo group (None: the default group)."""
    return _CONTROL[0]


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
