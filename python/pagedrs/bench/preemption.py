"""Preemption under memory pressure: swap vs recompute vs auto on the same workload.

The pool holds about a quarter of the KV slots the requests need if they all ran at
once (prompt + output), and the engine admits optimistically, so decoding sequences
outgrow the pool and the scheduler must preempt: pause a victim and copy only the pages
the step needs to host memory (swap, page-granular), copy every page of the victim at
once (swap-whole, vLLM v0's swap, kept as the baseline), or drop its pages and prefill
again later (recompute). Greedy decoding must give the same tokens whichever way a
sequence was interrupted; the table says whether it did, and how many pages and bytes
each mode moved between device and host.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import build_engine, run_requests, warm_up
from pagedrs.bench.model_spec import kv_geometry, resolve_model
from pagedrs.bench.report import Column, markdown_table, render
from pagedrs.bench.workloads import LengthDistribution, WorkloadSpec, synthetic_workload

MODES = ("swap", "swap-whole", "recompute", "auto")
DEMAND_OVER_POOL = 4.0

QUICK = WorkloadSpec(
    name="preemption-quick",
    num_requests=16,
    prompt=LengthDistribution(mean=32, sigma=0.6, minimum=4, maximum=128),
    output=LengthDistribution(mean=64, sigma=0.5, minimum=8, maximum=192),
    max_model_len=384,
    seed=1,
)
FULL = dataclasses.replace(
    QUICK,
    name="preemption-full",
    num_requests=32,
    prompt=LengthDistribution(mean=48, sigma=0.6, minimum=4, maximum=256),
    output=LengthDistribution(mean=96, sigma=0.5, minimum=8, maximum=384),
    max_model_len=768,
)


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    spec = QUICK if cfg.quick else FULL
    if cfg.num_requests is not None:
        spec = dataclasses.replace(spec, num_requests=cfg.num_requests)
    geo = kv_geometry(resolve_model(cfg.model), cfg.dtype)
    spec = dataclasses.replace(spec, max_model_len=min(spec.max_model_len, geo.context_len))
    workload = synthetic_workload(spec, geo.vocab_size)
    bs = cfg.block_size
    demand_blocks = sum(-(-r.total_len // bs) for r in workload.requests)
    longest_blocks = max(-(-r.total_len // bs) for r in workload.requests)
    pool = max(longest_blocks + 1, round(demand_blocks / DEMAND_OVER_POOL))

    data: dict[str, Any] = {}
    tokens: dict[str, dict[str, list[int]]] = {}
    for mode in MODES:
        engine = build_engine(
            cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            block_size=bs,
            num_gpu_blocks=pool,
            max_model_len=spec.max_model_len,
            preemption_mode="swap" if mode == "swap-whole" else mode,
            enable_prefix_caching=False,  # recompute must really recompute
            swap_space_gb=1.0,  # the CPU default is no host tier (one RAM); swap modes need one
            # Optimistic admission, so that the pool preempts: expected-growth admission (the
            # default) avoids most preemptions, which is the throughput bench's business.
            admission_policy="prompt_only",
            seed=spec.seed,
        )
        engine.scheduler.set_whole_sequence_swap(mode == "swap-whole")
        warm_up(engine, geo.vocab_size)
        result = run_requests(engine, workload.requests, label=f"preemption {mode}")
        del engine
        gc.collect()
        c = result.counters
        final = result.final_stats
        prompt_tokens = sum(len(r.prompt_token_ids) for r in workload.requests)
        data[mode] = {
            "tokens_per_s": result.num_output_tokens / result.wall_s,
            "requests_per_s": len(workload.requests) / result.wall_s,
            "num_preemptions": int(c["num_preemptions"]),
            "swap_preemptions": int(c["num_swap_preemptions"]),
            "recompute_preemptions": int(c["num_recompute_preemptions"]),
            # preemption's own copies (the warm-up preempts nothing, so the totals are this run's)
            "pages_swapped_out": int(final["num_pages_swapped_out"]),
            "pages_swapped_in": int(final["num_pages_swapped_in"]),
            "pages_moved": int(final["num_pages_swapped_out"] + final["num_pages_swapped_in"]),
            "bytes_moved": int(final["swap_bytes_out"] + final["swap_bytes_in"]),
            "recomputed_tokens": int(c["num_prompt_tokens_computed"]) - prompt_tokens,
            "peak_concurrency": max(s.num_running for s in result.samples),
            "wall_s": result.wall_s,
        }
        tokens[mode] = result.output_token_ids

    ids = [r.request_id for r in workload.requests]
    identical = sum(all(tokens[m][i] == tokens["recompute"][i] for m in MODES) for i in ids)
    data["identical_outputs"] = identical
    data["num_requests"] = len(ids)
    data["outputs_match"] = identical == len(ids)
    whole_bytes = data["swap-whole"]["bytes_moved"]
    data["page_over_whole_bytes"] = data["swap"]["bytes_moved"] / whole_bytes if whole_bytes else None
    data["pool_blocks"] = pool
    data["block_size"] = bs
    data["demand_blocks"] = demand_blocks
    data["workload"] = workload.summary()
    data["model"] = cfg.model
    data["machine"] = machine
    return data, _markdown(data, machine)


_COLUMNS = [
    Column("mode", "label"),
    Column("tokens/s", "tokens_per_s", "{:.1f}"),
    Column("requests/s", "requests_per_s", "{:.3f}"),
    Column("preemptions", "num_preemptions"),
    Column("swap / recompute", "split"),
    Column("pages moved (out+in)", "pages_moved"),
    Column("MiB moved", "mib_moved", "{:.2f}"),
    Column("recomputed tokens", "recomputed_tokens"),
    Column("peak concurrent seqs", "peak_concurrency"),
    Column("wall s", "wall_s", "{:.1f}"),
]


def _markdown(data: dict[str, Any], machine: str) -> str:
    rows = [
        {"label": m, "split": f"{data[m]['swap_preemptions']} / {data[m]['recompute_preemptions']}",
         "mib_moved": data[m]["bytes_moved"] / 2**20, **data[m]}
        for m in MODES
    ]
    w = data["workload"]
    notes = [
        f"Demand {data['demand_blocks']} blocks (all requests at full length) over a pool of "
        f"{data['pool_blocks']} blocks = {data['demand_blocks'] / data['pool_blocks']:.1f}x.",
        f"Workload: {w['num_requests']} requests, prompt mean {w['prompt_len']['mean']}, output mean "
        f"{w['output_len']['mean']}, greedy, ignore_eos, all submitted at t=0.",
        "swap pauses a victim and moves only the pages a step needs; swap-whole moves every page of it "
        "(the pre-page-granular baseline). Bytes moved by page-granular swap over whole-sequence swap: "
        + (f"{data['page_over_whole_bytes']:.2f}x." if data["page_over_whole_bytes"] is not None else "n/a (no swap)."),
        f"Identical greedy outputs across {', '.join(MODES)}: {data['identical_outputs']}/"
        f"{data['num_requests']} ({'match' if data['outputs_match'] else 'MISMATCH'}).",
    ]
    return render("Preemption: page-granular swap vs whole-sequence swap vs recompute vs auto", markdown_table(rows, _COLUMNS), notes, machine)
