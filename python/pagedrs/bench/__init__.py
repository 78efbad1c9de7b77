"""``pagedrs bench``: benchmarks that back the project's claims with its own numbers.

Subcommands (one module each): ``throughput`` (paged vs contiguous vs transformers under
one KV byte budget), ``prefix`` (prefix caching on vs off), ``preemption`` (swap vs
recompute vs auto), ``allocator`` (Rust BlockManager vs pure Python), ``all`` (those four);
and, run on their own, ``serve`` (HTTP through ``pagedrs serve`` vs the offline engine),
``beam`` (beam search pages, shared vs private copies), ``multiturn`` (device / host / disk
page tiers on returning chat users), ``limits`` (the machine's read bandwidth and GEMM
FLOP/s), ``decode`` (tokens/s per weight format and batch size, next to those limits),
``tp`` (tensor parallelism, 2 ranks vs 1), ``overhead`` (the host's cost of a decode step, part by
part, on a model of negligible compute), ``structured`` (grammar masks per step, compile times),
``salt`` (the prefix cache's timing side channel across tenants, shared vs salted), ``map``
(paged vs contiguous tokens/s over concurrency x length spread x shared prefix, as heatmaps), ``spec``
(speculative decoding by prompt lookup: tokens/s with and without, acceptance) and ``dp``
(data-parallel replicas on Ray Serve: cache routing vs an approximate prefix router vs power of two).
Each prints a markdown table with the machine it ran on; ``--out DIR`` writes
``DIR/<bench>.json`` and ``DIR/<bench>.md``, ``--plot DIR`` PNG charts, ``--json PATH``
the JSON result (for ``all``: one object keyed by benchmark).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.engine_args import WEIGHT_DTYPES

BENCHES = ("throughput", "prefix", "preemption", "allocator")
# Run only when named: they start servers, take long, or measure the machine rather than the KV manager.
EXTRA_BENCHES = ("serve", "beam", "multiturn", "limits", "decode", "tp", "overhead", "structured", "salt", "map", "spec",
                 "dp")


def _runner(name: str) -> Callable[[BenchConfig, str], tuple[dict[str, Any], str]]:
    import importlib

    return importlib.import_module(f"pagedrs.bench.{name}").run  # type: ignore[no-any-return]


def _weight_dtypes(text: str) -> str:
    """``--weight-dtype``: one format, or several comma-separated (the decode bench times each in one run)."""
    names = text.split(",")
    bad = [n for n in names if n not in WEIGHT_DTYPES]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(WEIGHT_DTYPES)}, comma-separated, once")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedrs bench", description=__doc__.splitlines()[0])
    p.add_argument("benchmark", choices=(*BENCHES, *EXTRA_BENCHES, "all"))
    p.add_argument("--quick", action="store_true", help="small workloads (minutes on 2 CPU cores)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the JSON result here")
    p.add_argument("--out", dest="out_dir", metavar="DIR", help="write <bench>.json and <bench>.md here")
    p.add_argument("--plot", dest="plot_dir", metavar="DIR", help="write PNG charts here")
    p.add_argument("--num-requests", type=int, metavar="N", help="override the request count")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a model folder or a .gguf file")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--weight-dtype", type=_weight_dtypes, default=None, metavar="FMT[,FMT...]",
                   help=f"one of {', '.join(WEIGHT_DTYPES)}; decode: these formats instead of the grid's (comma-"
                        "separated, timed in one run); spec: the weights' format (default auto); tp: the weights' "
                        "format on every rank; the other benches use float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--workload", choices=("random", "prefix", "both"), default="both",
                   help="serve: the random-length workload, the shared-prefix one, or both (default)")
    p.add_argument("--no-offline", action="store_true", help="serve: skip the offline engine runs")
    p.add_argument("--serve-args", default="", metavar="FLAGS",
                   help="serve: extra `pagedrs serve` flags, e.g. \"--max-num-batched-tokens 512\"")
    p.add_argument("--no-plot", action="store_true",
                   help="map: write JSON and markdown only (no heatmaps; matplotlib not needed)")
    p.add_argument("--layers", type=int, metavar="N", help="overhead: layers of the deep model (default 30)")
    p.add_argument("--draft-model", metavar="PATH", default=None,
                   help="spec: also speculate with this draft model (method draft_model; e.g. the model itself, "
                        "a smoke test: acceptance ~1.0, not a speedup)")
    p.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="decode: also time llama.cpp's llama-bench binary on the same GGUF, at batch 1 with "
                        "--threads threads, in this run (issue 30's side-by-side)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads for every system (default 1: on a shared machine, OpenMP "
        "barriers across busy cores stall; measured 30x slower with 2 threads at load 4 on 2 cores)",
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.num_requests is not None and args.num_requests < 1:
        print(f"--num-requests must be >= 1, got {args.num_requests}", file=sys.stderr)
        return 2
    if args.weight_dtype is not None and "," in args.weight_dtype and args.benchmark != "decode":
        print(f"--weight-dtype {args.weight_dtype}: several formats are for the decode bench only; "
              f"{args.benchmark} takes one", file=sys.stderr)
        return 2
    if args.llama_bench is not None and args.benchmark != "decode":
        print(f"--llama-bench is for the decode bench only, not {args.benchmark}", file=sys.stderr)
        return 2
    if args.layers is not None and args.layers < 1:
        print(f"--layers must be >= 1, got {args.layers}", file=sys.stderr)
        return 2
    if args.threads is not None:  # before any model exists, so every system runs alike
        if args.threads < 1:
            print(f"--threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
        from pagedrs.bench.engine_runner import set_bench_threads

        set_bench_threads(args.threads)  # every system's count (engine_runner.bench_threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cfg = BenchConfig(
        model=args.model,
        quick=args.quick,
        num_requests=args.num_requests,
        out_dir=args.out_dir,
        plot_dir=args.plot_dir,
        json_path=args.json_path,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        weight_dtype=args.weight_dtype,
        serve_workloads=("random", "prefix") if args.workload == "both" else (args.workload,),
        serve_offline=not args.no_offline,
        serve_args=tuple(shlex.split(args.serve_args)),
        layers=args.layers,
        draft_model=args.draft_model,
        llama_bench=args.llama_bench,
        plot=not args.no_plot,
    )
    from pagedrs.bench.machine import describe_machine
    from pagedrs.bench.plots import PLOTTERS
    from pagedrs.bench.report import write_json, write_outputs

    machine = describe_machine().describe()
    names = BENCHES if args.benchmark == "all" else (args.benchmark,)
    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        data, markdown = _runner(name)(cfg, machine)
        data["bench_seconds"] = time.perf_counter() - start
        print(markdown, flush=True)
        for path in write_outputs(cfg.out_dir, name, data, markdown):
            print(f"wrote {path}")
        if cfg.plot_dir and name in PLOTTERS:
            for path in PLOTTERS[name](data, cfg.plot_dir):
                print(f"wrote {path}")
        results[name] = data
    if cfg.json_path:
        write_json(cfg.json_path, results if args.benchmark == "all" else results[args.benchmark])
        print(f"wrote {cfg.json_path}")
    return 0
