"""The host's share of a decode step (``pagedrs bench overhead``): where a step goes when compute is negligible.

Model: a random-weight llama whose math costs next to nothing (vocabulary 512, hidden 64,
one attention head and one KV head of 64, MLP 128) at SmolLM2's depth (30 layers; ``--layers``),
so a step's time is the engine's own: Python, op dispatch and the Rust core. That is the floor a
GPU step cannot go below without CUDA graphs and asynchronous scheduling.

Workload per batch size B (1, 32, 256): B requests of ``prompt`` random tokens, greedy and
``ignore_eos``, submitted at once; the prefill and a few warm-up decode steps run untimed, then
``steps`` steady decode steps (no request finishes in them) are timed part by part. Stamps taken
at the part boundaries of each ``Engine.step`` split it into parts that add up to it::

    Engine.step ─► schedule() ─► StepInput, metadata, plan ─► forward ─► head ─► sample ─► decide, append, outputs ─► RequestOutputs
     "output" ─┘ "schedule"   │          "inputs"           │ "runner" (per layer) │"sampling"│         "output"       │ "frontend"

- ``schedule``: the Rust ``Scheduler.schedule()`` call;
- ``inputs``: from the plan to the model's first op (``StepInput``, the queue bookkeeping, the
  runner's metadata, tensors and the attention backend's per-step plan);
- ``runner``: the forward pass and the output head (``forward`` and ``head`` apart); the only part
  that grows with the depth;
- ``sampling``: the core's sampling rows, the fast rows' batched draw and ``sample()`` for the others;
- ``output``: the rest of the core's step (the Rust ``complete_step``, continuation policies, appends,
  ``CoreOutput``; also the client's inbox before ``schedule``);
- ``frontend``: the front end's ``OutputProcessor`` (``RequestOutput``; with a core in its own process,
  ``client="mp"``, this part runs beside the core's next step). ``core`` = the step without it.

Each workload runs three times per batch size, once per ``SamplingParams.output_kind``: ``CUMULATIVE``
(a ``RequestOutput`` per request per step, what a direct ``Engine.step`` user gets by default),
``DELTA`` (one per request per step with only what is new: what the server asks for) and
``FINAL_ONLY`` (none until a request ends: what ``LLM.generate`` submits), so the ``frontend`` part
shows what building the per-step outputs costs.

Each depth runs on its own engine; the step at ``--layers`` N is reported as measured, and the
two depths (1 and N) give every part a fixed cost and a per-layer cost by a straight line through
them (``fixed = t(1) - per_layer``). Medians over the timed steps, in wall time and, beside it, in
the CPU time of the stepping thread (``time.thread_time``; torch runs one thread here), which the
waits of a shared machine leave out.

The stamps themselves (the wrappers ``stamped`` puts in place, and ``split_step``) are step_stamps.py's.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import greedy_params, progress
from pagedrs.bench.report import Column, markdown_table, render
from pagedrs.bench.step_stamps import _Stamps, split_step, stamped

PARTS = ("schedule", "inputs", "runner", "sampling", "output", "frontend")  # in step order; they add up to "step"
DETAIL = ("forward", "head")  # inside "runner"
SMOLLM2_LAYERS = 30


@dataclass(frozen=True)
class OverheadSpec:
    batch_sizes: tuple[int, ...] = (1, 32, 256)
    layers: int = SMOLLM2_LAYERS  # the deep model; the shallow one has 1 layer
    prompt_len: int = 32
    warmup_steps: int = 3
    steps: int = 20  # timed decode steps per batch size (and output kind), over all rounds
    rounds: int = 2  # rounds that alternate the two depths (see ``measure``; --quick runs 4)
    device: str = "cpu"
    block_size: int = 16
    # RequestOutputKind names, each run in turn
    output_kinds: tuple[str, ...] = ("CUMULATIVE", "DELTA", "FINAL_ONLY")


# ---- the model -------------------------------------------------------------------------------

def write_model(folder: Path, layers: int, seed: int = 0) -> Path:
    """A llama of negligible compute with random weights, as a Hugging Face folder (no transformers needed)."""
    import torch
    from safetensors.torch import save_file

    vocab, hidden, heads, head_dim, inter = 512, 64, 1, 64, 128
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 1, "head_dim": head_dim, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (head_dim, hidden),
            p + "self_attn.v_proj.weight": (head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    gen = torch.Generator().manual_seed(seed)
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.2)
             for k, s in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def build_overhead_engine(folder: Path, spec: OverheadSpec) -> Any:
    import torch

    from pagedrs import Engine, EngineArgs

    batch = max(spec.batch_sizes)
    tokens_per_seq = spec.prompt_len + spec.warmup_steps + spec.steps + 2
    blocks = batch * (-(-tokens_per_seq // spec.block_size) + 1) + 16
    return Engine(EngineArgs(
        model=str(folder), device=spec.device, dtype="float32", weight_dtype="float32", skip_tokenizer_init=True,
        cpu_threads=torch.get_num_threads(), max_num_seqs=batch, num_gpu_blocks=blocks, block_size=spec.block_size,
        max_num_batched_tokens=max(2048, batch * spec.prompt_len), max_model_len=tokens_per_seq + 16,
    ))


# ---- the measurement --------------------------------------------------------------------------

def _tokens_so_far(engine: Any, request_id: str) -> int:
    """The first sample's tokens the core holds (a FINAL_ONLY request sends none to the front end
    before it ends); a request the core no longer holds has ended: counted as started."""
    request = engine.core.requests.get(request_id)
    if request is None:
        return 1
    return len(request.samples[0].token_ids) if request.samples else 0


def time_decode_steps(engine: Any, spec: OverheadSpec, batch: int, seed: int,
                      output_kind: str = "CUMULATIVE") -> list[dict[str, float]]:
    """Each timed steady decode step of ``batch`` requests of ``output_kind``, split into its parts
    (seconds of wall time; ``cpu_<part>``: of this thread's CPU time, which a shared machine's waits
    leave out)."""
    from pagedrs.sampling_params import RequestOutputKind

    kind = RequestOutputKind[output_kind]
    rng = np.random.default_rng(seed)
    max_tokens = 1 + spec.warmup_steps + spec.steps + 1  # prefill's token, warm-up, timed, one to finish
    params = dataclasses.replace(greedy_params(max_tokens), output_kind=kind)
    ids = [f"o{seed}-{kind.name}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = rng.integers(2, 512, size=spec.prompt_len).tolist()  # never EOS (1) or BOS (0)
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while any(_tokens_so_far(engine, r) == 0 for r in ids):  # the prefill (one step when max_num_batched_tokens covers it)
        engine.step()
    outputs_per_step = 0 if kind == RequestOutputKind.FINAL_ONLY else batch
    for _ in range(spec.warmup_steps):
        engine.step()
    rows = []
    stamps = _Stamps()
    with stamped(engine, stamps):
        for _ in range(spec.steps):
            stamps.clear()
            start, cpu_start = time.perf_counter(), time.thread_time()
            outputs = engine.step()
            end, cpu_end = time.perf_counter(), time.thread_time()
            if len(outputs) != outputs_per_step or any(o.finished for o in outputs) or engine.num_unfinished() != batch:
                raise RuntimeError(f"a timed step of batch {batch} ({kind.name}) was not a steady decode step of "
                                   f"{batch} requests")
            if any(n != 1 for n in stamps.counts.values()):
                raise RuntimeError(f"a part boundary fired more than once in one step: {stamps.counts}")
            cpu = split_step(stamps.cpu, cpu_start, cpu_end)
            rows.append({**split_step(stamps.at, start, end), **{f"cpu_{k}": v for k, v in cpu.items()}})
    while engine.has_unfinished():
        engine.step()
    return rows


def _median_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def measure(spec: OverheadSpec, folder_root: Path | None = None) -> dict[str, Any]:
    """Median seconds per part at each depth, batch size and output kind, with the fixed and
    per-layer split. Both depths' engines stay up, and each (batch, kind) is timed in
    ``spec.rounds`` rounds that alternate the depths (their steps pooled), so that a noisy spell
    on a shared machine hits both ends of the line alike: timed one depth after the other, the
    extrapolated fixed part swung 3x between runs of the same code (AMD EPYC, 2026-12-06)."""
    depths = (1, spec.layers) if spec.layers > 1 else (1, 2)
    rounds = max(1, min(spec.rounds, spec.steps))
    # (kind, batch, round) -> depth -> that round's steps: pooled for the line, each round's own for its spread
    by_round: dict[tuple[str, int, int], dict[int, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(folder_root or tmp)
        engines: dict[int, Any] = {}
        try:
            for depth in depths:
                engines[depth] = build_overhead_engine(write_model(root / f"layers{depth}", depth), spec)
                time_decode_steps(engines[depth], OverheadSpec(batch_sizes=(1,), prompt_len=4, warmup_steps=1, steps=1,
                                                               device=spec.device, block_size=spec.block_size),
                                  1, seed=99)  # first-call costs out of the timing
            for batch in spec.batch_sizes:
                for kind in spec.output_kinds:
                    for r in range(rounds):
                        round_spec = dataclasses.replace(spec, steps=spec.steps // rounds + (r < spec.steps % rounds))
                        for depth in depths if r % 2 == 0 else depths[::-1]:
                            progress(f"overhead: {depth} layer(s), batch {batch}, {kind}, round {r + 1} of {rounds}")
                            rows = time_decode_steps(engines[depth], round_spec, batch, seed=batch * rounds + r,
                                                     output_kind=kind)
                            by_round.setdefault((kind, batch, r), {})[depth] = rows
        finally:
            for engine in engines.values():
                engine.shutdown()
    steps = {kind: {d: {batch: [row for r in range(rounds) for row in by_round[kind, batch, r][d]]
                        for batch in spec.batch_sizes} for d in depths} for kind in spec.output_kinds}
    lo, hi = depths
    table = []
    for kind in spec.output_kinds:
        for batch in spec.batch_sizes:
            shallow, deep = _median_parts(steps[kind][lo][batch]), _median_parts(steps[kind][hi][batch])
            per_layer = {k: (deep[k] - shallow[k]) / (hi - lo) for k in deep}
            fixed = {k: _fixed(shallow[k], deep[k], lo, hi) for k in deep}
            fixed_rounds = {k: [_fixed(_median_parts(by_round[kind, batch, r][lo])[k],
                                       _median_parts(by_round[kind, batch, r][hi])[k], lo, hi) for r in range(rounds)]
                            for k in ("step", "cpu_step")}
            table.append({"batch": batch, "output_kind": kind, "layers": hi, "measured": deep, "shallow": shallow,
                          "per_layer": per_layer, "fixed": fixed, "fixed_rounds": fixed_rounds})
    return {"spec": asdict(spec), "depths": list(depths), "rows": table,
            "steps": {kind: {str(d): {str(b): v for b, v in by_batch.items()} for d, by_batch in by_depth.items()}
                      for kind, by_depth in steps.items()}}


def _fixed(shallow: float, deep: float, lo: int, hi: int) -> float:
    """The line through (lo, shallow) and (hi, deep) at zero layers."""
    return shallow - lo * ((deep - shallow) / (hi - lo))


# ---- the report -------------------------------------------------------------------------------

def _flat_rows(data: dict[str, Any], clock: str = "") -> list[dict[str, Any]]:
    """Milliseconds per table column; ``clock`` "cpu_" for the CPU-time table."""
    out = []
    for r in data["rows"]:
        row: dict[str, Any] = {"batch": r["batch"], "output_kind": r["output_kind"]}
        for k in ("step", "core", *PARTS):
            row[k] = r["measured"][clock + k] * 1e3
        row["fixed"] = r["fixed"][clock + "step"] * 1e3
        spread = r["fixed_rounds"][clock + "step"]
        row["fixed_rounds"] = f"{min(spread) * 1e3:.2f}-{max(spread) * 1e3:.2f}"
        row["fixed_core"] = r["fixed"][clock + "core"] * 1e3
        row["per_layer"] = r["per_layer"][clock + "step"] * 1e3
        row["fixed_runner"] = r["fixed"][clock + "runner"] * 1e3
        out.append(row)
    return out


_COLUMNS = [
    Column("batch", "batch"),
    Column("output kind", "output_kind"),
    Column("step ms", "step", "{:.2f}"),
    Column("core ms", "core", "{:.2f}"),
    *(Column(f"{p} ms", p, "{:.2f}") for p in PARTS),
    Column("fixed ms", "fixed", "{:.2f}"),
    Column("fixed, by round ms", "fixed_rounds"),
    Column("core fixed ms", "fixed_core", "{:.2f}"),
    Column("per layer ms", "per_layer", "{:.3f}"),
    Column("runner fixed ms", "fixed_runner", "{:.2f}"),
]


def markdown(data: dict[str, Any], machine: str) -> str:
    spec = data["spec"]
    lo, hi = data["depths"]
    notes = [
        f"Random llama: vocabulary 512, hidden 64, 1 head and 1 KV head of 64, MLP 128; {spec['layers']} layers; "
        f"greedy decode of {spec['prompt_len']}-token prompts, median of {spec['steps']} steady steps per batch "
        f"on {spec['device']}.",
        "Parts (ms, at the full depth): schedule = Rust Scheduler.schedule(); inputs = StepInput, metadata, tensors, "
        "attention plan; runner = forward + head; sampling = sampling rows + sample(); output = continuation, "
        "appends, CoreOutputs; frontend = OutputProcessor (RequestOutputs); core = step - frontend.",
        f"fixed / per layer: a line through the step at {lo} and {hi} layers (fixed = extrapolated to 0 layers), "
        f"from every round's steps pooled; \"by round\": the least and the most of the {spec['rounds']} rounds' own "
        "lines (each round times both depths back to back): how far a shared machine's noise moves the fixed part.",
        "output kind: SamplingParams.output_kind of the workload: CUMULATIVE = a RequestOutput per request per "
        "step (Engine.step's default), DELTA = one per request per step with only the new tokens (what the server "
        "asks for), FINAL_ONLY = none until a request ends (what LLM.generate submits).",
    ]
    table = ("Wall time:\n\n" + markdown_table(_flat_rows(data), _COLUMNS)
             + "\n\nCPU time of the stepping thread (a shared machine's waits for a core left out):\n\n"
             + markdown_table(_flat_rows(data, "cpu_"), _COLUMNS))
    return render("Host cost of a decode step (negligible compute)", table, notes, machine)


def spec_from_config(cfg: BenchConfig) -> OverheadSpec:
    quick = OverheadSpec(prompt_len=16, warmup_steps=2, steps=12, rounds=4)
    spec = quick if cfg.quick else OverheadSpec()
    return OverheadSpec(**{**asdict(spec), "layers": cfg.layers or spec.layers, "device": cfg.device,
                           "block_size": cfg.block_size})


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    data = measure(spec_from_config(cfg))
    data["machine"] = machine
    return data, markdown(data, machine)
