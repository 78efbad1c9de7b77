"""Tensor-parallel ranks 1..N-1 as Ray actors: one engine's ranks across the machines of a cluster.

``EngineArgs(distributed_executor_backend="ray")``: instead of spawning worker processes on
this machine, ``TPExecutor`` asks Ray for a placement group of N-1 bundles (one device each:
``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` on the CPU; strategy PACK, so the ranks share a node when
it has room and spread when it does not) and starts one actor per bundle. Each actor joins the
same ``torch.distributed`` group as rank 0 (a TCP rendezvous at rank 0's node address) and runs
``tp_executor.serve_rank`` until STOP. Rank 0 is this process (in a Serve replica: the replica).

Ray is the process supervisor here: a worker that dies is seen through its ``run`` call's
object ref (``wait_exit``), the executor is then dead for good exactly as with processes, and
``kill`` removes the actors and the placement group. Nothing outside Ray decides placement.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

from pagedrs.engine_args import EngineArgs

PLACEMENT_TIMEOUT_S = 120.0


def _worker_class() -> Any:
    import ray

    @ray.remote(max_restarts=0)
    class TPWorker:
        """One rank: join the group, serve rank 0's commands until STOP, leave the group."""

        def run(self, entry: Callable[..., None], args: EngineArgs, rank: int, size: int, init_method: str,
                timeout_s: float) -> int:
            entry(args, rank, size, init_method, timeout_s)  # tp_executor.serve_rank, until STOP
            return rank

    return TPWorker


class RayWorkers:
    """Ranks 1..size-1 started on Ray; ``init_method`` is where rank 0 must join them."""

    def __init__(self, args: EngineArgs, size: int, timeout_s: float, entry: Callable[..., None]) -> None:
        """``entry(args, rank, size, init_method, timeout_s)`` is what each actor runs (passed in
        by tp_executor, which imports this module: a function travels to the actor by name)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedrs.net import free_port

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
        gpu = args.device.startswith("cuda")
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self._pg = placement_group([dict(bundle) for _ in range(size - 1)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._pg)
            raise ValueError(
                f"tensor_parallel_size={size} with distributed_executor_backend='ray' needs {size - 1} bundle(s) of "
                f"{bundle} for ranks 1..{size - 1}; the cluster could not place them in {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(its resources: {ray.available_resources()})")
        address = ray.util.get_node_ip_address()
        self.init_method = f"tcp://{address}:{free_port('0.0.0.0')}"
        worker = _worker_class()
        self._actors = [
            worker.options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i))
            .remote()
            for i in range(size - 1)
        ]
        self._refs = {ref: f"tensor-parallel rank {rank} (Ray actor)" for rank, ref in enumerate(
            (a.run.remote(entry, args, rank, size, self.init_method, timeout_s) for rank, a in enumerate(self._actors, 1)),
            start=1)}
        self._left = dict(self._refs)

    def node_ids(self) -> list[str]:
        """The Ray node of each rank 1..N-1, from the placement group's own table (an actor call
        would wait behind its ``run``, which lasts as long as the engine)."""
        from ray.util import placement_group_table

        nodes = placement_group_table(self._pg).get("bundles_to_node_id", {})
        return [str(nodes[i]) for i in range(len(self._actors))]

    def wait_exit(self, timeout_s: float) -> Optional[str]:
        """A worker that ended within ``timeout_s`` (why), or None."""
        import ray

        if not self._left:
            return None
        done, _ = ray.wait(list(self._left), num_returns=1, timeout=timeout_s)
        if not done:
            return None
        name = self._left.pop(done[0])
        try:
            ray.get(done[0])
            return f"{name} exited"
        except Exception as exc:  # noqa: BLE001 - died, or its loop raised: either way the group is gone
            return f"{name} died: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def all_alive(self) -> bool:
        import ray

        done, _ = ray.wait(list(self._left), num_returns=len(self._left), timeout=0) if self._left else ([], [])
        return len(self._left) == len(self._refs) and not done

    def join(self, timeout_s: float) -> None:
        import ray

        if self._left:
            ray.wait(list(self._left), num_returns=len(self._left), timeout=timeout_s)

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            remove_placement_group(self._pg)
        except Exception:  # noqa: BLE001
            pass
        self._left.clear()
