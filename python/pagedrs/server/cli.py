"""`pagedrs serve`: parse arguments, build the engine, run uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

DEFAULT_MAX_WAITING = 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedrs serve",
        description="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics",
    )
    p.add_argument("--model", default="smollm2-135m", help="model name or local path (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="name clients must send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
        help="answer 503 to requests that would make the waiting queue longer than this (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = p.add_argument_group("engine")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument(
        "--num-gpu-blocks", type=int, default=None, help="device KV pages (overrides --kv-cache-memory)"
    )
    engine.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the device KV pool")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--swap-space-gb", type=float, default=1.0)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    engine.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"])
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    engine.add_argument("--seed", type=int, default=0)
    return p


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs fields from parsed arguments."""
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "swap_space_gb": args.swap_space_gb,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "preemption_mode": args.preemption_mode,
        "kv_layout": args.kv_layout,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pagedrs serve`; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.max_waiting < 0:
        print(f"pagedrs serve: --max-waiting={args.max_waiting} must be >= 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from pagedrs import Engine, EngineArgs
    from pagedrs.server.app import build_app
    from pagedrs.server.engine_loop import EngineLoop

    try:
        engine = Engine(EngineArgs(**engine_kwargs(args)))
    except (ValueError, OSError) as exc:
        print(f"pagedrs serve: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    loop = EngineLoop(engine)
    loop.start()
    app = build_app(loop, args.served_model_name or args.model, args.max_waiting)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so `finally` below may never
    # run: stop the engine thread in the app's shutdown phase as well.
    app.router.on_shutdown.append(loop.stop)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
