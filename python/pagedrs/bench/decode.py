"""Decode speed next to the machine's limits: tokens/s per weight format, batch size and prompt length.

Workload: B requests of P random prompt tokens (seeded), 64 new tokens each, greedy with
ignore_eos, all submitted at once; the prompt goes in one prefill step and the rest are
decode steps. ``decode tok/s`` counts the tokens of the decode steps over their time;
prefill is reported apart. ``per CPU-s`` divides by this process's CPU time instead of
the wall clock: on a shared machine it leaves out the time the process waited for a core.

Bounds (measured in the same run by ``limits``, because the machine may be shared):
``stream`` = B * bandwidth / bytes of the linear weights (each decode step reads them once),
``gemm`` = GEMM FLOP/s at M=B for the format / (2 * linear parameters per token); the
bound is the smaller. Attention and the Python around the step are what the ratio loses.

``--llama-bench PATH`` adds llama.cpp's batch-1 rows on the same GGUF and thread count, timed in
the same run (``llama_cpp.py``), and a note with each format's ratio to it (issue 30).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.decode_grid import FULL_GRID, QUICK_GRID
from pagedrs.bench.engine_runner import bench_threads, build_engine, greedy_params, progress
from pagedrs.bench.limits import measure, model_shape
from pagedrs.bench.report import Column, markdown_table, render


def _linear_stats(model: Any) -> tuple[int, int]:
    """(bytes of linear weights read per step, linear parameters = multiply-adds per token)."""
    from pagedrs.models.layers import LinearBase

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    return model.weight_bytes(), sum(m.in_per_rank * m.out_per_rank for m in layers)


def decode_once(engine: Any, vocab: int, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    for i in range(batch):
        prompt = rng.integers(vocab // 4, vocab - 1, size=prompt_len).tolist()
        engine.add_request(f"d{seed}-{i}", {"prompt_token_ids": prompt}, greedy_params(new_tokens))
    start = time.perf_counter()
    engine.step()  # the whole prefill (max_num_batched_tokens covers B * P) and each first token
    prefill_done, cpu_start = time.perf_counter(), time.process_time()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    end, cpu_end = time.perf_counter(), time.process_time()
    decode_tokens = batch * (new_tokens - 1)
    return {"prefill_tok_per_s": batch * prompt_len / (prefill_done - start),
            "decode_tok_per_s": decode_tokens / (end - prefill_done), "decode_steps": steps,
            # per second of this process's CPU time: on a shared machine, the time it was not descheduled
            # (meaningful with one thread; with N threads it sums their times)
            "decode_tok_per_cpu_s": decode_tokens / max(cpu_end - cpu_start, 1e-9),
            "e2e_tok_per_s": batch * new_tokens / (end - start)}


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    grid = QUICK_GRID if cfg.quick else FULL_GRID
    gguf = None
    if cfg.llama_bench is not None:  # refused before the grid runs, not after
        from pagedrs.bench.llama_cpp import check_binary, gguf_of

        gguf = gguf_of(cfg.model)
        check_binary(cfg.llama_bench)
    formats = grid.formats if cfg.weight_dtype is None else tuple(cfg.weight_dtype.split(","))
    hidden, intermediate = model_shape(cfg.model)
    progress("decode: measuring the machine's limits")
    limits = measure(grid.batch_sizes, tuple(f for f in formats if f != "auto") or ("float32",), hidden,
                     intermediate, quick=cfg.quick)
    bandwidth = limits["read_bandwidth_bytes_per_s"]
    rows: list[dict[str, Any]] = []
    max_batch, max_prompt = max(grid.batch_sizes), max(grid.prompt_lens)
    for fmt in formats:
        tokens = max_batch * (max_prompt + grid.new_tokens)
        engine = build_engine(cfg.model, weight_dtype=fmt, num_gpu_blocks=tokens // cfg.block_size + 2 * max_batch,
                              block_size=cfg.block_size, enable_prefix_caching=False,
                              max_num_batched_tokens=max(2048, max_batch * max_prompt), max_num_seqs=max_batch)
        resolved = engine.loaded.weight_format.name
        weight_bytes, linear_params = _linear_stats(engine.loaded.model)
        vocab = engine.loaded.config.vocab_size
        decode_once(engine, vocab, 1, 8, 3, seed=0)  # warm-up
        for batch in grid.batch_sizes:
            for prompt_len in grid.prompt_lens:
                progress(f"decode: {resolved} batch {batch} prompt {prompt_len}")
                r = decode_once(engine, vocab, batch, prompt_len, grid.new_tokens, seed=batch * 1000 + prompt_len)
                gemm = limits["gemm_flops"].get(resolved, {}).get(batch)
                stream_bound = batch * bandwidth / weight_bytes
                gemm_bound = gemm / (2 * linear_params) if gemm else None
                bound = min(stream_bound, gemm_bound) if gemm_bound else stream_bound
                rows.append({"weights": resolved, "batch": batch, "prompt": prompt_len, **r,
                             "stream_bound": stream_bound, "gemm_bound": gemm_bound, "bound": bound,
                             "ratio_to_bound": r["decode_tok_per_s"] / bound,
                             "cpu_ratio_to_bound": r["decode_tok_per_cpu_s"] / bound, "weight_bytes": weight_bytes})
        del engine
        gc.collect()
    data: dict[str, Any] = {"rows": rows, "limits": limits, "grid": asdict(grid), "model": cfg.model,
                            "machine": machine}
    if cfg.llama_bench is not None and gguf is not None:
        data["llama_cpp"] = _llama_cpp_rows(cfg.llama_bench, gguf, grid.prompt_lens, grid.new_tokens, bandwidth, rows)
        rows.extend(data["llama_cpp"]["rows"])
    return data, _markdown(data, machine)


def _llama_cpp_rows(binary: str, gguf: Path, prompt_lens: tuple[int, ...], new_tokens: int, bandwidth: float,
                    ours: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's batch-1 rows on the same GGUF and threads, with the bound of our gguf rows (the same blocks)."""
    from pagedrs.bench.llama_cpp import run_llama_bench

    threads = bench_threads()
    weight_bytes = next((r["weight_bytes"] for r in ours if r["weights"] == "gguf"), None)
    bound = bandwidth / weight_bytes if weight_bytes else None
    rows, commands = [], []
    for prompt_len in prompt_lens:
        progress(f"decode: llama.cpp batch 1 prompt {prompt_len}")
        r = run_llama_bench(binary, gguf, threads=threads, prompt=prompt_len, gen=new_tokens)
        commands.append(r.command)
        rows.append({"weights": "llama.cpp", "batch": 1, "prompt": prompt_len,
                     "decode_tok_per_s": r.decode_tok_per_s, "prefill_tok_per_s": r.prefill_tok_per_s,
                     "stream_bound": bound, "bound": bound, "weight_bytes": weight_bytes,
                     "ratio_to_bound": r.decode_tok_per_s / bound if bound else None, "build": r.build})
    return {"rows": rows, "commands": commands, "threads": threads}


