"""The tensor-parallel executor: one Rust scheduler on rank 0, sharded weights and KV on every rank.

    rank 0 (the engine process)                     ranks 1..N-1 (workers)
    ───────────────────────────                     ──────────────────────
    Scheduler → StepInput ──broadcast(header, bytes)──► decode the same StepInput
    transfers, copies, forward (its shard)           transfers, copies, forward (its shard)
              └──────────── all-reduce after o_proj and down_proj ────────────┘
    logits (lm_head replicated: no gather) → sample

Memory decisions are made once, on rank 0: every rank has the same number of pages with
the same block ids, holding only its own KV heads, so one plan (block tables, slots,
copy-on-write and swap pairs) applies to all. The pool is what the smallest rank holds.

Processes: workers are started with ``torch.multiprocessing`` (spawn) and joined through
``torch.distributed`` (a TCP store on 127.0.0.1 with a free port; gloo on the CPU, NCCL on
CUDA), or, with ``distributed_executor_backend="ray"``, as Ray actors on any node of a cluster
(``ray_workers.py``; the store at rank 0's node address). Rank 0's commands travel in a gloo
control group beside the model's (``parallel_state.control_group``): they are CPU tensors.
One process hosts one tensor-parallel engine at a time (the group is the process's
default ``torch.distributed`` group). Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set) the existing group is used
instead: rank 0 returns an executor and every other rank runs the worker loop and exits.
The ranks' side (the shard, the worker loop, the command header) is tp_worker.py.

Failures: a worker that dies makes rank 0's next collective fail (its sockets close) and
a monitor thread notices its exit within a second; the executor is then dead for good
(``ExecutorDeadError``), the engine fails the requests in flight, and shutdown kills the
other workers. A worker whose parent (rank 0) dies exits at once: no orphans.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from pagedrs.attention import AttentionBackend
from pagedrs.distributed import parallel_state
from pagedrs.distributed.step_codec import encode
from pagedrs.distributed.tp_worker import (  # the ranks' side; backend_name, serve_rank, run_worker re-exported here
    _COLLECTIVE_TIMEOUT,
    _INIT,
    _PLAN,
    _STEP,
    _STOP,
    _Shard,
    _worker_entry,
    backend_name,
    run_worker,
    serve_rank,
)
from pagedrs.engine_args import EngineArgs
from pagedrs.errors import EngineDeadError
from pagedrs.executor.base import DiskTierHandle
from pagedrs.kv_tiers.errors import DiskTierError
from pagedrs.memory import KvPlan
from pagedrs.net import free_port
from pagedrs.step_input import StepInput

logger = logging.getLogger("pagedrs.engine")


class ExecutorDeadError(EngineDeadError):
    """A tensor-parallel worker is gone; this executor cannot run another step (an
    EngineDeadError: the serving loop stops instead of failing request after request)."""


class TPExecutor:
    """``Executor`` over ``args.tensor_parallel_size`` processes (see the module docs)."""

    def __init__(self, args: EngineArgs, attention_backend: AttentionBackend | None = None) -> None:
        self.args = args
        self.size = args.tensor_parallel_size
        self.device = torch.device(args.device)
        self._workers: list[Any] = []
        self._ray: Any = None  # ray_workers.RayWorkers with distributed_executor_backend="ray"
        self._exit_hook: Any = None
        self._dead: str | None = None
        self._stopping = False
        # One reaper at a time: the monitor and shutdown() both wait on the workers, and two threads
        # in os.waitpid for one child leave one of them with ECHILD and the child's exit code unset
        # (multiprocessing then reports a reaped worker as alive, exitcode None).
        self._reap_lock = threading.Lock()
        self._completed: list[int] = []
        if self.device.type == "cuda" and torch.cuda.device_count() < self.size:
            raise ValueError(
                f"tensor_parallel_size={self.size} needs {self.size} CUDA devices; {torch.cuda.device_count()} visible"
            )
        if _launched_by_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if world != self.size:
                raise ValueError(f"torchrun started {world} processes but tensor_parallel_size is {self.size}")
            if not dist.is_initialized():
                dist.init_process_group(backend_name(self.device), timeout=_COLLECTIVE_TIMEOUT)
            parallel_state.set_tensor_parallel(rank, world)
            parallel_state.join_control_group()
            if rank != 0:
                run_worker(args, rank, world, attention_backend)
                raise SystemExit(0)
        elif args.distributed_executor_backend == "ray":
            self._start_ray_workers()
            parallel_state.set_tensor_parallel(0, self.size)
        else:
            self._spawn_workers()
            parallel_state.set_tensor_parallel(0, self.size)
        try:
            self.shard = _Shard(args, 0, self.size, attention_backend)
        except BaseException:
            self.shutdown()
            raise
        self.loaded = self.shard.local.loaded
        self._monitor = threading.Thread(target=self._watch_workers, name="pagedrs-tp-monitor", daemon=True)
        self._monitor.start()

    # ---- processes ----------------------------------------------------------------

    def _spawn_workers(self) -> None:
        import torch.multiprocessing as tmp

        port = free_port()
        ctx = tmp.get_context("spawn")
        for rank in range(1, self.size):
            p = ctx.Process(target=_worker_entry, args=(self.args, rank, self.size, port, os.getpid()),
                            name=f"pagedrs-tp-{rank}", daemon=True)
            p.start()
            self._workers.append(p)
        # At interpreter exit, stop the workers before multiprocessing's exit hook (registered
        # earlier, so run later) terminates them mid-command and leaves the group behind.
        self._exit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        try:
            dist.init_process_group(backend_name(self.device), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=self.size, timeout=_COLLECTIVE_TIMEOUT)
            parallel_state.join_control_group()
        except BaseException:
            self._kill_workers()
            raise

    def _start_ray_workers(self) -> None:
        from pagedrs.distributed.ray_workers import RayWorkers

        self._ray = RayWorkers(self.args, self.size, _COLLECTIVE_TIMEOUT.total_seconds(), serve_rank)
        try:
            dist.init_process_group(backend_name(self.device), init_method=self._ray.init_method, rank=0,
                                    world_size=self.size, timeout=_COLLECTIVE_TIMEOUT)
            parallel_state.join_control_group()
        except BaseException:
            self._kill_workers()
            raise

    def worker_node_ids(self) -> list[str]:
        """The Ray nodes of ranks 1..N-1 (``distributed_executor_backend="ray"``; [] otherwise)."""
        return self._ray.node_ids() if self._ray is not None else []

    def _watch_workers(self) -> None:
        if self._ray is not None:
            while self._dead is None:
                why = self._ray.wait_exit(1.0)
                if why is not None:
                    with self._reap_lock:
                        if self._stopping:
                            return
                        self._worker_gone(why)
            return
        from multiprocessing.connection import wait

        alive = {p.sentinel: p for p in self._workers}
        while alive and self._dead is None:
            for sentinel in wait(list(alive), timeout=1.0):  # waits on the sentinel: reaps nothing
                p = alive.pop(sentinel)
                with self._reap_lock:
                    if self._stopping:
                        return  # shutdown() reaps the workers it stopped
                    p.join(1.0)  # the exit code is set once the process is reaped
                    self._worker_gone(f"tensor-parallel worker {p.name} exited with code {p.exitcode}")

    def _worker_gone(self, why: str) -> None:
        """The monitor saw a worker end (under ``_reap_lock``): the executor is dead, the first reason kept."""
        if self._dead is None:
            self._dead = why
            logger.error("%s; the engine cannot run another step", self._dead)

    def _kill_workers(self) -> None:
        if self._ray is not None:
            self._ray.kill()
        for p in self._workers:
            if p.is_alive():
                p.kill()
        for p in self._workers:
            p.join(10)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)

    def _command(self, command: int, payload: bytes = b"", a: int = 0, b: int = 0) -> None:
        group = parallel_state.control_group()
        header = torch.tensor([command, len(payload), a, b], dtype=torch.int64)
        dist.broadcast(header, src=0, group=group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)

    def _guarded(self, fn: Any) -> Any:
        self._check_alive()
        try:
            return fn()
        except Exception as exc:
            if isinstance(exc, ExecutorDeadError):
                raise
            # A collective that fails means a peer is gone (or the group is broken): fatal.
            self._dead = self._dead or f"a collective failed: {type(exc).__name__}: {exc}"
            raise ExecutorDeadError(self._dead) from exc

    # ---- Executor -----------------------------------------------------------------

    def plan_kv_memory(self) -> KvPlan:
        def plan() -> KvPlan:
            self._command(_PLAN)
            local = self.shard.plan()
            counts = torch.tensor([local.num_gpu_blocks, local.num_cpu_blocks], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=parallel_state.control_group())
            from dataclasses import replace

            return replace(local, num_gpu_blocks=int(counts[0]), num_cpu_blocks=int(counts[1]))

        return self._guarded(plan)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        def init() -> None:
            self._command(_INIT, a=num_gpu_blocks, b=num_cpu_blocks)
            self.shard.local.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
            dist.barrier(group=parallel_state.control_group())

        self._guarded(init)

    def execute(self, step: StepInput) -> torch.Tensor:
        def run() -> torch.Tensor:
            self._command(_STEP, encode(step))
            return self.shard.local.execute(step)

        try:
            out = self._guarded(run)
        except BaseException:
            # rank 0's copies say nothing of the other ranks', which may have stopped sooner: none of
            # the step's transfers is reported, so the core fails them all and recomputes what they
            # were to move (never serves a page some rank did not write)
            self.shard.local.take_completed_transfers()
            raise
        self._completed.extend(self.shard.local.take_completed_transfers())
        return out

    def take_completed_transfers(self) -> list[int]:
        done, self._completed = self._completed, []
        return done

    def open_disk_tier(self) -> DiskTierHandle | None:
        """None without ``kv_disk_path``; with one, DiskTierError (``make_executor`` refuses it before
        any worker starts: a tensor-parallel store would need a file per rank)."""
        if self.args.kv_disk_path is None:
            return None
        raise DiskTierError(self.args.kv_disk_path, f"the disk tier needs a local executor, got {type(self).__name__}")

    def disk_tier(self) -> DiskTierHandle | None:
        return None  # tensor parallelism runs without the disk tier (refused at startup)

    def take_failed_disk_slots(self) -> list[int]:
        return []

    def memory_bytes(self) -> dict[str, int]:
        return self.shard.local.memory_bytes()

    def shutdown(self) -> None:
        """Stops the workers (STOP, else killed after 10 s) and destroys the process group; idempotent.
        Besides shutdown(), the engine's finalizer calls it on garbage collection, and an exit
        hook at interpreter exit. No STOP goes to a group with a dead worker: a broadcast to a
        dead rank could wait for the collective timeout."""
        with self._reap_lock:  # from here on the monitor reaps nothing
            if self._stopping:
                return
            self._stopping = True
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
        workers_alive = all(p.is_alive() for p in self._workers) and (self._ray is None or self._ray.all_alive())
        if self._dead is None and workers_alive and dist.is_initialized() and not _launched_by_torchrun():
            try:
                self._command(_STOP)
            except Exception:  # noqa: BLE001 - a broken group: the workers are killed below
                pass
        for p in self._workers:
            p.join(10)
        if self._ray is not None:
            self._ray.join(10)
        self._kill_workers()
        self._dead = self._dead or "shut down"
        if dist.is_initialized() and not _launched_by_torchrun():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        parallel_state.set_control_group(None)
        parallel_state.set_tensor_parallel(0, 1)  # this process may build a one-rank engine again


def _shutdown_at_exit(executor: weakref.ref[TPExecutor]) -> None:
    live = executor()
    if live is not None:
        live.shutdown()


def _launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
