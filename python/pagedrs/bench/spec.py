"""Speculative decoding (prompt lookup, ``speculative_config={"method": "ngram", ...}``): tokens/s
with and without it, side by side on one model.

Two workloads, greedy: ``repetitive`` (the answer quotes its prompt: rewrite a given text with
one word changed, repeat a code listing, a chat turn that quotes an earlier one) and ``random``
(random token prompts: lookups rarely hit, so the adaptive rule must keep the cost near zero).
Batch 1: each prompt alone, tokens/s per request (the table gives the median over requests and
repeats); batch B (8 and 32): every prompt at once (the workload's prompts cycled to B), total
tokens/s. Three engines: off, ngram as users write it (``disable_by_batch_size`` left to its
default: off above batch 2 on the CPU) and ngram never off (``disable_by_batch_size=None``), so
the table shows both what the default gives and what speculating at that batch would cost.
Each speculative run reports its acceptance rate (accepted / proposed drafts) and the mean
accepted length (accepted drafts per verification), and whether its tokens equal the run
without speculation (greedy: they must).

``--draft-model PATH`` adds a fourth engine, ``{"method": "draft_model", "model": PATH}`` (never
off), measured at batch 1 in a table of its own: with the model itself as its draft, a smoke
test of the path (acceptance ~1.0), not a speedup (the draft costs what the target does).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.report import Column, markdown_table, render

TEXT = ("The quick brown cat jumps over the lazy dog. The cat then sleeps in the warm sun, "
        "dreaming of fish and milk, while the children play in the garden near the old oak tree.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\nprint(add(2, 3), mul(4, 5))\n"
REPETITIVE = [
    f"Rewrite this text, replacing the word cat with the word tiger. Text: {TEXT}",
    f"Repeat this Python code exactly, then explain it in one sentence.\n\n{CODE}",
    f"Here is my note: \"{TEXT}\" Please copy my note back to me word for word.",
]
FULL: dict[str, Any] = {"max_tokens": 96, "batches": (8, 32), "repeats": 2, "k": 4}
QUICK: dict[str, Any] = {"max_tokens": 48, "batches": (8, 32), "repeats": 1, "k": 4}


def _prompts(engine: Any, workload: str, count: int) -> list[list[int]]:
    import torch

    if workload == "repetitive":
        tok = engine.tokenizer
        return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in REPETITIVE]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, engine.loaded.config.vocab_size, (48,), generator=g).tolist() for _ in range(count)]


def _run(engine: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from pagedrs.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, params)
    outs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, [outs[f"s{i}"] for i in range(len(batch))]


def _counters(engine: Any, before: dict[str, Any]) -> dict[str, Any]:
    after = engine.stats()
    proposed = after["spec_proposed"] - before["spec_proposed"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    verified = after["spec_verifications"] - before["spec_verifications"]
    return {"proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted": accepted / verified if verified else 0.0}


def _measure_1(engine: Any, prompts: list[list[int]], settings: dict[str, Any]) -> dict[str, Any]:
    """Batch 1: the median tokens/s per request (repeated), the outputs, the spec counters."""
    before = engine.stats()
    per_request: list[float] = []
    outputs: list[list[int]] = []
    for _ in range(settings["repeats"]):
        outputs = []
        for p in prompts:
            seconds, [out] = _run(engine, [p], settings["max_tokens"])
            per_request.append(len(out) / seconds)
            outputs.append(out)
    return {"tok_s": statistics.median(per_request), "outputs": outputs, **_counters(engine, before)}


def _measure_b(engine: Any, prompts: list[list[int]], size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Batch ``size``: every prompt at once (cycled to ``size``), total tokens/s."""
    before = engine.stats()
    seconds, outs = _run(engine, [prompts[i % len(prompts)] for i in range(size)], settings["max_tokens"])
    return {"tok_s": sum(map(len, outs)) / seconds, "outputs": outs, **_counters(engine, before)}


