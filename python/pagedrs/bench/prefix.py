"""Prefix sharing: N requests = one long system prompt + a short distinct question each.

Run twice on the paged engine, prefix caching on and off, everything else equal. With
caching on, the system prompt's full blocks are stored once and every later request
maps them into its block table, so pages in use grow by the question pages only and
the shared prefill is skipped. All requests are submitted at t=0, so the numbers also
show how soon the engine can reuse blocks written in the same or the previous step.

The pool is sized for ``N / 4`` requests without sharing (at least 8): caching off
must run in waves, caching on fits them all. Pages used per running sequence, taken at
the step with the most pages in use, makes the two comparable.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import EngineRun, build_engine, run_requests, warm_up
from pagedrs.bench.model_spec import kv_geometry, load_tokenizer, resolve_model
from pagedrs.bench.report import Column, markdown_table, render
from pagedrs.bench.workloads import BenchRequest, shared_prefix_requests

FULL_SETTINGS = {"num_requests": 64, "prefix_tokens": 1024, "max_tokens": 8, "max_model_len": 1280}
QUICK_SETTINGS = {"num_requests": 64, "prefix_tokens": 256, "max_tokens": 4, "max_model_len": 512}


def _pool_blocks(requests: list[BenchRequest], block_size: int, max_model_len: int) -> int:
    longest = max(r.total_len for r in requests)
    per_request = -(-longest // block_size)
    return max(8, len(requests) // 4) * per_request + -(-max_model_len // block_size)


def _summary(run: EngineRun, requests: list[BenchRequest], prefix_tokens: int, block_size: int) -> dict[str, Any]:
    peak = max(run.samples, key=lambda s: s.used_blocks)
    ttft = np.array(list(run.ttft_s.values()))
    shared_total = prefix_tokens * len(requests)
    cached = run.counters["num_cached_prompt_tokens"]
    return {
        "peak_pages_used": peak.used_blocks,
        "running_at_peak": peak.num_running,
        "pages_per_running_seq": peak.used_blocks / max(1, peak.num_running),
        "peak_concurrency": max(s.num_running for s in run.samples),
        "prefill_tokens_computed": int(run.counters["num_prompt_tokens_computed"]),
        "cached_prompt_tokens": int(cached),
        "shared_prefill_skipped_pct": 100.0 * cached / shared_total,
        "prefix_hit_blocks": int(run.counters["prefix_hits"]),
        "prefix_query_blocks": int(run.counters["prefix_queries"]),
        "median_ttft_s": float(np.median(ttft)),
        "p90_ttft_s": float(np.percentile(ttft, 90)),
        "wall_s": run.wall_s,
        "requests_per_s": len(requests) / run.wall_s,
        "system_prompt_pages": -(-prefix_tokens // block_size),
    }


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    settings = dict(QUICK_SETTINGS if cfg.quick else FULL_SETTINGS)
    if cfg.num_requests is not None:
        settings["num_requests"] = cfg.num_requests
    folder = resolve_model(cfg.model)
    geo = kv_geometry(folder, cfg.dtype)
    settings["max_model_len"] = min(settings["max_model_len"], geo.context_len)
    # Leave room for the question and the answer after the shared prompt.
    settings["prefix_tokens"] = min(settings["prefix_tokens"], settings["max_model_len"] - 128)
    _, requests = shared_prefix_requests(
        load_tokenizer(folder), settings["num_requests"], settings["prefix_tokens"], settings["max_tokens"]
    )
    settings["block_size"] = cfg.block_size
    data: dict[str, Any] = {}
    for caching in (True, False):
        engine_kwargs = dict(
            device=cfg.device,
            dtype=cfg.dtype,
            block_size=cfg.block_size,
            max_model_len=settings["max_model_len"],
            enable_prefix_caching=caching,
            kv_layout="paged",
        )
        blocks = _pool_blocks(requests, cfg.block_size, settings["max_model_len"])
        engine = build_engine(cfg.model, num_gpu_blocks=blocks, **engine_kwargs)
        warm_up(engine, geo.vocab_size)
        result = _summary(run_requests(engine, requests, label=f"prefix caching={caching}"), requests, settings["prefix_tokens"], cfg.block_size)
        result["pool_blocks"] = blocks
        data["caching_on" if caching else "caching_off"] = result
        del engine
        gc.collect()
    on, off = data["caching_on"], data["caching_off"]
    data["prefill_saved_pct"] = 100.0 * (1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"])
    data["settings"] = settings
    data["model"] = cfg.model
    data["machine"] = machine
    return data, _markdown(data, machine)


_COLUMNS = [
    Column("prefix caching", "label"),
    Column("peak pages used", "peak_pages_used"),
    Column("running at that step", "running_at_peak"),
    Column("pages / running seq", "pages_per_running_seq", "{:.1f}"),
    Column("prefill tokens computed", "prefill_tokens_computed"),
    Column("shared prefill skipped", "shared_prefill_skipped_pct", "{:.1f}%"),
    Column("median TTFT s", "median_ttft_s", "{:.2f}"),
    Column("p90 TTFT s", "p90_ttft_s", "{:.2f}"),
    Column("requests/s", "requests_per_s", "{:.2f}"),
    Column("wall s", "wall_s", "{:.1f}"),
]


def _markdown(data: dict[str, Any], machine: str) -> str:
    rows = [{"label": "on", **data["caching_on"]}, {"label": "off", **data["caching_off"]}]
    s = data["settings"]
    notes = [
        f"{s['num_requests']} requests sharing a {s['prefix_tokens']}-token system prompt "
        f"({data['caching_on']['system_prompt_pages']} pages) + a short distinct question each; "
        f"{s['max_tokens']} output tokens each, greedy; all submitted at t=0.",
        f"Prefill tokens saved by caching: {data['prefill_saved_pct']:.1f}%. "
        f"Pool: {data['caching_on']['pool_blocks']} blocks of {s['block_size']} tokens.",
        f"TTFT is measured from submission (t=0), so it includes queueing. Model {data['model']}.",
    ]
    return render("Prefix sharing (paged engine)", markdown_table(rows, _COLUMNS), notes, machine)
