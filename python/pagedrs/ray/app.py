"""``build_app``: pagedrs as a Ray Serve application of N engine replicas behind one ingress.

    from pagedrs.ray import build_app
    app = build_app(EngineArgs(model=...), num_replicas=2, routing="cache")
    serve.run(app, route_prefix="/")     # or: pagedrs serve-ray --num-replicas 2 ...

Ray runs the replicas (restarts a dead one), the HTTP proxy and the handles; pagedrs adds
the replica (``replica.py``: the single server's engine and app), the ingress
(``ingress.py``) and the router (``router.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pagedrs.engine_args import EngineArgs
from pagedrs.ray.replica import ReplicaConfig
from pagedrs.ray.routing import DEFAULT_EPSILON

# approx: the cache router without digests (router.py); ray-prefix: Ray's PrefixCacheAffinityRouter
ROUTINGS = ("cache", "approx", "pow2", "ray-prefix")
DEFAULT_ROUTING_STATS_PERIOD_S = 0.5
REPLICA_DEPLOYMENT = "PagedrsReplica"
INGRESS_DEPLOYMENT = "PagedrsIngress"


def check_routing(routing: str, num_replicas: int, epsilon: float, stats_period_s: float) -> None:
    import math

    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r} is not a routing: allowed {' or '.join(map(repr, ROUTINGS))}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r} must be an integer >= 1")
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon={epsilon!r} must be a finite number >= 0 (the bounded-load slack)")
    if not (isinstance(stats_period_s, (int, float)) and math.isfinite(stats_period_s) and stats_period_s > 0):
        raise ValueError(f"routing_stats_period_s={stats_period_s!r} must be a finite number > 0")


def build_app(engine_args: EngineArgs, num_replicas: int = 2, routing: str = "cache", *,
              model_name: Optional[str] = None, max_waiting: int = 256, server_options: Optional[Any] = None,
              epsilon: float = DEFAULT_EPSILON, routing_stats_period_s: float = DEFAULT_ROUTING_STATS_PERIOD_S,
              ray_actor_options: Optional[dict[str, Any]] = None) -> Any:
    """The Ray Serve application (``serve.run`` it). ``server_options``: a ``ServerOptions``, the
    single server's limits and keys (enforced in each replica). Each replica holds one engine
    with ``engine_args``: size its KV pool (``num_gpu_blocks`` / ``kv_cache_memory``) for N of them
    on one machine."""
    from ray import serve as ray_serve
    from ray.serve.config import RequestRouterConfig as RayRouterConfig

    from pagedrs.ray.ingress import PagedrsIngress
    from pagedrs.ray.replica import PagedrsReplica
    from pagedrs.server.options import ServerOptions

    serve: Any = ray_serve  # Ray's own annotations of these are looser than what they accept
    RequestRouterConfig: Any = RayRouterConfig
    check_routing(routing, num_replicas, epsilon, routing_stats_period_s)
    options = server_options or ServerOptions()
    options_kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    options_kwargs["api_keys"] = dict(options_kwargs["api_keys"])  # a MappingProxyType does not pickle
    config = ReplicaConfig(
        engine_kwargs={f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)},
        model_name=model_name or str(engine_args.model), max_waiting=max_waiting, options_kwargs=options_kwargs,
    )
    router = (
        RequestRouterConfig(request_router_class="pagedrs.ray.router:CacheAffinityRouter",
                            request_router_kwargs={"epsilon": epsilon, "use_digests": routing == "cache"},
                            request_routing_stats_period_s=routing_stats_period_s)
        if routing in ("cache", "approx") else
        RequestRouterConfig(request_router_class="pagedrs.ray.ray_prefix:RayPrefixRouter",
                            request_routing_stats_period_s=routing_stats_period_s)
        if routing == "ray-prefix" else
        RequestRouterConfig(request_routing_stats_period_s=routing_stats_period_s)
    )
    replica = serve.deployment(
        PagedrsReplica, name=REPLICA_DEPLOYMENT, num_replicas=num_replicas,
        max_ongoing_requests=max(1, max_waiting + int(engine_args.max_num_seqs)),
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
        request_router_config=router,
        # Draining as the single server drains (--shutdown-timeout): Ray stops routing to a replica
        # being removed and waits this long for its requests before the replica's __del__ aborts the rest.
        graceful_shutdown_timeout_s=max(1.0, float(options.shutdown_timeout_s)),
    ).bind(config)
    ingress = serve.deployment(serve.ingress()(PagedrsIngress), name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica, options_kwargs, routing)
