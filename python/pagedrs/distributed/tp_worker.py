"""The tensor-parallel ranks' side: the shard every rank holds and the loop ranks 1..N-1 run.

Separate from tp_executor.py (rank 0's ``TPExecutor``: starting, watching and stopping the
workers) because this is all a worker process needs: a spawned worker (``_worker_entry``,
sent to the child by name) or a Ray actor (``serve_rank``, ray_workers.py) imports this
module, joins the group and serves rank 0's commands. The command header both sides speak
is defined here once.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

from pagedrs.attention import AttentionBackend
from pagedrs.distributed import parallel_state
from pagedrs.distributed.step_codec import decode
from pagedrs.engine_args import EngineArgs
from pagedrs.executor.local import LocalExecutor
from pagedrs.memory import KvPlan

# Commands rank 0 broadcasts as an int64 header [command, payload bytes, a, b].
_PLAN, _INIT, _STEP, _STOP = 1, 2, 3, 4
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def backend_name(device: torch.device) -> str:
    """The model's collectives' backend (the control messages always take gloo)."""
    return "nccl" if device.type == "cuda" else "gloo"


class _Shard:
    """What every rank holds: its weight shard and KV pools; runs a step on them."""

    def __init__(self, args: EngineArgs, rank: int, size: int, attention_backend: AttentionBackend | None) -> None:
        device = torch.device(args.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
            args = _replace_device(args, str(device))
        self.local = LocalExecutor(args, attention_backend=attention_backend, tp_rank=rank, tp_size=size)

    def plan(self) -> KvPlan:
        return self.local.plan_kv_memory()


def _replace_device(args: EngineArgs, device: str) -> EngineArgs:
    from dataclasses import replace

    return replace(args, device=device)


def _worker_entry(args: EngineArgs, rank: int, size: int, port: int, parent_pid: int) -> None:
    """A spawned worker: join the group, then serve rank 0's commands until STOP."""
    _exit_with_parent(parent_pid)
    serve_rank(args, rank, size, f"tcp://127.0.0.1:{port}", _COLLECTIVE_TIMEOUT.total_seconds())
    # STOP served and the group destroyed: the worker holds nothing else. It leaves without the
    # interpreter's finalization, where the C++ destructors of torch.distributed's background
    # threads were seen to abort (exit code -6, SIGABRT) on a loaded machine after a clean stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_rank(args: EngineArgs, rank: int, size: int, init_method: str, timeout_s: float) -> None:
    """Ranks 1..N-1, spawned (``_worker_entry``) or a Ray actor (ray_workers.py): join the group at
    ``init_method``, serve rank 0's commands until STOP, leave the group."""
    dist.init_process_group(backend_name(torch.device(args.device)), init_method=init_method, rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    parallel_state.set_tensor_parallel(rank, size)
    parallel_state.join_control_group()
    try:
        run_worker(args, rank, size, None)
    finally:
        parallel_state.set_control_group(None)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        parallel_state.set_tensor_parallel(0, 1)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker must never outlive rank 0 (no orphans holding memory or devices)."""

    def watch() -> None:
        import time

        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="pagedrs-tp-parent-watch", daemon=True).start()


def run_worker(args: EngineArgs, rank: int, size: int, attention_backend: AttentionBackend | None) -> None:
    """Ranks 1..N-1: hold a shard and run every command rank 0 broadcasts."""
    shard = _Shard(args, rank, size, attention_backend)
    group = parallel_state.control_group()
    while True:
        header = torch.empty(4, dtype=torch.int64)
        dist.broadcast(header, src=0, group=group)
        command, length, a, b = (int(x) for x in header)
        if command == _PLAN:
            local = shard.plan()
            counts = torch.tensor([local.num_gpu_blocks, local.num_cpu_blocks], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
        elif command == _INIT:
            shard.local.init_kv_cache(a, b)
            dist.barrier(group=group)
        elif command == _STEP:
            buf = torch.empty(length, dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=group)
            shard.local.execute(decode(buf.numpy()), compute_logits=False)
            shard.local.take_completed_transfers()
        elif command == _STOP:
            return
        else:
            raise RuntimeError(f"tensor-parallel worker {rank}: unknown command {command}")
