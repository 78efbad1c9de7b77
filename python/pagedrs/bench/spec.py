"""Speculative decoding (prompt lookup, ``speculative_config={"method": "ngram", ...}``, and with
``--draft-model PATH`` a draft model too): tokens/s with and without it, side by side on one model.

Two workloads, greedy: ``repetitive`` (the answer quotes its prompt: rewrite a given text with
one word changed, repeat a code listing, a chat turn that quotes an earlier one) and ``random``
(random token prompts: lookups rarely hit, so the adaptive rule must keep the cost near zero).
Batch 1: each prompt alone, tokens/s per request (the table gives the median over requests and
repeats); batch B: every prompt at once (the workload's prompts cycled to B), total tokens/s.
Each speculative run reports its acceptance rate (accepted / proposed drafts) and the mean
accepted length (accepted drafts per verification), and whether its tokens equal the run
without speculation (greedy: they must).
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
FULL: dict[str, Any] = {"max_tokens": 96, "batch": 32, "repeats": 2, "k": 4}
QUICK: dict[str, Any] = {"max_tokens": 48, "batch": 8, "repeats": 1, "k": 4}


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


def _measure(engine: Any, prompts: list[list[int]], settings: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 tokens/s per request (repeated), batch-B tokens/s, the outputs, and the spec counters."""
    before = engine.stats()
    per_request: list[float] = []
    outputs: list[list[int]] = []
    for _ in range(settings["repeats"]):
        outputs = []
        for p in prompts:
            seconds, [out] = _run(engine, [p], settings["max_tokens"])
            per_request.append(len(out) / seconds)
            outputs.append(out)
    batch = [prompts[i % len(prompts)] for i in range(settings["batch"])]
    seconds, batch_outs = _run(engine, batch, settings["max_tokens"])
    after = engine.stats()
    proposed = after["spec_proposed"] - before["spec_proposed"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    verified = after["spec_verifications"] - before["spec_verifications"]
    return {"tok_s_1": statistics.median(per_request), "tok_s_b": sum(map(len, batch_outs)) / seconds,
            "outputs": outputs + batch_outs, "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted": accepted / verified if verified else 0.0}


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs

    settings = QUICK if cfg.quick else FULL
    spec_config = {"method": "ngram", "num_speculative_tokens": settings["k"], "prompt_lookup_max": 3,
                   "prompt_lookup_min": 2}
    common = dict(model=str(cfg.model), device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
                  max_num_seqs=settings["batch"], enable_prefix_caching=False, weight_dtype=cfg.weight_dtype or "auto")
    configs: dict[str, dict[str, Any] | None] = {"off": None, "ngram": spec_config}
    if cfg.draft_model is not None:
        configs["draft_model"] = {"method": "draft_model", "model": cfg.draft_model,
                                  "num_speculative_tokens": settings["k"]}
    engines = {name: Engine(EngineArgs(**common, speculative_config=c)) for name, c in configs.items()}
    rows = []
    for workload in ("repetitive", "random"):
        prompts = _prompts(engines["off"], workload, len(REPETITIVE))
        result = {name: _measure(engine, prompts, settings) for name, engine in engines.items()}
        off = result["off"]
        for method in [m for m in configs if m != "off"]:
            on = result[method]
            rows.append({"workload": workload, "method": method, "tok_s_1_off": off["tok_s_1"],
                         "tok_s_1_on": on["tok_s_1"], "speedup_1": on["tok_s_1"] / off["tok_s_1"],
                         "tok_s_b_off": off["tok_s_b"], "tok_s_b_on": on["tok_s_b"],
                         "speedup_b": on["tok_s_b"] / off["tok_s_b"], "acceptance_pct": 100 * on["acceptance"],
                         "mean_accepted": on["mean_accepted"], "proposed": on["proposed"],
                         "same_tokens": on["outputs"] == off["outputs"]})
    for engine in engines.values():
        engine.shutdown()
    batch = settings["batch"]
    data = {"settings": {**{k: v for k, v in settings.items()}, "model": str(cfg.model), "device": cfg.device,
                         "dtype": cfg.dtype, "weight_dtype": cfg.weight_dtype or "auto", "speculative_config": spec_config,
                         "draft_config": configs.get("draft_model")}, "rows": rows}
    table = markdown_table(rows, [
        Column("workload", "workload"),
        Column("method", "method"),
        Column("batch 1 tok/s, off", "tok_s_1_off", "{:.1f}"),
        Column("batch 1 tok/s, on", "tok_s_1_on", "{:.1f}"),
        Column("speedup", "speedup_1", "{:.2f}x"),
        Column(f"batch {batch} tok/s, off", "tok_s_b_off", "{:.1f}"),
        Column(f"batch {batch} tok/s, on", "tok_s_b_on", "{:.1f}"),
        Column("speedup", "speedup_b", "{:.2f}x"),
        Column("acceptance", "acceptance_pct", "{:.0f}%"),
        Column("mean accepted length", "mean_accepted", "{:.2f}"),
        Column("same tokens", "same_tokens"),
    ])
    notes = [
        f"model {cfg.model}, {cfg.device} {cfg.dtype} (weights {cfg.weight_dtype or 'auto'}), greedy, max_tokens {settings['max_tokens']}, ignore_eos; "
        f"speculative_config {spec_config}" + (f"; draft_model: {configs['draft_model']}" if "draft_model" in configs else ""),
        f"batch 1: median tokens/s over {len(REPETITIVE)} requests x {settings['repeats']} repeat(s); "
        f"batch {batch}: every prompt at once, total tokens/s",
        "acceptance: accepted / proposed drafts; mean accepted length: accepted drafts per verification "
        "(each verification also yields one more token)",
    ]
    return data, render("Speculative decoding: prompt lookup (ngram)" + (" and a draft model" if "draft_model" in configs else ""), table, notes, machine)
