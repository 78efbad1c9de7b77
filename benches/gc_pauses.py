"""What the cyclic collector's full collections cost an in-process engine, with and without the
import heap frozen (``pagedrs/gc_heap.py``).

Workload: the negligible-compute llama of ``pagedrs bench overhead`` (1 layer), ``--rounds`` waves of
``--batch`` requests (16-token prompts, 32 greedy tokens, DELTA outputs), each wave run to its end.
Every step's wall time is kept, and every collection's duration by generation (``gc.callbacks``).
Each mode runs in its own interpreter (the freeze is per process), the modes alternating
``--repeats`` times. Printed per run: step median / p99 / max, full (generation 2) collections and
the longest, and all collections' time.

    python benches/gc_pauses.py [--batch 256] [--rounds 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import dataclasses, gc, json, sys, tempfile, time
    from pathlib import Path
    import numpy as np, torch
    torch.set_num_threads(1)
    import pagedrs.gc_heap
    from pagedrs.bench.engine_runner import greedy_params
    from pagedrs.bench.overhead import OverheadSpec, build_overhead_engine, write_model
    from pagedrs.sampling_params import RequestOutputKind
    freeze, batch, rounds = sys.argv[1] == "freeze", int(sys.argv[2]), int(sys.argv[3])
    if not freeze:
        pagedrs.gc_heap._done = True  # as before gc_heap: nothing frozen
    engine = build_overhead_engine(write_model(Path(tempfile.mkdtemp()), 1),
                                   OverheadSpec(layers=1, batch_sizes=(batch,)))
    pauses, started = [], [0.0]
    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))
    gc.callbacks.append(on_gc)
    params = dataclasses.replace(greedy_params(32), output_kind=RequestOutputKind.DELTA)
    rng = np.random.default_rng(0)
    steps = []
    for r in range(rounds):
        for i in range(batch):
            engine.add_request(f"r{r}-{i}", {"prompt_token_ids": rng.integers(2, 512, size=16).tolist()}, params)
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
    steps.sort()
    full = [p for g, p in pauses if g == 2]
    print(json.dumps({"frozen": gc.get_freeze_count(), "steps": len(steps), "median_ms": 1e3 * steps[len(steps) // 2],
                      "p99_ms": 1e3 * steps[int(len(steps) * 0.99)], "max_ms": 1e3 * steps[-1], "full": len(full),
                      "full_max_ms": 1e3 * max(full, default=0.0), "gc_ms": 1e3 * sum(p for _, p in pauses)}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    from pagedrs.bench.machine import describe_machine

    torch.set_num_threads(1)  # the children's setting, for the machine line

    print("| import heap | objects frozen | steps | step median ms | p99 ms | max ms | full collections | longest ms | all gc ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for mode in ("no-freeze", "freeze"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.batch), str(args.rounds)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {mode} | {r['frozen']} | {r['steps']} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} "
                  f"| {r['full']} | {r['full_max_ms']:.1f} | {r['gc_ms']:.1f} |", flush=True)
    print(f"\nBatch {args.batch}, {args.rounds} waves. Machine: {describe_machine().describe()}")


if __name__ == "__main__":
    main()