_COLUMNS = [
    Column("weights", "weights"),
    Column("batch", "batch"),
    Column("prompt", "prompt"),
    Column("decode tok/s", "decode_tok_per_s", "{:.1f}"),
    Column("per CPU-s", "decode_tok_per_cpu_s", "{:.1f}"),
    Column("stream bound", "stream_bound", "{:.0f}"),
    Column("GEMM bound", "gemm_bound", "{:.0f}"),
    Column("of bound", "ratio_to_bound", "{:.0%}"),
    Column("of bound, CPU-s", "cpu_ratio_to_bound", "{:.0%}"),
    Column("prefill tok/s", "prefill_tok_per_s", "{:.0f}"),
    Column("end-to-end tok/s", "e2e_tok_per_s", "{:.1f}"),
]


def _markdown(data: dict[str, Any], machine: str) -> str:
    lim = data["limits"]
    weights = {r["weights"]: r["weight_bytes"] for r in data["rows"] if r["weights"] != "llama.cpp"}
    notes = [
        f"Limits measured in this run: read bandwidth {lim['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; GEMM "
        + "; ".join(f"{f} " + ", ".join(f"M={m}: {v / 1e9:.0f}" for m, v in g.items()) + " GFLOP/s"
                    for f, g in lim["gemm_flops"].items()) + ".",
        "Linear weight bytes read per step: " + ", ".join(f"{w} {b / 1e6:.0f} MB" for w, b in weights.items()) + ".",
        f"Model {data['model']}; {data['grid']['new_tokens']} new tokens per request, greedy, ignore_eos; "
        "stream bound = B x bandwidth / weight bytes, GEMM bound = GEMM FLOP/s at M=B / (2 x linear params).",
    ]
    if "llama_cpp" in data:
        notes.append(_llama_cpp_note(data))
    return render("Decode speed against the machine's bounds", markdown_table(data["rows"], _COLUMNS), notes, machine)


def _llama_cpp_note(data: dict[str, Any]) -> str:
    """Each of our formats' batch-1 decode rate as a multiple of llama.cpp's, prompt by prompt."""
    lc = data["llama_cpp"]
    theirs = {r["prompt"]: r["decode_tok_per_s"] for r in lc["rows"]}
    ratios = [f"{r['weights']} prompt {r['prompt']}: {r['decode_tok_per_s'] / theirs[r['prompt']]:.2f}x"
              for r in data["rows"] if r["batch"] == 1 and r["weights"] != "llama.cpp" and r["prompt"] in theirs]
    build = lc["rows"][0]["build"] if lc["rows"] else "?"
    return (f"llama.cpp (llama-bench, build {build}, {lc['threads']} threads, same GGUF, same run): batch-1 decode "
            "tokens/s as a multiple of llama.cpp's: " + ", ".join(ratios) + ". Command: " + "; ".join(lc["commands"]))
