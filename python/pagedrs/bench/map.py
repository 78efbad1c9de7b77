"""``pagedrs bench map``: where paging pays and where it does not, as a map of throughput ratios.

The seeds say paged KV wins 2-4x over contiguous reservation, and to skip it for a single user,
equal sequence lengths or a very small model. This measures both claims on one grid
(``map_grid``: concurrency x spread of lengths x shared-prefix share) with everything but the
layout equal: the same requests, the same KV pool in bytes and blocks (``equal_memory_pool``),
the same ``max_model_len``, greedy decoding with ``ignore_eos`` (every request generates exactly
its ``max_tokens``), all requests submitted at t=0, ``max_num_seqs`` = the cell's concurrency.

- paged: ``kv_layout="paged"`` with prefix caching (shared system prompts are stored once),
  the engine's default admission (``expected_growth``) and preemption (``auto``);
- contiguous: ``kv_layout="contiguous"`` reserving ``max_model_len`` tokens per sequence up front
  (the traditional baseline; no sharing, no swapping). A request that finds no free region waits
  in the queue until a running one finishes; it is never refused, since every request fits one.

Per cell and layout: tokens/s (median over ``repeats`` runs, alternating the layouts' order), peak
concurrency reached, preemptions, prefix-cache hits (blocks) and cached prompt tokens, and whether
both layouts produced the same tokens. The ratio drawn is paged tokens/s over contiguous tokens/s.
The main model (``--model``, SmolLM2 by default) runs the whole grid, a random-weight llama of
negligible compute (``overhead.write_model``) runs the grid's corners beside it.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import EngineRun, build_engine, progress, run_requests, warm_up
from pagedrs.bench.map_grid import FULL, QUICK, MapCell, MapGrid, cell_requests, equal_memory_pool
from pagedrs.bench.model_spec import kv_geometry, resolve_model
from pagedrs.bench.report import Column, markdown_table, render
from pagedrs.bench.throughput import KVBudget
from pagedrs.bench.workloads import BenchRequest

LAYOUTS = ("paged", "contiguous")
TINY_LAYERS = 4  # the "very small model": hidden 64, one KV head, 4 layers, vocabulary 512


@dataclasses.dataclass(frozen=True)
class MapModel:
    name: str  # label in tables and JSON
    path: str  # what EngineArgs.model gets


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the pictures cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            "pagedrs bench map draws heatmaps with matplotlib, which is not installed: "
            "pip install -r requirements-dev.txt (or pip install 'pagedrs[bench]'), or pass --no-plot "
            "to write the JSON and markdown only"
        ) from e


def _engine(model: MapModel, layout: str, cell: MapCell, budget: KVBudget, grid: MapGrid, cfg: BenchConfig) -> Any:
    return build_engine(
        model.path,
        device=cfg.device,
        dtype=cfg.dtype,
        block_size=budget.block_size,
        kv_layout=layout,
        num_gpu_blocks=budget.num_gpu_blocks,
        max_model_len=grid.max_total_len,
        max_num_seqs=cell.concurrency,
        enable_prefix_caching=layout == "paged",  # the contiguous baseline cannot share
        skip_tokenizer_init=True,  # prompts and outputs are token ids; the random model has no tokenizer
        seed=grid.seed,
    )


def _check_complete(run: EngineRun, requests: list[BenchRequest], layout: str) -> None:
    short = [r.request_id for r in requests if len(run.output_token_ids[r.request_id]) != r.max_tokens]
    if short:
        raise RuntimeError(f"{layout}: {len(short)} requests did not generate their max_tokens, e.g. {short[:3]}")


def _layout_result(runs: list[tuple[EngineRun, float]]) -> dict[str, Any]:
    rates = [r.num_output_tokens / r.wall_s for r, _ in runs]
    cpu_rates = [r.num_output_tokens / cpu_s for r, cpu_s in runs]
    first = runs[0][0]
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_runs": rates,
        # per CPU-second of this process (torch runs one thread): what a loaded machine's waits leave out
        "tokens_per_cpu_s": statistics.median(cpu_rates),
        "cpu_s": statistics.median(cpu_s for _, cpu_s in runs),
        "wall_s": statistics.median(r.wall_s for r, _ in runs),
        "peak_concurrency": max(s.num_running for s in first.samples),
        "mean_concurrency": statistics.fmean(s.num_running for s in first.samples),
        "peak_used_blocks": max(s.used_blocks for s in first.samples),
        "num_steps": int(first.counters["num_steps"]),
        "preemptions": int(first.counters["num_preemptions"]),
        "prefix_hit_blocks": int(first.counters["prefix_hits"]),
        "prefix_query_blocks": int(first.counters["prefix_queries"]),
        "cached_prompt_tokens": int(first.counters["num_cached_prompt_tokens"]),
        "prompt_tokens_computed": int(first.counters["num_prompt_tokens_computed"]),
        "num_output_tokens": first.num_output_tokens,
    }


def run_cell(model: MapModel, grid: MapGrid, cell: MapCell, budget: KVBudget, vocab: int, cfg: BenchConfig) -> dict[str, Any]:
    """Both layouts on the cell's requests; ``repeats`` runs each, the layouts' order alternating."""
    workload = cell_requests(grid, cell, vocab)
    engines = {layout: _engine(model, layout, cell, budget, grid, cfg) for layout in LAYOUTS}
    for engine in engines.values():
        warm_up(engine, vocab)
    runs: dict[str, list[tuple[EngineRun, float]]] = {layout: [] for layout in LAYOUTS}
    for k in range(grid.repeats):
        requests = [dataclasses.replace(r, request_id=f"{r.request_id}-r{k}") for r in workload.requests]
        for layout in LAYOUTS if k % 2 == 0 else LAYOUTS[::-1]:
            engine = engines[layout]
            if layout == "paged":
                engine.reset_prefix_cache()  # every repeat starts cold: no hits from the one before
            cpu_start = time.process_time()
            run = run_requests(engine, requests, label=f"map {model.name} {cell.key()} {layout}")
            cpu_s = time.process_time() - cpu_start
            _check_complete(run, requests, layout)
            runs[layout].append((run, cpu_s))
    del engines
    gc.collect()
    out: dict[str, Any] = {"concurrency": cell.concurrency, "spread": cell.spread, "share": cell.share,
                           "workload": workload.summary()}
    for layout in LAYOUTS:
        out[layout] = _layout_result(runs[layout])
    paged, contiguous = runs["paged"][0][0].output_token_ids, runs["contiguous"][0][0].output_token_ids
    out["identical_outputs"] = sum(paged[i] == contiguous[i] for i in paged)
    out["ratio"] = out["paged"]["tokens_per_s"] / out["contiguous"]["tokens_per_s"]
    out["ratio_cpu"] = out["paged"]["tokens_per_cpu_s"] / out["contiguous"]["tokens_per_cpu_s"]
    return out


def run_map(model: MapModel, grid: MapGrid, cfg: BenchConfig) -> dict[str, Any]:
    """Every cell of ``grid`` on ``model``: the pool, the cells, and where each ran."""
    geo = kv_geometry(resolve_model(model.path), cfg.dtype)
    if grid.max_total_len > geo.context_len:
        raise ValueError(f"max_total_len {grid.max_total_len} exceeds {model.name}'s context length {geo.context_len}")
    budget = equal_memory_pool(grid, geo, cfg.block_size)
    cells = []
    for n, cell in enumerate(grid.cells(), 1):
        result = run_cell(model, grid, cell, budget, geo.vocab_size, cfg)
        progress(f"map {model.name} {n}/{len(grid.cells())} {cell.key()}: paged {result['paged']['tokens_per_s']:.1f} "
                 f"tok/s, contiguous {result['contiguous']['tokens_per_s']:.1f} tok/s, ratio {result['ratio']:.2f} (per CPU-s {result['ratio_cpu']:.2f})")
        cells.append(result)
    return {
        "model": model.name,
        "grid": dataclasses.asdict(grid),
        "kv_pool": {**budget.to_dict(), "max_model_len": grid.max_total_len,
                    "contiguous_reservations": budget.num_gpu_blocks // -(-grid.max_total_len // budget.block_size)},
        "cells": cells,
    }


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    if cfg.plot:
        require_matplotlib()
    grid = QUICK if cfg.quick else FULL
    from pagedrs.bench.overhead import write_model

    maps = [run_map(MapModel(cfg.model, cfg.model), grid, cfg)]
    with tempfile.TemporaryDirectory(prefix="pagedrs-map-tiny-") as tmp:
        tiny = write_model(Path(tmp), layers=TINY_LAYERS)
        # Its runs take milliseconds: three repeats at least, so the median means something.
        corners = dataclasses.replace(grid.corners(), repeats=max(3, grid.repeats))
        maps.append(run_map(MapModel(f"tiny random llama ({TINY_LAYERS} layers, hidden 64)", str(tiny)), corners, cfg))
    data: dict[str, Any] = {"maps": maps, "dtype": cfg.dtype, "device": cfg.device, "machine": machine}
    if cfg.plot:
        from pagedrs.bench.map_plot import plot_map

        plot_dir = cfg.plot_dir or cfg.out_dir
        if plot_dir:
            data["pictures"] = plot_map(data, plot_dir)
            for path in data["pictures"]:
                progress(f"wrote {path}")
    return data, markdown(data, machine)


_COLUMNS = [
    Column("share", "share_pct", "{:.0f}%"),
    Column("spread", "spread", "{:g}x"),
    Column("concurrency", "concurrency"),
    Column("paged tok/s", "paged_tps", "{:.1f}"),
    Column("contiguous tok/s", "contiguous_tps", "{:.1f}"),
    Column("ratio", "ratio", "{:.2f}"),
    Column("ratio per CPU-s", "ratio_cpu", "{:.2f}"),
    Column("peak seqs paged / contig", "peaks"),
    Column("preemptions paged", "preemptions"),
    Column("prefix hit blocks", "hits"),
    Column("same tokens", "same"),
]


def _rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [{
        "share_pct": 100 * c["share"], "spread": c["spread"], "concurrency": c["concurrency"],
        "paged_tps": c["paged"]["tokens_per_s"], "contiguous_tps": c["contiguous"]["tokens_per_s"],
        "ratio": c["ratio"], "ratio_cpu": c["ratio_cpu"], "peaks": f"{c['paged']['peak_concurrency']} / {c['contiguous']['peak_concurrency']}",
        "preemptions": c["paged"]["preemptions"], "hits": c["paged"]["prefix_hit_blocks"],
        "same": f"{c['identical_outputs']}/{c['workload']['num_requests']}",
    } for c in m["cells"]]


def markdown(data: dict[str, Any], machine: str) -> str:
    parts = []
    for m in data["maps"]:
        pool, g = m["kv_pool"], m["grid"]
        notes = [
            f"Equal memory: both layouts get {pool['num_gpu_blocks']} blocks x {pool['block_size']} tokens = "
            f"{pool['token_slots']} slots = {pool['bytes']:,} bytes ({pool['bytes_per_token']} bytes/token, "
            f"{data['dtype']}): {pool['contiguous_reservations']} contiguous reservations of max_model_len "
            f"{pool['max_model_len']}; contiguous queues what does not fit, both finish every request.",
            f"Requests per cell: max({g['min_requests']}, {g['requests_per_user']} x concurrency), all at t=0, "
            f"max_num_seqs = concurrency; totals in [L/spread, L], L = {g['max_total_len']}, prompt = "
            f"{g['prompt_fraction']:.0%} of the total; share = fraction of each prompt from one common system prompt.",
            f"tokens/s: median of {g['repeats']} run(s) per layout and cell; ratio = paged / contiguous in wall "
            "time; 'per CPU-s' divides by this process's CPU time instead (torch runs one thread), which other "
            "processes' load leaves out: the pictures draw it. Seeds' 'skip it' cells: concurrency 1 and spread 1.",
        ]
        parts.append(render(f"Paged vs contiguous map: {m['model']}", markdown_table(_rows(m), _COLUMNS), notes, machine))
    return "\n".join(parts)
