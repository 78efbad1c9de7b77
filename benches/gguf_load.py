"""What loading a GGUF costs: wall time, peak memory and the cache's bytes on disk, cold and warm.

    python benches/gguf_load.py [--model smollm2-135m|PATH.gguf] [--formats auto,float32] [--runs 3]

Each load runs in a fresh Python process (so the peak resident set is the load's own): a cold load
(an empty ``PAGEDRS_CACHE_DIR``: hashing, conversion, tokenizer) then warm loads. Printed per
format: the median wall time of the load call; the process's peak resident memory over what it held
just before the call (``ru_maxrss``; torch, transformers, gguf-py and pagedrs's modules are imported before
it: they cost the same whatever the model), which counts the clean file pages a map has read; the peak of
its anonymous memory (``RssAnon``, sampled every 2 ms), which the kernel cannot drop under pressure as it
can those pages; and what the converted folder holds on disk. The GGUF file's own size is printed beside
them: about what a block-format load keeps (the blocks are the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, resource, sys, threading, time
import torch, transformers, gguf, safetensors.torch  # imported before the baseline: fixed costs, not the model's
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from pagedrs.models import load_model, gguf_loader, gguf_linear, block_quant
from pagedrs import tokenizer

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

peak_anon, done = [anon_kib()], threading.Event()

def sample():
    while not done.wait(0.002):
        peak_anon[0] = max(peak_anon[0], anon_kib())

anon_before = peak_anon[0]
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
loaded = load_model(sys.argv[1], weight_dtype=sys.argv[2])
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
done.set()
sampler.join()
print(json.dumps({"seconds": seconds, "peak_mib": (peak - before) / 1024,
                  "anon_mib": (max(peak_anon[0], anon_kib()) - anon_before) / 1024,
                  "format": loaded.weight_format.name}))
"""


def _load(model: str, fmt: str, cache: Path) -> dict[str, float | str]:
    env = dict(os.environ, PAGEDRS_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", _CHILD, model, fmt], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _disk_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--formats", default="auto,float32")
    parser.add_argument("--runs", type=int, default=3, help="warm loads per format")
    args = parser.parse_args()
    from pagedrs.bench.machine import describe_machine
    from pagedrs.models.loader import EMBEDDED_MODEL_NAME, embedded_model_path

    print("machine:", describe_machine().describe())
    path = embedded_model_path() if args.model.lower() == EMBEDDED_MODEL_NAME else Path(args.model)
    print(f"model {args.model}: GGUF file {path.stat().st_size / 2**20:.1f} MiB")
    print("| weight_dtype | loaded as | cold load s | warm load s (median) | warm peak RSS MiB | warm peak anonymous MiB "
          "| cache on disk MiB |")
    print("|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            cold = _load(args.model, fmt, cache)
            warm = [_load(args.model, fmt, cache) for _ in range(args.runs)]
            print(f"| {fmt} | {cold['format']} | {cold['seconds']:.2f} | "
                  f"{statistics.median(float(w['seconds']) for w in warm):.2f} | "
                  f"{statistics.median(float(w['peak_mib']) for w in warm):.0f} | "
                  f"{statistics.median(float(w['anon_mib']) for w in warm):.0f} | {_disk_mib(cache / 'gguf'):.1f} |")


if __name__ == "__main__":
    main()
