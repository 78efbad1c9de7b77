"""`pagedrs serve`: parse arguments, build the engine, run uvicorn until interrupted."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import Any

from pagedrs.cli_args import add_engine_args
from pagedrs.cli_args import engine_kwargs as shared_engine_kwargs
from pagedrs.server.options import PREFIX_CACHE_ISOLATION, ServerOptions
from pagedrs.server.tenants import load_api_key_file
from pagedrs.server.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_MAX_WAITING = 1024
# `pagedrs serve`'s exit status after its engine died: a supervisor (systemd Restart=on-failure,
# Kubernetes) restarts it, as it restarts vLLM's server.
ENGINE_DEAD_EXIT = 1
API_KEY_ENV = "PAGEDRS_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedrs serve",
        description="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics",
    )
    p.add_argument("--served-model-name", default=None, help="name clients must send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, local only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0 to 65535 (0: any free one)")
    p.add_argument(
        "--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
        help="answer 503 to requests that would make the waiting queue longer than this (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--request-trace", metavar="PATH", default=None,
        help="append one JSON line per request to PATH: when it arrived, was taken by the engine, first "
        "scheduled, got its first token and that token was dispatched (time.monotonic; `bench serve` reads it)",
    )
    _add_safety_arguments(p.add_argument_group("limits and access"))
    p.add_argument(
        "--tool-call-parser", default=None, metavar="{" + ",".join(TOOL_CALL_PARSERS) + "}",
        help="read tool calls out of answers in this model family's format, for tool_choice \"auto\" (OpenAI's "
        "default when tools are sent): hermes (Qwen2/Qwen2.5/Hermes <tool_call> blocks), llama3_json (Llama 3.x "
        "JSON calls), mistral ([TOOL_CALLS] and a list) (default: none; \"auto\" is then a 400)",
    )
    engine = p.add_argument_group("engine")
    add_engine_args(engine, cpu_threads_help=(
        "torch threads of the engine on the CPU (default: $PAGEDRS_CPU_THREADS, else every core this "
        "process may use: a server owns its machine)"))
    engine.add_argument("--seed", type=int, default=0, help="the engine's seed (unseeded sampling draws from it)")
    engine.add_argument(
        "--skip-tokenizer-init", action="store_true",
        help="load no tokenizer (a folder without tokenizer files): prompts must be token ids, texts come back empty",
    )
    engine.add_argument(
        "--pin-prefix", metavar="FILE", default=None,
        help="pin these prompts' pages at start (POST /v1/cache/pin for each): JSON lines, one "
        '{"prompt": "..."} or {"messages": [...]} each, optionally with ttl_s, cache_salt and tenant; '
        "a bad line stops the start with its line number",
    )
    engine.add_argument(
        "--engine-in-process", action="store_true",
        help="run the engine in the API server's process (default: its own process, so HTTP, tokenization "
        "and streaming never hold up a forward pass)",
    )
    return p


def _port(text: str) -> int:
    """A TCP port, checked with the other flags (a bad one failed in bind(), after the model had loaded)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: 0 to 65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range; allowed: 0 to 65535")
    return port


def _add_safety_arguments(g: argparse._ArgumentGroup) -> None:
    d = ServerOptions()
    g.add_argument(
        "--api-key", default=None,
        help=f"require 'Authorization: Bearer <key>' on /v1/* and /metrics (default: ${API_KEY_ENV}, else none)",
    )
    g.add_argument(
        "--api-key-file", metavar="PATH", default=None,
        help="API keys of several tenants: one '<key> <tenant>' per line (# comments); any of them (and "
        "--api-key, as tenant 'default') opens /v1/*; a bad file exits 2 naming its line",
    )
    g.add_argument(
        "--admin-api-key", default=None,
        help="the key of the admin endpoints (/metrics), which then take no tenant's key (default: none; "
        "/metrics takes any API key)",
    )
    g.add_argument(
        "--prefix-cache-isolation", choices=PREFIX_CACHE_ISOLATION, default=d.prefix_cache_isolation,
        help="per-tenant: requests share cached prefix pages only within their tenant (the cache salt names it; "
        "the prefix cache is a timing side channel) (default: %(default)s)",
    )
    g.add_argument(
        "--max-seqs-per-request", type=int, default=d.max_seqs_per_request,
        help="answer 400 to a request that would add more sequences (prompts x max(n, best_of)) (default: "
        "%(default)s)",
    )
    g.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    g.add_argument(
        "--max-request-bytes", type=int, default=d.max_request_bytes,
        help="answer 413 to request bodies larger than this (default: %(default)s)",
    )
    g.add_argument(
        "--read-timeout", type=float, default=d.read_timeout_s,
        help="seconds a connection has to send a request head, and a request its body (default: %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are aborted "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--core-timeout", type=float, default=d.core_timeout_s,
        help="seconds without a heartbeat from the engine core after which /health answers 503 (the core "
        "beats from a thread, so a long step does not count) (default: %(default)s)",
    )
    g.add_argument(
        "--request-timeout", type=float, default=d.request_timeout_s,
        help="seconds a request gets to finish: past them it is aborted and answered 504 (default: no limit)",
    )
    g.add_argument(
        "--tokenizer-threads", type=int, default=d.tokenizer_threads,
        help="worker threads that tokenize prompts, off the event loop and the engine (default: %(default)s)",
    )


