"""Where a saturated engine step goes: wall time per phase of ``Engine.step``.

Runs SmolLM2 offline at batch 32 (32 prompts of 120 random tokens, 64 greedy tokens each)
and times the phases of every step: the core's schedule (Rust), the StepInput conversion,
the executor (input preparation + forward), and the engine's sampling and output handling.
It answers whether overlapping the next step's scheduling with the forward could pay.

    python benches/profile_step.py [--threads N]
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import numpy as np

import pagedrs.engine as engine_module
from pagedrs import LLM, SamplingParams
from pagedrs.bench.machine import describe_machine


class _TimedScheduler:
    """The core's scheduler with ``schedule`` timed (the pyclass's methods cannot be patched)."""

    def __init__(self, inner: Any, acc: dict[str, float]) -> None:
        self._inner, self._acc = inner, acc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def schedule(self) -> Any:
        start = time.perf_counter()
        try:
            return self._inner.schedule()
        finally:
            self._acc["schedule (Rust core)"] += time.perf_counter() - start


def _timed(obj: Any, name: str, key: str, acc: dict[str, float]) -> None:
    fn = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(model="smollm2-135m", max_model_len=512, cpu_threads=args.threads, max_num_seqs=args.batch)
    engine = llm.engine
    acc: dict[str, float] = collections.defaultdict(float)
    engine.scheduler = _TimedScheduler(engine.scheduler, acc)  # type: ignore[assignment]
    from_plan = engine_module.StepInput.from_plan

    def timed_from_plan(plan: Any) -> Any:
        start = time.perf_counter()
        try:
            return from_plan(plan)
        finally:
            acc["StepInput.from_plan"] += time.perf_counter() - start

    engine_module.StepInput.from_plan = staticmethod(timed_from_plan)  # type: ignore[method-assign]
    _timed(engine.executor, "execute", "executor.execute (inputs + forward)", acc)
    for name in ("_rows", "_draws", "_sample_attributed", "_decide", "_carry_out", "_collect"):
        _timed(engine, name, f"engine.{name}", acc)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, 120).tolist()} for _ in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    acc.clear()
    _timed(engine, "step", "Engine.step (total)", acc)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - start
    total = acc["Engine.step (total)"]
    print(f"batch {args.batch} x {args.tokens} tokens, {args.threads} threads: {wall:.2f} s wall, "
          f"{args.batch * args.tokens / wall:.1f} tokens/s")
    for key, seconds in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {key:40s} {seconds:8.3f} s {seconds / total:7.1%}")
    print(f"Machine: {describe_machine().describe()}")  # torch threads as the engine set them


if __name__ == "__main__":
    main()
