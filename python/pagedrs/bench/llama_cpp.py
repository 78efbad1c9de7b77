"""llama.cpp on the same GGUF, in the same run: `pagedrs bench decode --llama-bench PATH`.

Issue 30 compares batch-1 decode with llama.cpp's on the same file and thread count. Timing both
in one run matters because the machines here are shared and differ (AMD EPYC, Intel Xeon): a
ratio from two runs hours apart mixes the machine's mood into it. We run llama.cpp's own
benchmark tool (``llama-bench``), not a wrapper, so its number is what its users would measure.

``llama-bench -p P -n G`` times the prompt and the generation apart; its generation test starts
from an empty context, ours after a P-token prompt: with P = 32 the attention over 32 more
tokens is well under 1% of a SmolLM2 step, so the two decode rates compare.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaBenchResult:
    prefill_tok_per_s: float  # llama-bench's "pp" test: P prompt tokens in one batch
    decode_tok_per_s: float  # its "tg" test: G tokens, one at a time
    decode_stddev: float  # over its repetitions
    build: str  # llama.cpp's commit and build number, as llama-bench reports them
    command: str


def gguf_of(model: str) -> Path:
    """The GGUF file ``model`` names (the embedded preset's included), or a clear error: llama.cpp reads GGUF only."""
    from pagedrs.models.loader import EMBEDDED_MODEL_NAME, embedded_model_path

    path = embedded_model_path() if model == EMBEDDED_MODEL_NAME else Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--llama-bench needs a GGUF model (llama.cpp reads GGUF only); --model is {model!r}")
    return path


def check_binary(binary: str) -> None:
    """``binary`` is a file we may run, or a clear error naming the option."""
    path = Path(binary)
    if not path.is_file():
        raise FileNotFoundError(f"--llama-bench {binary!r}: no such file (build llama.cpp's llama-bench target)")
    if not os.access(path, os.X_OK):
        raise PermissionError(f"--llama-bench {binary!r}: not executable")


def run_llama_bench(binary: str, gguf: Path, *, threads: int, prompt: int, gen: int, repetitions: int = 3,
                    timeout_s: float = 600.0) -> LlamaBenchResult:
    """Run ``llama-bench`` once (CPU only, no GPU layers) and parse its JSON."""
    check_binary(binary)
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(repetitions), "-ngl", "0", "-o", "json"]
    try:  # bytes that are not UTF-8 become U+FFFD: then "printed no JSON", not a UnicodeDecodeError
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout_s:g} s; stopped") from e
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return parse_llama_bench(done.stdout, " ".join(cmd))


def parse_llama_bench(stdout: str, command: str = "") -> LlamaBenchResult:
    """The prompt and generation rows of ``llama-bench -o json`` (a JSON list, one object per test)."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON ({e}): {stdout[:500]!r}") from e
    prefill = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    decode = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if len(prefill) != 1 or len(decode) != 1:
        raise RuntimeError(f"llama-bench JSON: expected one prompt test and one generation test, got {len(tests)}")
    d = decode[0]
    return LlamaBenchResult(prefill_tok_per_s=float(prefill[0]["avg_ts"]), decode_tok_per_s=float(d["avg_ts"]),
                            decode_stddev=float(d.get("stddev_ts", 0.0)),
                            build=f"{d.get('build_commit', '?')} ({d.get('build_number', '?')})", command=command)
