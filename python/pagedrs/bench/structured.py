"""Structured outputs: what a grammar costs per step and per schema.

For batch sizes 1 and 32 the same chat prompts run twice on one engine: free (``ignore_eos``,
``max_tokens`` tokens each) and under a JSON schema (nested objects, an array with maxItems,
an enum, bounded strings and numbers). For every decode step that ran all ``B`` rows the
bench records the step's wall time and, under the schema, the time spent computing and
applying the masks on the step's own thread (``core.step._constrained``, timed by wrapping
it: what the step waits for) and the time the mask thread spent computing masks while the
forward ran (``StepMasks.compute_seconds``: overlapped, not on the step's path); the table gives the
medians, the masks' share of the step, and tokens/s of each run (answers under the schema may
end early, with "stop": tokens/s counts the tokens generated). Compile time is measured per
constraint on a fresh compiler whose llguidance tokenizer is already built (its build, once
per engine, is reported apart); a second compile of the same schema is a cache hit.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.report import Column, markdown_table, render

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
COMPILE_CASES: dict[str, dict[str, Any]] = {
    "json schema (nested, 6 properties)": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex (an e-mail address)": {"regex": r"[a-z0-9._]{1,20}@[a-z0-9]{1,20}\.(com|org|net)"},
    "choice (8 strings)": {"choice": ["red", "orange", "yellow", "green", "blue", "indigo", "violet", "black"]},
    "grammar (Lark arithmetic)": {"grammar": 'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,4}/'},
}
FULL: dict[str, Any] = {"batches": (1, 32), "max_tokens": 64}
QUICK: dict[str, Any] = {"batches": (1, 8), "max_tokens": 24}
QUESTIONS = ["Describe a person as JSON.", "Invent a user record.", "Give me a JSON profile of a chef.",
             "A customer, as JSON, please."]


def _compile_times(engine: Any) -> tuple[float, list[dict[str, Any]]]:
    from pagedrs.core.structured.backend import GrammarCompiler
    from pagedrs.sampling_params import StructuredOutputsParams

    core = engine.core
    start = time.perf_counter()
    first = GrammarCompiler(core.loaded.tokenizer.hf, core.loaded.config.vocab_size, core.eos_token_ids)
    first.tokenizer  # noqa: B018 - built here, timed apart
    tokenizer_s = time.perf_counter() - start
    rows = []
    for name, kw in COMPILE_CASES.items():
        compiler = GrammarCompiler(core.loaded.tokenizer.hf, core.loaded.config.vocab_size, core.eos_token_ids)
        compiler._tokenizer = first.tokenizer  # the compile alone
        params = StructuredOutputsParams(**kw)
        compiler.new_state(params)
        again = time.perf_counter()
        compiler.new_state(params)
        rows.append({"constraint": name, "compile_ms": 1e3 * compiler.compile_seconds,
                     "hit_ms": 1e3 * (time.perf_counter() - again), "compiles": compiler.num_compiles})
    return tokenizer_s, rows


def _run(engine: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Steps every prompt to the end: (step seconds, mask seconds) of each decode step that ran
    every row (all started, none finished), the tokens generated and the wall time."""
    import pagedrs.core.step as step_module

    masks: list[float] = []
    planned: list[Any] = []  # the steps' StepMasks: their time on the mask thread
    original, original_start = step_module._constrained, step_module.start_masks

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        out = original(*args)
        masks.append(time.perf_counter() - start)
        return out

    def recording_start(*args: Any) -> Any:
        out = original_start(*args)
        if out is not None:
            planned.append(out)
        return out

    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    finished: dict[str, int] = {}
    steps: list[tuple[float, float, float]] = []
    step_module._constrained = timed  # type: ignore[assignment]
    step_module.start_masks = recording_start  # type: ignore[assignment]
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            full = len(started) == len(prompts) and not finished
            masks.clear()
            planned.clear()
            t = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - t
            if full:
                steps.append((elapsed, sum(masks), sum(m.compute_seconds for m in planned)))
            for out in outputs:
                started.add(out.request_id)
                if out.finished:
                    finished[out.request_id] = len(out.outputs[0].token_ids)
    finally:
        step_module._constrained = original  # type: ignore[assignment]
        step_module.start_masks = original_start  # type: ignore[assignment]
    return {"steps": steps, "tokens": sum(finished.values()), "wall_s": time.perf_counter() - start}


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs
    from pagedrs.sampling_params import SamplingParams, StructuredOutputsParams

    settings = QUICK if cfg.quick else FULL
    max_tokens = settings["max_tokens"]
    engine = Engine(EngineArgs(model=str(cfg.model), device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
                               max_num_seqs=max(settings["batches"]), enable_prefix_caching=False))
    tokenizer_s, compiles = _compile_times(engine)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    constraint = StructuredOutputsParams(json=SCHEMA)
    rows = []
    for batch in settings["batches"]:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        free = _run(engine, batch_prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        constrained = _run(engine, batch_prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 structured_outputs=constraint))
        row: dict[str, Any] = {"batch": batch}
        for name, result in (("free", free), ("json", constrained)):
            if result["steps"]:
                row[f"{name}_step_ms"] = 1e3 * statistics.median(s for s, _, _ in result["steps"])
                row[f"{name}_mask_ms"] = 1e3 * statistics.median(m for _, m, _ in result["steps"])
                row[f"{name}_overlapped_ms"] = 1e3 * statistics.median(o for _, _, o in result["steps"])
            row[f"{name}_tok_s"] = result["tokens"] / result["wall_s"]
            row[f"{name}_full_steps"] = len(result["steps"])
        if "json_step_ms" in row:
            row["mask_share_pct"] = 100.0 * row["json_mask_ms"] / row["json_step_ms"]
        if "free_step_ms" in row and "json_step_ms" in row:
            row["step_slowdown_pct"] = 100.0 * (row["json_step_ms"] / row["free_step_ms"] - 1)
        rows.append(row)
    engine.shutdown()
    data = {"settings": {"model": str(cfg.model), "max_tokens": max_tokens, "batches": list(settings["batches"]),
                         "device": cfg.device, "dtype": cfg.dtype},
            "tokenizer_build_s": tokenizer_s, "compiles": compiles, "rows": rows}
    table = markdown_table(rows, [
        Column("batch", "batch"),
        Column("step, free (ms)", "free_step_ms", "{:.1f}"),
        Column("step, json (ms)", "json_step_ms", "{:.1f}"),
        Column("masks in the step (ms)", "json_mask_ms", "{:.2f}"),
        Column("masks' share of the step", "mask_share_pct", "{:.1f}%"),
        Column("masks beside the forward (ms)", "json_overlapped_ms", "{:.2f}"),
        Column("step slower by", "step_slowdown_pct", "{:.1f}%"),
        Column("tokens/s, free", "free_tok_s", "{:.1f}"),
        Column("tokens/s, json", "json_tok_s", "{:.1f}"),
    ])
    compile_table = markdown_table(compiles, [
        Column("constraint", "constraint"),
        Column("compile (ms)", "compile_ms", "{:.1f}"),
        Column("second request (ms, cache hit)", "hit_ms", "{:.2f}"),
    ])
    notes = [
        f"model {cfg.model}, {cfg.device} {cfg.dtype}, greedy, max_tokens {max_tokens}; free runs ignore EOS; "
        "medians over the decode steps that ran every row",
        f"the llguidance tokenizer is built once per engine: {tokenizer_s:.2f} s",
    ]
    text = render("Structured outputs: masks per step", table, notes, machine)
    return data, text + "\n" + compile_table + "\n"
