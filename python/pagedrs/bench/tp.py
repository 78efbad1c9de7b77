"""``pagedrs bench tp``: tensor parallelism against one rank, same machine, same threads per rank.

Runs the throughput benchmark's ShareGPT-like workload (``--quick``: its quick preset)
through the engine with ``tensor_parallel_size`` 1 and the smallest size above 1 that splits
the model's heads (3 for SmolLM2's 9 heads; gloo on the CPU), greedy
and ``ignore_eos`` so both generate the same tokens, and reports tokens/s and the share of
rank 0's step time spent in the model's all-reduces. On a 2-core CPU no speed-up is
expected: each rank gets one core, and every layer adds two all-reduces through loopback
TCP; the numbers say what tensor parallelism costs where it cannot pay. ``--weight-dtype``: the
weights' format on every rank (default float32; ``gguf`` shards the file's blocks per rank).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.report import Column, markdown_table, render
from pagedrs.bench.workloads import FULL, QUICK, synthetic_workload


def _one(cfg: BenchConfig, tp: int, workload: Any) -> dict[str, Any]:
    from pagedrs import Engine, EngineArgs, SamplingParams
    from pagedrs.distributed import parallel_state

    engine = Engine(EngineArgs(model=cfg.model, dtype=cfg.dtype, weight_dtype=_format(cfg), block_size=cfg.block_size,
                               cpu_threads=1, tensor_parallel_size=tp, max_model_len=workload.spec.max_model_len,
                               kv_host_cache_gb=0))
    try:
        fmt = engine.executor.loaded.weight_format  # what the format resolved to (rank 0's; every rank resolves alike)
        for r in workload.requests:
            engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        collectives0, step_seconds = parallel_state.collective_seconds(), 0.0
        start = time.perf_counter()
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            t0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            step_seconds += time.perf_counter() - t0
        wall = time.perf_counter() - start
        collectives = parallel_state.collective_seconds() - collectives0
    finally:
        engine.shutdown()
    generated = sum(len(t) for t in outputs.values())
    return {"tensor_parallel_size": tp, "weights": fmt.name if fmt is not None else "float32",
            "tokens_per_s": generated / wall, "wall_s": wall,
            "collective_share": collectives / step_seconds if step_seconds else 0.0, "outputs": outputs}


def _format(cfg: BenchConfig) -> str:
    return cfg.weight_dtype or "float32"


def _smallest_split(heads: int, kv_heads: int) -> int:
    """The smallest rank count above 1 that splits the heads (SmolLM2's 9 heads: 3)."""
    return next(d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0))


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    from pagedrs.models import load_model

    spec = QUICK if cfg.quick else FULL
    if cfg.num_requests:
        spec = replace(spec, num_requests=cfg.num_requests)
    config = load_model(cfg.model, weight_dtype="float32").config
    workload = synthetic_workload(spec, config.vocab_size)
    tp = _smallest_split(config.num_attention_heads, config.num_key_value_heads)
    rows = [_one(cfg, 1, workload), _one(cfg, tp, workload)]
    same = rows[0]["outputs"] == rows[1]["outputs"]
    for row in rows:
        del row["outputs"]
    columns = [Column("tensor parallel size", "tensor_parallel_size"), Column("weights", "weights"),
               Column("tok/s", "tokens_per_s", "{:.1f}"),
               Column("wall s", "wall_s", "{:.1f}"), Column("rank 0 step time in all-reduce", "collective_share", "{:.0%}")]
    notes = [f"workload {spec.name}: {spec.num_requests} requests; 1 torch thread per rank; gloo over loopback",
             f"greedy outputs identical between tp=1 and tp={tp}: {same}",
             "on 2 CPU cores each rank has one core: no speed-up is expected (see the module docstring)"]
    data = {"rows": rows, "identical_outputs": same, "workload": workload.summary(), "machine": machine}
    return data, render(f"Tensor parallelism: {tp} ranks vs 1", markdown_table(rows, columns), notes, machine)