def _row(workload: str, batch: int, off: dict[str, Any], on: dict[str, Any], always: dict[str, Any]) -> dict[str, Any]:
    """One table row; acceptance from the run that speculated at every batch size."""
    return {"workload": workload, "batch": batch, "tok_s_off": off["tok_s"], "tok_s_on": on["tok_s"],
            "speedup": on["tok_s"] / off["tok_s"], "proposed": on["proposed"], "tok_s_always": always["tok_s"],
            "speedup_always": always["tok_s"] / off["tok_s"], "acceptance_pct": 100 * always["acceptance"],
            "mean_accepted": always["mean_accepted"],
            "same_tokens": on["outputs"] == off["outputs"] and always["outputs"] == off["outputs"]}


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs
    from pagedrs.spec.config import SpeculativeConfig

    settings = QUICK if cfg.quick else FULL
    spec_config = {"method": "ngram", "num_speculative_tokens": settings["k"], "prompt_lookup_max": 3,
                   "prompt_lookup_min": 2}
    common = dict(model=str(cfg.model), device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
                  max_num_seqs=max(settings["batches"]), enable_prefix_caching=False,
                  weight_dtype=cfg.weight_dtype or "auto")
    # "ngram": the config as users write it (disable_by_batch_size left to its default: on the CPU
    # no speculation above batch 2); "always": the same with disable_by_batch_size=None
    engines = {"off": Engine(EngineArgs(**common)), "ngram": Engine(EngineArgs(**common, speculative_config=spec_config)),
               "always": Engine(EngineArgs(**common, speculative_config={**spec_config, "disable_by_batch_size": None}))}
    draft_config = None
    if cfg.draft_model is not None:
        draft_config = {"method": "draft_model", "model": cfg.draft_model, "num_speculative_tokens": settings["k"],
                        "disable_by_batch_size": None}
        engines["draft_model"] = Engine(EngineArgs(**common, speculative_config=draft_config))
    default_off = SpeculativeConfig.parse(spec_config, cfg.device).disable_by_batch_size
    rows, draft_rows = [], []
    for workload in ("repetitive", "random"):
        prompts = _prompts(engines["off"], workload, len(REPETITIVE))
        one = {name: _measure_1(engine, prompts, settings) for name, engine in engines.items() if name != "always"}
        rows.append(_row(workload, 1, one["off"], one["ngram"], one["ngram"]))  # the same config at batch 1
        if "draft_model" in one:
            draft_rows.append(_row(workload, 1, one["off"], one["draft_model"], one["draft_model"]))
        for size in settings["batches"]:
            result = {name: _measure_b(engine, prompts, size, settings) for name, engine in engines.items()
                      if name != "draft_model"}
            rows.append(_row(workload, size, result["off"], result["ngram"], result["always"]))
    for engine in engines.values():
        engine.shutdown()
    data = {"settings": {**{k: v for k, v in settings.items()}, "model": str(cfg.model), "device": cfg.device,
                         "dtype": cfg.dtype, "weight_dtype": cfg.weight_dtype or "auto",
                         "speculative_config": spec_config, "default_disable_by_batch_size": default_off,
                         "draft_config": draft_config}, "rows": rows, "draft_rows": draft_rows}
    table = markdown_table(rows, [
        Column("workload", "workload"),
        Column("batch", "batch"),
        Column("tok/s, off", "tok_s_off", "{:.1f}"),
        Column("tok/s, ngram (default)", "tok_s_on", "{:.1f}"),
        Column("speedup", "speedup", "{:.2f}x"),
        Column("drafts proposed", "proposed"),
        Column("tok/s, ngram never off", "tok_s_always", "{:.1f}"),
        Column("speedup", "speedup_always", "{:.2f}x"),
        Column("acceptance", "acceptance_pct", "{:.0f}%"),
        Column("mean accepted length", "mean_accepted", "{:.2f}"),
        Column("same tokens", "same_tokens"),
    ])
    if draft_rows:
        table += "\n\nDraft model (" + str(cfg.draft_model) + "), batch 1:\n\n" + markdown_table(draft_rows, [
            Column("workload", "workload"),
            Column("tok/s, off", "tok_s_off", "{:.1f}"),
            Column("tok/s, draft_model", "tok_s_on", "{:.1f}"),
            Column("speedup", "speedup", "{:.2f}x"),
            Column("acceptance", "acceptance_pct", "{:.0f}%"),
            Column("mean accepted length", "mean_accepted", "{:.2f}"),
            Column("same tokens", "same_tokens"),
        ])
    notes = [
        f"model {cfg.model}, {cfg.device} {cfg.dtype} (weights {cfg.weight_dtype or 'auto'}), greedy, max_tokens {settings['max_tokens']}, ignore_eos; "
        f"speculative_config {spec_config}" + (f"; draft_model: {draft_config}" if draft_config else ""),
        f"batch 1: median tokens/s over {len(REPETITIVE)} requests x {settings['repeats']} repeat(s); "
        f"batch {', '.join(map(str, settings['batches']))}: every prompt at once (cycled), total tokens/s",
        f"ngram (default): disable_by_batch_size left out, so {default_off} on {cfg.device} (no speculation while "
        "more sequences run); never off: disable_by_batch_size=None; acceptance from the never-off run",
        "acceptance: accepted / proposed drafts; mean accepted length: accepted drafts per verification "
        "(each verification also yields one more token)",
    ]
    return data, render("Speculative decoding: prompt lookup (ngram)", table, notes, machine)
