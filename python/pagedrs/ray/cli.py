"""`pagedrs serve-ray`: the server's flags, N replicas on a Ray cluster, one HTTP entry.

A command of its own, not a `serve --backend ray`: its process is a Ray driver that deploys
the app and waits, not the server; the HTTP listener is Ray's proxy. It takes every flag of
`pagedrs serve` (the same parser: one list of flags) and refuses, by name, the three that
have no meaning behind Ray's proxy instead of ignoring them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any, Optional

from pagedrs.ray.app import DEFAULT_ROUTING_STATS_PERIOD_S, ROUTINGS, check_routing
from pagedrs.ray.routing import DEFAULT_EPSILON
from pagedrs.server.options import DEFAULT_READ_TIMEOUT_S

APP_NAME = "pagedrs"


def build_parser() -> argparse.ArgumentParser:
    from pagedrs.server.cli import build_parser as serve_parser

    p = serve_parser()
    p.prog = "pagedrs serve-ray"
    p.description = ("pagedrs serve's OpenAI-compatible server as N data-parallel replicas on Ray Serve, "
                     "routed by what each replica's prefix cache holds")
    ray_group = p.add_argument_group("Ray")
    ray_group.add_argument("--num-replicas", type=int, default=2, help="engine replicas (default: %(default)s)")
    ray_group.add_argument("--routing", choices=ROUTINGS, default="cache",
                           help="cache: longest cached prefix within a bounded load; approx: the same, predicted from "
                           "what was sent (no digests); pow2: Ray's power of two choices; ray-prefix: Ray Serve LLM's "
                           "PrefixCacheAffinityRouter")
    ray_group.add_argument("--routing-epsilon", type=float, default=DEFAULT_EPSILON,
                           help="bounded load: a replica takes a request only while within ceil((1 + e) x the mean load) "
                           "(default: %(default)s)")
    ray_group.add_argument("--routing-stats-period", type=float, default=DEFAULT_ROUTING_STATS_PERIOD_S,
                           help="seconds between the replicas' cache digests (default: %(default)s)")
    ray_group.add_argument("--ray-address", default=None,
                           help="a running cluster (default: $RAY_ADDRESS, else a local one started here)")
    return p


def _refused(args: argparse.Namespace) -> Optional[str]:
    """Flags of `serve` that mean nothing behind Ray's proxy: refused, never ignored."""
    if args.request_trace:
        return "--request-trace is per process; behind Ray each replica would need its own file (not supported yet)"
    if args.engine_in_process:
        return "--engine-in-process: a replica always runs its engine in its own actor process"
    if args.read_timeout != DEFAULT_READ_TIMEOUT_S:
        return ("--read-timeout is enforced by pagedrs serve's uvicorn protocol layer, which Ray's proxy replaces "
                "(its keep-alive timeout governs idle connections): drop the flag")
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    why = _refused(args)
    if why is not None:
        print(f"pagedrs serve-ray: {why}", file=sys.stderr)
        return 2
    from pagedrs import EngineArgs
    from pagedrs.server.cli import engine_kwargs, server_options

    try:
        check_routing(args.routing, args.num_replicas, args.routing_epsilon, args.routing_stats_period)
        options = server_options(args)
        engine_args = EngineArgs(**engine_kwargs(args))
    except ValueError as exc:
        print(f"pagedrs serve-ray: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import ray
        from ray import serve
    except ImportError:
        print("pagedrs serve-ray: needs Ray Serve: pip install 'pagedrs[ray]'", file=sys.stderr)
        return 2
    from pagedrs.ray.app import build_app

    ray.init(address=args.ray_address or os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(engine_args, args.num_replicas, args.routing, model_name=args.served_model_name or args.model,
                    max_waiting=args.max_waiting, server_options=options, epsilon=args.routing_epsilon,
                    routing_stats_period_s=args.routing_stats_period)
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"pagedrs serve-ray: {args.num_replicas} replicas, routing {args.routing}, on http://{args.host}:{args.port}",
          flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stop.wait()
    serve.delete(APP_NAME)  # each replica drains: its engine loop stops, its requests abort, its pages free
    serve.shutdown()
    return 0
