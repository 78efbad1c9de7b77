"""One pagedrs engine behind the server's own app, as a Ray Serve replica.

Each replica is the single server minus uvicorn: an Engine (its core in this actor), the
EngineLoop that steps it, and ``server.app.build_app``'s FastAPI app. The ingress forwards
each HTTP request here whole (``asgi.forward``), so validation, limits, the API key, errors
and SSE are the single server's, byte for byte.

``record_routing_stats`` is the digest the cache router reads (Ray Serve polls it every
``request_routing_stats_period_s``): the hashes the device tier caches, and the load.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedrs.ray.asgi import ForwardedRequest, ResponseStart, forward

REPLICA_HEADER = b"x-pagedrs-replica"
LOAD_HEADER = b"x-pagedrs-replica-load"  # requests this replica held when this one arrived, itself included


def _replica_name() -> str:
    """This replica's actor name in Ray ("SERVE_REPLICA::app#deployment#id"); "" outside Serve."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.to_full_id_str())
    except Exception:  # noqa: BLE001 - not in a Serve replica (tests build one directly)
        return ""


@dataclass(frozen=True)
class ReplicaConfig:
    engine_kwargs: dict[str, Any]  # EngineArgs(**engine_kwargs)
    model_name: str
    max_waiting: int = 256
    options_kwargs: dict[str, Any] = field(default_factory=dict)  # ServerOptions(**options_kwargs)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to hash a prompt as this replica does."""

    tokenizer: Any
    block_size: int
    enable_prefix_caching: bool
    prefix_cache_isolation: str


class PagedrsReplica:
    def __init__(self, config: ReplicaConfig) -> None:
        from pagedrs import Engine, EngineArgs
        from pagedrs.server.app import build_app
        from pagedrs.server.engine_loop import EngineLoop
        from pagedrs.server.options import ServerOptions

        self._options = ServerOptions(**config.options_kwargs)
        self._args = EngineArgs(**config.engine_kwargs)
        self._engine = Engine(self._args)
        gc.collect()
        gc.freeze()
        self._loop = EngineLoop(self._engine, request_timeout_s=self._options.request_timeout_s)
        self._loop.start()
        self._app = build_app(self._loop, config.model_name, config.max_waiting, self._options)
        self._digests = itertools.count()
        self._name = _replica_name()
        self._active = 0  # requests in handle() now


    async def handle(self, request: ForwardedRequest,
                     route: Optional[list[int]] = None) -> AsyncIterator[Union[ResponseStart, bytes]]:
        """The response to one forwarded request (``route`` is the router's, unused here), with
        ``x-pagedrs-replica`` naming the replica that answered (Ray's actor name of it) and
        ``x-pagedrs-replica-load`` the requests it held when this one arrived (itself included)."""
        self._active += 1
        held = self._active
        try:
            async for item in forward(self._app, request):
                if isinstance(item, ResponseStart):
                    item = ResponseStart(item.status, [*item.headers, (REPLICA_HEADER, self._name.encode("latin-1")),
                                                       (LOAD_HEADER, str(held).encode())])
                yield item
        finally:
            self._active -= 1

    def describe(self) -> ReplicaInfo:
        return ReplicaInfo(self._engine.tokenizer, int(self._args.block_size), bool(self._args.enable_prefix_caching),
                           self._options.prefix_cache_isolation)

    async def record_routing_stats(self) -> dict[str, Any]:
        """The cache router's digest: the device tier's cached block hashes and the load."""
        taken = time.time()
        hashes = await self._loop.call(lambda engine: engine.scheduler.cached_hashes("GPU"))
        stats = self._loop.stats()
        return {
            "seq": next(self._digests),
            "time": taken,  # wall clock (the router compares it with when it sent requests)
            "hashes": hashes,
            "num_running": int(stats.get("num_running", 0)),
            "num_waiting": int(stats.get("num_waiting", 0)),
            "num_free_gpu_blocks": int(stats.get("num_free_gpu_blocks", 0)),
        }

    async def stats(self) -> dict[str, Any]:
        return dict(self._loop.stats())

    async def placement(self) -> dict[str, Any]:
        """Where this replica's ranks run: its own Ray node, and its tensor-parallel workers' nodes."""
        import ray

        def workers(engine: Any) -> list[str]:
            nodes = getattr(engine.core.executor, "worker_node_ids", None)
            return list(nodes()) if callable(nodes) else []

        return {"node_id": str(ray.get_runtime_context().get_node_id()),
                "worker_node_ids": await self._loop.call(workers)}

    def __del__(self) -> None:
        """Ray Serve's replica shutdown: what is left is aborted, its pages freed, the core released."""
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop()
            self._app.state.ctx.prompts.close()
            self._engine.shutdown()
