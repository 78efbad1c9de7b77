"""Synchronous against asynchronous scheduling on this machine: decode tokens/s and step time.

With ``async_scheduling`` the forward of step N+1 runs on the executor's worker thread while the
stepping thread samples step N, makes its outputs and plans N+2 (core/async_step.py). On a CPU
with one torch thread that overlap can use a second core; on a GPU it is what keeps the device
busy. Two models: the negligible-compute llama of ``pagedrs bench overhead`` (the host's cost
is the whole step: the most there is to hide) and the embedded SmolLM2 (a real step). The two
modes alternate, ``--rounds`` times each, in one run; medians of the steady decode steps' wall time.

    python benches/async_overlap.py [--threads 1] [--batch 32] [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.bench.machine import describe_machine
from pagedrs.bench.overhead import write_model


def _engine(model: str, batch: int, async_scheduling: bool, threads: int) -> Engine:
    return Engine(EngineArgs(model=model, dtype="float32", cpu_threads=threads, max_num_seqs=batch,
                             max_num_batched_tokens=max(2048, batch * 32), max_model_len=512,
                             async_scheduling=async_scheduling, skip_tokenizer_init=model != "smollm2-135m"))


def _decode_steps(engine: Engine, batch: int, steps: int, vocab: int) -> list[float]:
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"q{i}", {"prompt_token_ids": rng.integers(2, vocab, size=32).tolist()},
                           SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # the prefill and a few decode steps, untimed
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("Machine:", describe_machine().describe())
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(write_model(Path(tmp) / "tiny", 30))
        for name, model, vocab in (("negligible-compute llama, 30 layers", tiny, 512),
                                   ("SmolLM2-135M", "smollm2-135m", 49152)):
            med: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for mode in (False, True):
                    engine = _engine(model, args.batch, mode, args.threads)
                    try:
                        med[mode].append(statistics.median(_decode_steps(engine, args.batch, args.steps, vocab)))
                    finally:
                        engine.shutdown()
            sync, asyn = statistics.median(med[False]), statistics.median(med[True])
            print(f"{name}, batch {args.batch}: sync {sync * 1e3:.2f} ms/step ({args.batch / sync:.0f} tok/s), "
                  f"async {asyn * 1e3:.2f} ms/step ({args.batch / asyn:.0f} tok/s): {sync / asyn:.2f}x "
                  f"(rounds: sync {[round(t * 1e3, 2) for t in med[False]]}, async {[round(t * 1e3, 2) for t in med[True]]})")


if __name__ == "__main__":
    main()
