"""The prefix cache's side channel, measured: a tenant's time to first token on a prompt it
guessed (another tenant's, just served) against one it did not, with one shared cache and with
a cache salt per tenant.

Per trial, alice sends a fresh random prompt P; then bob sends P itself (guessed) or a fresh
random prompt of the same length (unguessed). With a shared cache bob's guess is a prefix hit
and its first token comes far sooner: what a timing attack reads. With per-tenant salts
(``cache_salt``, the server's ``--prefix-cache-isolation per-tenant``) bob's guess finds none
of alice's pages, so both take one full prefill. Reported: median TTFT and cached tokens per
case, and the unguessed / guessed ratio per mode (about 1x means nothing leaks).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import build_engine, greedy_params, progress
from pagedrs.bench.report import Column, markdown_table, render

FULL = dict(prompt_tokens=512, trials=9)
QUICK = dict(prompt_tokens=256, trials=5)
MODES = {"shared cache": (None, None), "salted per tenant": ("alice", "bob")}


def _first_token(engine: Any, request_id: str, prompt: list[int], salt: Optional[str]) -> tuple[float, int]:
    """(seconds from the add to the first token, the prompt tokens the engine found cached)."""
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy_params(1), cache_salt=salt)
    seconds, cached = 0.0, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                seconds, cached = time.perf_counter() - start, int(out.num_cached_tokens or 0)
    return seconds, cached


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    s = dict(QUICK if cfg.quick else FULL)
    if cfg.num_requests is not None:
        s["trials"] = cfg.num_requests
    n = s["prompt_tokens"]
    blocks = 4 * (-(-n // cfg.block_size)) * s["trials"] + 8
    engine = build_engine(cfg.model, device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
                          num_gpu_blocks=blocks, max_model_len=n + cfg.block_size, swap_space_gb=0, kv_host_cache_gb=0)
    vocab = int(engine.loaded.config.vocab_size)
    rng = np.random.default_rng(0)
    ids = iter(range(1 << 30))

    def draw() -> list[int]:
        return [int(t) for t in rng.integers(100, vocab - 100, n)]

    _first_token(engine, "warm-up", draw(), None)
    rows: list[dict[str, Any]] = []
    for mode, (alice, bob) in MODES.items():
        for kind in ("guessed", "unguessed"):
            progress(f"salt: {mode}, {kind}")
            times, cached = [], []
            for _ in range(s["trials"]):
                victim = draw()
                _first_token(engine, f"a{next(ids)}", victim, alice)
                t, c = _first_token(engine, f"b{next(ids)}", victim if kind == "guessed" else draw(), bob)
                times.append(t)
                cached.append(c)
            rows.append({"mode": mode, "prompt": kind, "ttft_p50_s": statistics.median(times),
                         "cached_tokens_p50": statistics.median(cached)})
    engine.shutdown()
    by = {(r["mode"], r["prompt"]): r for r in rows}
    ratios = {mode: by[(mode, "unguessed")]["ttft_p50_s"] / by[(mode, "guessed")]["ttft_p50_s"] for mode in MODES}
    data = {"settings": {**s, "block_size": cfg.block_size}, "rows": rows, "unguessed_over_guessed": ratios,
            "model": cfg.model, "machine": machine}
    notes = [f"{s['trials']} trials per case, prompts of {n} random tokens, 1 output token; seed 0. Model {cfg.model}.",
             "Unguessed / guessed median TTFT: " + "; ".join(f"{m} {r:.2f}x" for m, r in ratios.items())
             + " (about 1x: the guess tells bob nothing)."]
    columns = [Column("cache", "mode"), Column("bob's prompt", "prompt"), Column("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
               Column("cached tokens p50", "cached_tokens_p50", "{:.0f}")]
    return data, render("The prefix cache's timing side channel, shared vs salted", markdown_table(rows, columns),
                        notes, machine)
