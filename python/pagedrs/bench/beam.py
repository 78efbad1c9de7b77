"""Beam search memory: device pages with sharing versus every beam holding private copies.

One beam-search request (a 512-token prompt, ``--quick``: 128) runs alone on the paged
engine for k = 2, 4, 8. At every step the bench reads two numbers off the same search:

- ``shared``: device pages in use (the core's count; beams share the prompt and their
  common history, a forked beam copies only its last, partly filled page on write);
- ``private``: the pages the same live beams would hold if each had its own copy of
  its sequence, ``sum(ceil(tokens / block_size))`` — what a layout without sharing
  (vLLM before PagedAttention, or transformers' expanded KV cache) keeps for them.

It also runs the same search on the contiguous layout (``kv_layout="contiguous"``,
reserving prompt + max_tokens per sequence; a fork copies the parent's region), whose
peak is measured, not computed. The table reports peaks and the saving
``1 - shared / private``; the PagedAttention paper reports 37-55% for beam search.
"""

from __future__ import annotations

import random
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.model_spec import kv_geometry, resolve_model
from pagedrs.bench.report import Column, markdown_table, render

FULL_SETTINGS: dict[str, Any] = {"prompt_tokens": 512, "max_tokens": 32, "widths": (2, 4, 8)}
QUICK_SETTINGS: dict[str, Any] = {"prompt_tokens": 128, "max_tokens": 16, "widths": (2, 4, 8)}


def _peaks(engine: Any, prompt: list[int], params: Any) -> tuple[int, int]:
    """(peak device pages in use, peak pages the live beams would hold as private copies)."""
    bs = engine.args.block_size
    engine.add_request("beam", {"prompt_token_ids": prompt}, params)
    peak_used = peak_private = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        peak_used = max(peak_used, stats["num_gpu_blocks"] - stats["num_free_gpu_blocks"])
        request = engine.requests.get("beam")
        if request is not None:
            live = [s.seq_id for s in request.samples if engine.scheduler.contains(s.seq_id)]
            private = sum(-(-engine.scheduler.num_tokens(seq) // bs) for seq in live)
            peak_private = max(peak_private, private)
    return peak_used, peak_private


def measure(model: str, k: int, prompt_tokens: int, max_tokens: int, *, device: str = "cpu", dtype: str = "float32",
            block_size: int = 16, layout: str = "paged") -> tuple[int, int]:
    from pagedrs.beam_search import BeamSearchParams
    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs

    longest = prompt_tokens + max_tokens
    blocks_per_seq = -(-longest // block_size)
    engine = Engine(EngineArgs(
        model=model, device=device, dtype=dtype, block_size=block_size, max_model_len=longest + 1,
        num_gpu_blocks=(k + 1) * blocks_per_seq + 2,  # k regions of the contiguous layout, and spare
        kv_layout=layout, contiguous_reserve="request",
        enable_prefix_caching=False,  # sharing by fork only: nothing is counted that a cache would hold
    ))
    rng = random.Random(k)
    vocab = engine.loaded.config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    return _peaks(engine, prompt, BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True))


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    settings = dict(QUICK_SETTINGS if cfg.quick else FULL_SETTINGS)
    folder = resolve_model(cfg.model)
    context = kv_geometry(folder, cfg.dtype).context_len
    settings["prompt_tokens"] = min(settings["prompt_tokens"], context - settings["max_tokens"] - 1)
    rows = []
    for k in settings["widths"]:
        peaks = {
            layout: measure(str(cfg.model), k, settings["prompt_tokens"], settings["max_tokens"], device=cfg.device,
                            dtype=cfg.dtype, block_size=cfg.block_size, layout=layout)
            for layout in ("paged", "contiguous")
        }
        (shared, private), contiguous = peaks["paged"], peaks["contiguous"][0]
        rows.append({
            "beam_width": k,
            "peak_pages_shared": shared,
            "peak_pages_private": private,
            "peak_pages_contiguous": contiguous,
            "saving_vs_private_pct": 100.0 * (1 - shared / private),
            "saving_vs_contiguous_pct": 100.0 * (1 - shared / contiguous),
        })
    data = {"settings": {**settings, "widths": list(settings["widths"]), "block_size": cfg.block_size,
                         "model": str(cfg.model)}, "rows": rows}
    table = markdown_table(rows, [
        Column("beam width", "beam_width"),
        Column("peak pages, shared", "peak_pages_shared"),
        Column("peak pages, private copies", "peak_pages_private"),
        Column("saving", "saving_vs_private_pct", "{:.1f}%"),
        Column("peak pages, contiguous", "peak_pages_contiguous"),
        Column("saving vs contiguous", "saving_vs_contiguous_pct", "{:.1f}%"),
    ])
    notes = [
        f"one beam-search request: {settings['prompt_tokens']}-token prompt, {settings['max_tokens']} tokens, "
        f"ignore_eos, block size {cfg.block_size}, model {cfg.model}, prefix caching off (sharing by fork only)",
        "private copies: the same live beams, each holding its whole sequence (computed at every step)",
        "contiguous: measured on kv_layout='contiguous' reserving prompt + max_tokens per beam",
    ]
    return data, render("Beam search: pages with sharing vs private copies", table, notes, machine)
