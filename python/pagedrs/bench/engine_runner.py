"""Drive one pagedrs Engine over a list of requests and record what each step did.

Everything a benchmark reports about pagedrs comes from here: wall time of the step
loop only (model loading excluded), the generated tokens of every request, its time to
first token, and one ``StepSample`` of ``engine.stats()`` after every step (running
sequences, KV blocks in use, reserved and live token slots) for the peak-concurrency figure, the
utilization average and the memory-over-time plot.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pagedrs.bench.workloads import BenchRequest

# Counters of engine.stats() that grow over the engine's life; a run reports their increase.
_COUNTERS = (
    "num_preemptions",
    "num_swap_preemptions",
    "num_recompute_preemptions",
    "swap_out_blocks",
    "swap_in_blocks",
    "prefix_queries",
    "prefix_hits",
    "num_generated_tokens",
    "num_prompt_tokens_computed",
    "num_cached_prompt_tokens",
    "num_steps",
)


@dataclass(frozen=True)
class StepSample:
    t: float  # seconds since the first step started, at the end of this step
    num_running: int
    num_waiting: int
    used_blocks: int
    reserved_slots: int  # token slots the scheduler holds for running sequences
    live_slots: int  # of those, slots holding a token


@dataclass
class EngineRun:
    wall_s: float
    samples: list[StepSample]
    output_token_ids: dict[str, list[int]]
    ttft_s: dict[str, float]  # request id -> seconds from submission to its first token
    counters: dict[str, float]  # increase of each _COUNTERS entry during the run
    final_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.output_token_ids.values())


def build_engine(model: str, **overrides: Any) -> Any:
    """An Engine on the CPU in float32 (activations and weights) unless ``overrides`` say otherwise."""
    from pagedrs import Engine, EngineArgs

    # Keep the thread count `--threads` set for every system (the engine would reset it to 1).
    # float32 weights: the throughput, prefix and preemption benches compare with transformers in float32.
    kwargs: dict[str, Any] = {"model": model, "device": "cpu", "dtype": "float32", "weight_dtype": "float32",
                              "cpu_threads": bench_threads()}
    kwargs.update(overrides)
    return Engine(EngineArgs(**kwargs))


_BENCH_THREADS: int | None = None  # --threads of the running `pagedrs bench` (set_bench_threads)


def set_bench_threads(threads: int) -> None:
    """Called by ``pagedrs.bench.main`` with ``--threads``, before any model exists."""
    global _BENCH_THREADS
    _BENCH_THREADS = threads


def bench_threads() -> int:
    """The CPU threads every system of this run gets: ``--threads``. Not torch's current count: an
    engine that runs the GGUF kernel sets torch's pool to one thread
    (``gguf_linear.hand_cpu_threads_to_gemv``), and the next system must not inherit that."""
    import torch

    return _BENCH_THREADS if _BENCH_THREADS is not None else torch.get_num_threads()


def greedy_params(max_tokens: int) -> Any:
    """Greedy and ``ignore_eos``: every system produces exactly ``max_tokens`` tokens."""
    from pagedrs import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def warm_up(engine: Any, vocab_size: int) -> None:
    """One tiny request so first-call costs (allocator, kernels, caches) stay out of the timing."""
    rid = "__warmup__"
    engine.add_request(rid, {"prompt_token_ids": [vocab_size // 2] * 8}, greedy_params(2))
    while engine.has_unfinished():
        engine.step()


def _counter_snapshot(stats: dict[str, Any]) -> dict[str, float]:
    return {k: float(stats.get(k, 0) or 0) for k in _COUNTERS}


def progress(message: str) -> None:
    """Progress of a long run, on stderr so that stdout stays the tables."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_requests(engine: Any, requests: list[BenchRequest], label: str = "engine") -> EngineRun:
    """Submit every request at once (offline throughput), then step until all finish."""
    before = _counter_snapshot(engine.stats())
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    ttft: dict[str, float] = {}
    samples: list[StepSample] = []
    start = time.perf_counter()
    next_report = 15.0
    for r in requests:
        engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_token_ids)}, greedy_params(r.max_tokens))
    while engine.has_unfinished():
        step_outputs = engine.step()
        now = time.perf_counter() - start
        for out in step_outputs:
            if out.request_id not in outputs:
                continue
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")
            tokens = list(out.outputs[0].token_ids)
            if tokens and out.request_id not in ttft:
                ttft[out.request_id] = now
            outputs[out.request_id] = tokens
        s = engine.stats()
        if now >= next_report:
            progress(f"{label}: {len(requests) - engine.num_unfinished()}/{len(requests)} finished after {now:.0f} s")
            next_report = now + 15.0
        samples.append(
            StepSample(
                t=now,
                num_running=int(s["num_running"]),
                num_waiting=int(s["num_waiting"]),
                used_blocks=int(s["num_used_gpu_blocks"]),
                reserved_slots=int(s["kv_reserved_slots"]),
                live_slots=int(s["kv_live_slots"]),
            )
        )
    wall = time.perf_counter() - start
    final = engine.stats()
    after = _counter_snapshot(final)
    counters = {k: after[k] - before[k] for k in _COUNTERS}
    return EngineRun(wall, samples, outputs, ttft, counters, dict(final))