def server_options(args: argparse.Namespace) -> ServerOptions:
    """ServerOptions from parsed arguments (ValueError names the bad one)."""
    # An empty key given is refused, not read as "no key": `--api-key "$KEY"` with KEY unset would
    # otherwise start a server anyone can use.
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        given = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise ValueError(f"{given} is empty: pass a non-empty key, or leave out both --api-key and ${API_KEY_ENV} "
                         "to serve without authentication")
    return ServerOptions(
        api_key=api_key,
        api_keys=load_api_key_file(args.api_key_file) if args.api_key_file else {},
        admin_api_key=args.admin_api_key,
        prefix_cache_isolation=args.prefix_cache_isolation,
        max_seqs_per_request=args.max_seqs_per_request,
        metrics_public=args.metrics_public,
        max_request_bytes=args.max_request_bytes,
        read_timeout_s=args.read_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        tokenizer_threads=args.tokenizer_threads,
        core_timeout_s=args.core_timeout,
        request_timeout_s=args.request_timeout,
        tool_call_parser=args.tool_call_parser,
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs fields from parsed arguments: the shared flags' mapping, with serve's own defaults
    (every core; prefill first on the CPU) where a flag was not given."""
    kwargs = shared_engine_kwargs(args)
    kwargs["prefill_first"] = args.prefill_first if args.prefill_first is not None else args.device == "cpu"
    if args.cpu_threads is None:
        kwargs["cpu_threads"] = _serve_default_threads()
    kwargs.update(seed=args.seed, skip_tokenizer_init=args.skip_tokenizer_init)
    return kwargs


def _serve_default_threads() -> int | None:
    """$PAGEDRS_CPU_THREADS when set (EngineArgs reads it), else every core this process may use."""
    import os

    from pagedrs.engine_args import CPU_THREADS_ENV, MAX_CPU_THREADS, usable_cores

    if os.environ.get(CPU_THREADS_ENV):
        return None
    return min(usable_cores(), MAX_CPU_THREADS)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pagedrs serve`; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.max_waiting < 0:
        print(f"pagedrs serve: --max-waiting={args.max_waiting} must be >= 0", file=sys.stderr)
        return 2
    try:
        options = server_options(args)
    except ValueError as exc:
        print(f"pagedrs serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pagedrs.server.request_trace import RequestTrace

    try:  # before the engine: a bad path must not leave a started engine core behind
        trace = RequestTrace(args.request_trace) if args.request_trace else None
    except OSError as exc:
        print(f"pagedrs serve: --request-trace {args.request_trace!r} cannot be opened for appending: {exc}", file=sys.stderr)
        return 2

    from pagedrs.server.cache_pins import load_pin_file, preload_pins

    if args.pin_prefix is not None:
        try:  # before the engine, as the trace: a bad file must not leave a started engine core behind
            load_pin_file(args.pin_prefix)
        except ValueError as exc:
            print(f"pagedrs serve: {exc}", file=sys.stderr)
            if trace is not None:
                trace.close()
            return 2

    from pagedrs import Engine, EngineArgs
    from pagedrs.server.app import build_app
    from pagedrs.server.connection import uvicorn_config
    from pagedrs.server.engine_core import EngineCoreError, RemoteEngine
    from pagedrs.server.engine_loop import EngineLoop
    from pagedrs.server.shutdown import draining_server

    try:
        engine_args = EngineArgs(**engine_kwargs(args))
        engine: Any = (Engine(engine_args) if args.engine_in_process
                       else RemoteEngine(engine_args, core_timeout_s=options.core_timeout_s))
    except (ValueError, OSError, EngineCoreError) as exc:
        print(f"pagedrs serve: cannot start the engine: {exc}", file=sys.stderr)
        if trace is not None:
            trace.close()
        return 2
    if args.pin_prefix is not None:
        try:
            pinned = preload_pins(engine, args.pin_prefix, options.prefix_cache_isolation,
                                  frozenset(options.tenants().values()))
        except ValueError as exc:  # PinCapError too: the file asks for more than --max-pinned-fraction
            print(f"pagedrs serve: {exc}", file=sys.stderr)
            engine.shutdown()
            if trace is not None:
                trace.close()
            return 2
        logging.getLogger("pagedrs.server").info("pinned %d prefixes from %s: %s", len(pinned), args.pin_prefix, pinned)
    gc.collect()
    gc.freeze()  # the server's objects so far live as long as it does: out of full collections (mp_client.core_main)
    loop = EngineLoop(engine, trace=trace, request_timeout_s=options.request_timeout_s)
    loop.start()
    app = build_app(loop, args.served_model_name or args.model, args.max_waiting, options)
    config = uvicorn_config(app, args.host, args.port, args.log_level, options)
    server = draining_server(config, app.state.drain, loop, options.shutdown_timeout_s, exit_when_engine_dies=True)
    try:
        server.run()  # returns after SIGTERM/SIGINT and the drain, or once the engine died (shutdown.py)
    finally:
        loop.stop()  # anything still in the engine is aborted and its pages freed
        app.state.ctx.prompts.close()
        engine.shutdown()  # the core process (and any tensor-parallel workers) exit
        if trace is not None:
            trace.close()
    return ENGINE_DEAD_EXIT if server.engine_died else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
