"""Where a saturated engine step goes: wall time per phase of ``Engine.step``.

Runs SmolLM2 offline at batch 32 (32 prompts of 120 random tokens, 64 greedy tokens each)
and times the phases of every step: the core's schedule (Rust), the StepInput conversion,
the executor (input preparation + forward), and the engine's sampling and output handling.
It answers whether overlapping the next step's scheduling with the forward could pay.
Inside the executor, the model's linear layers (GEMM or packed int8/int4 kernel, with the
activation casts the packed kernels need) are timed apart: what is left of the forward is
attention, norms, rotary and the Python around them. A GGUF model on the fused CPU decode
(``models/cpu_decode.py``) runs its layers in one Rust call, which reports its own split (GEMV
products, added to the linear layers; attention; the elementwise ops). ``--torch-profile N`` adds
torch.profiler's N costliest ops (self CPU time) of the same run.

    python benches/profile_step.py [--threads N] [--batch B] [--weight-dtype int8] [--torch-profile 25] [--decode-only]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time
from typing import Any

import numpy as np
import torch

import pagedrs.core.step as step_module
from pagedrs import LLM, SamplingParams
from pagedrs.bench.machine import describe_machine
from pagedrs.engine_args import WEIGHT_DTYPES
from pagedrs.step_input import StepInput


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


_LINEAR = "  of which linear layers (kernels + casts)"


def _time_linears(model: Any, acc: dict[str, float]) -> None:
    """Times the bound linear closures the forward pass calls (see ``LinearMethod.bind``)."""
    key = _LINEAR

    def timed(fn: Any) -> Any:
        def wrapper(x: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(x)
            finally:
                acc[key] += time.perf_counter() - start

        return wrapper

    for layer in model.bind():
        layer.qkv, layer.o, layer.gate_up, layer.down = (timed(f) for f in (layer.qkv, layer.o, layer.gate_up, layer.down))
    model._bound_head = timed(model._bound_head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES)
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N", help="print torch.profiler's top N ops")
    parser.add_argument("--decode-only", action="store_true",
                        help="leave out the steps that compute prompt tokens (the prefill): a decode step's split")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--prompt-len", type=int, default=120, help="prompt tokens per request (the context decoded over)")
    parser.add_argument("--no-fused", action="store_true",
                        help="run every step through the torch ops, not the fused CPU decode (models/cpu_decode.py)")
    args = parser.parse_args()
    if args.prompt_len < 1:
        parser.error(f"--prompt-len is {args.prompt_len}; allowed: >= 1")
    llm = LLM(model="smollm2-135m", max_model_len=max(512, args.prompt_len + args.tokens + 8), cpu_threads=args.threads,
              max_num_seqs=args.batch, weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    acc: dict[str, float] = collections.defaultdict(float)
    engine.scheduler = _TimedScheduler(engine.scheduler, acc)  # type: ignore[assignment]
    from_plan = StepInput.from_plan

    prefill = [False]  # whether the step being timed computes prompt tokens

    def timed_from_plan(plan: Any, page_meta: Any) -> Any:
        start = time.perf_counter()
        try:
            step = from_plan(plan, page_meta)
            prefill[0] = step.num_tokens != step.num_seqs
            return step
        finally:
            acc["StepInput.from_plan"] += time.perf_counter() - start

    StepInput.from_plan = staticmethod(timed_from_plan)  # type: ignore[method-assign]
    _timed(engine.executor, "execute", "executor.execute (inputs + forward)", acc)
    for name in ("_rows", "_draws", "_sample_attributed", "_decide", "_carry_out"):  # the step's phases
        _timed(step_module, name, f"core.step.{name}", acc)
    _timed(engine.core, "_collect", "core._collect", acc)
    _timed(engine.output_processor, "process", "front end: OutputProcessor.process", acc)
    _time_linears(engine.executor.loaded.model, acc)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.prompt_len).tolist()} for _ in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    acc.clear()
    fused = engine.executor.loaded.model.fused_cpu_decode
    if fused is not None and args.no_fused:
        fused.enabled = False
        fused = None
    if fused is not None:
        fused.stack.reset_timings()
    _timed(engine, "step", "Engine.step (total)", acc)
    left_out = [0.0, 0.0, 0.0]  # the fused stack's products, attention, elementwise of the steps left out
    if args.decode_only:
        timed_step = engine.step

        def decode_step() -> Any:
            before = dict(acc)
            fused_before = fused.stack.timings()[:3] if fused is not None else (0.0, 0.0, 0.0)
            out = timed_step()
            if prefill[0]:  # a prompt's step: its time and its parts are not a decode step's
                acc.clear()
                acc.update(before)
                if fused is not None:
                    for i, (a, b) in enumerate(zip(fused.stack.timings()[:3], fused_before)):
                        left_out[i] += a - b
            return out

        engine.step = decode_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    profiler = torch.profiler.profile() if args.torch_profile else contextlib.nullcontext()
    start = time.perf_counter()
    with profiler:
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    total = acc["Engine.step (total)"]
    if fused is not None:
        products, attention, elementwise, _ = fused.stack.timings()
        acc[_LINEAR] += products - left_out[0]
        acc["  of which fused attention (Rust)"] = attention - left_out[1]
        acc["  of which fused norms, rotary, K/V writes (Rust)"] = elementwise - left_out[2]
    print(f"batch {args.batch} x {args.tokens} tokens, {args.threads} threads: {wall:.2f} s wall, "
          f"{args.batch * args.tokens / wall:.1f} tokens/s")
    if args.decode_only:
        print("  (decode steps only: the steps that computed prompt tokens are left out of the parts below)")
    for key, seconds in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {key:40s} {seconds:8.3f} s {seconds / total:7.1%}")
    weight_format = engine.loaded.weight_format
    print(f"weights {weight_format.name if weight_format else args.weight_dtype}; kv cache {args.kv_cache_dtype}; "
          f"prompt {args.prompt_len} tokens{'; fused CPU decode off' if args.no_fused else ''}")
    if isinstance(profiler, torch.profiler.profile):
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))
    print(f"Machine: {describe_machine().describe()}")  # torch threads as the engine set them


if __name__ == "__main__":
    main()
