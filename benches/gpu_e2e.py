"""End to end on a GPU (run by benches/gpu_check.sh): decode with and without CUDA graphs, and the
throughput workload paged vs contiguous vs transformers at equal KV memory.

Model: SmolLM2-135M's geometry (30 layers, hidden 576, 9 heads, 3 KV heads of 64, MLP 1536,
vocabulary 49152, tied embeddings) with random weights, written as a Hugging Face folder: the
embedded GGUF's weights do not travel to the GPU machine, and the step's cost does not depend on them.

Sections (each writes ``--out DIR/<section>.json`` as soon as it has run, so a run cut short
keeps what ran):

* ``decode``: batch 1, 32, 256 x ``max_tokens`` new tokens after a 32-token prompt, greedy,
  ignore_eos, bf16 (``TIMED_STEPS`` steady decode steps timed, then the requests are aborted); modes ``eager`` (enforce_eager), ``padded`` (the padded path without graphs:
  the graphs' eager twin), ``graphs`` and ``graphs+async`` (asynchronous scheduling on top). Per batch and mode: decode tokens/s over the steady
  decode steps, their median step time, and the GPU busy share of those steps: the kernels'
  device time (torch.profiler) over the wall time of a few profiled steps.
* ``throughput``: ``pagedrs bench throughput``'s workload (QUICK, or FULL without ``--quick``;
  ``--requests`` of them) on one KV byte budget: paged, contiguous, and transformers when it is
  installed (skipped otherwise).

``--device cpu --quick`` (what ``gpu_check.sh --dry-run`` runs) takes every code path on the CPU in
seconds with a 2-layer model of the same widths cut down; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192}  # fmt: skip
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 512}  # fmt: skip
PROMPT_LEN = 32
TIMED_STEPS = 40  # decode steps timed per batch and mode (the requests are then aborted)
MODES = {"eager": {"enforce_eager": True}, "padded": {"enforce_eager": True, "pad_decode": True}, "graphs": {},
         "graphs+async": {"async_scheduling": True}}


def write_model(folder: Path, geometry: dict[str, int], seed: int = 0) -> Path:
    """A llama of ``geometry`` with random weights (std 0.02, norms 1) as a Hugging Face folder."""
    from safetensors.torch import save_file

    g = geometry
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **g, "rms_norm_eps": 1e-5,
              "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}  # fmt: skip
    h, q, kv, i = g["hidden_size"], g["num_attention_heads"] * g["head_dim"], g["num_key_value_heads"] * g["head_dim"], \
        g["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (g["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(g["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
             for k, s in shapes.items()}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kernel_share(engine: Any, steps: int, device: str) -> float | None:
    """Device time of the kernels over the wall time of ``steps`` engine steps (torch.profiler; the
    profiler's own host cost makes this a lower bound). None on the CPU (which profiles no kernels,
    but takes the same path)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = time.perf_counter() - start
    device_us = 0.0
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            device_us += float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
    return device_us / 1e6 / wall if cuda else None


def decode_run(engine: Any, batch: int, max_tokens: int, device: str, seed: int) -> dict[str, Any]:
    """B requests at once; after the prefill steps, every step decodes B rows until the first finishes."""
    from pagedrs import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for r in range(batch):
        engine.add_request(f"b{batch}-{r}", {"prompt_token_ids": torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()},
                           params)  # fmt: skip
    engine.step()  # the prefill (max_num_batched_tokens holds every prompt)
    while engine.stats()["num_waiting"]:
        engine.step()
    for _ in range(2):  # the first decode steps (and, with padding, the capture sizes' first use) untimed
        engine.step()
    profiled = min(5, max(1, max_tokens // 8))
    share = kernel_share(engine, profiled, device)
    times: list[float] = []
    remaining = max_tokens - 3 - profiled - 1
    for _ in range(max(1, min(remaining, TIMED_STEPS))):
        start = time.perf_counter()
        engine.step()  # returns once the sampled ids are on the host: the step's GPU work is done
        times.append(time.perf_counter() - start)
    for r in range(batch):  # the steady state is measured: the rest of the tokens would only cost time
        engine.abort(f"b{batch}-{r}")
    while engine.has_unfinished():
        engine.step()
    step_s = statistics.median(times)
    return {"batch": batch, "decode_steps_timed": len(times), "median_step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s, "gpu_busy_share": share}  # fmt: skip


def section_decode(args: argparse.Namespace, folder: Path, write: Any) -> None:
    from pagedrs import Engine, EngineArgs

    results: dict[str, Any] = {"modes": {}, "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
                               "prompt_len": PROMPT_LEN}  # fmt: skip
    biggest = max(args.batches)
    tokens_per_seq = PROMPT_LEN + args.max_tokens + 8
    blocks = biggest * (-(-tokens_per_seq // 16) + 1) + 16
    for mode, extra in MODES.items():
        start = time.perf_counter()
        engine = Engine(EngineArgs(model=str(folder), device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
                                   block_size=16, num_gpu_blocks=blocks, max_num_seqs=biggest,
                                   max_model_len=tokens_per_seq + 16, max_num_batched_tokens=max(2048, biggest * PROMPT_LEN),
                                   enable_prefix_caching=False, **extra))  # fmt: skip
        executor = engine.core.executor
        row: dict[str, Any] = {"startup_s": time.perf_counter() - start,
                               "graph_sizes": list(executor.decode_graph_sizes),
                               "padded": executor.padding is not None, "batches": []}  # fmt: skip
        for batch in args.batches:
            row["batches"].append(decode_run(engine, batch, args.max_tokens, args.device, seed=batch))
            results["modes"][mode] = row
            write("decode", results)  # after every batch: a run cut short keeps it
        layers = engine.loaded.config.num_hidden_layers
        for b in row["batches"]:
            b["step_ms_per_layer"] = b["median_step_ms"] / layers
        del engine, executor
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    for batch in args.batches:
        by_mode = {m: next(b for b in r["batches"] if b["batch"] == batch) for m, r in results["modes"].items()}
        results.setdefault("speedup_graphs_vs_eager", {})[str(batch)] = (
            by_mode["graphs"]["tokens_per_s"] / by_mode["eager"]["tokens_per_s"])
    write("decode", results)


def section_throughput(args: argparse.Namespace, folder: Path, write: Any) -> None:
    """``bench throughput``'s systems on one KV byte budget (bench/throughput.py), on this device."""
    import gc

    from pagedrs.bench.engine_runner import build_engine, run_requests, warm_up
    from pagedrs.bench.metrics import Timeline, summarize
    from pagedrs.bench.model_spec import kv_geometry
    from pagedrs.bench.throughput import make_budget
    from pagedrs.bench.workloads import FULL, QUICK, synthetic_workload

    geo = kv_geometry(folder, args.dtype)
    spec = dataclasses.replace(QUICK if args.quick else FULL, max_model_len=min((QUICK if args.quick else FULL).max_model_len,
                                                                                 geo.context_len))  # fmt: skip
    spec = dataclasses.replace(spec, num_requests=args.requests)
    if args.device == "cpu" and args.quick:  # the code path in seconds: short prompts and outputs
        spec = dataclasses.replace(spec, prompt=dataclasses.replace(spec.prompt, mean=8, maximum=16),
                                   output=dataclasses.replace(spec.output, mean=8, maximum=16))  # fmt: skip
    workload = synthetic_workload(spec, geo.vocab_size)
    budget = make_budget(geo, spec.max_model_len, budget_seqs=4, block_size=16)
    results: dict[str, Any] = {"kv_budget": budget.to_dict(), "workload": workload.summary(), "device": args.device}
    outputs: dict[str, dict[str, list[int]]] = {}
    for layout in ("paged", "contiguous"):
        engine = build_engine(str(folder), device=args.device, dtype=args.dtype, weight_dtype="auto", block_size=16,
                              kv_layout=layout, num_gpu_blocks=budget.num_gpu_blocks, skip_tokenizer_init=True,
                              max_model_len=spec.max_model_len, enable_prefix_caching=False, seed=spec.seed)  # fmt: skip
        warm_up(engine, geo.vocab_size)
        run = run_requests(engine, workload.requests, label=f"throughput {layout}")
        del engine
        gc.collect()
        timeline = Timeline(t=[s.t for s in run.samples], running=[s.num_running for s in run.samples],
                            reserved_slots=[s.reserved_slots for s in run.samples],
                            live_slots=[s.live_slots for s in run.samples])  # fmt: skip
        results[layout] = summarize(wall_s=run.wall_s, num_requests=len(workload.requests),
                                    num_output_tokens=run.num_output_tokens,
                                    num_prompt_tokens=sum(len(r.prompt_token_ids) for r in workload.requests),
                                    timeline=timeline, bytes_per_token=budget.bytes_per_token)  # fmt: skip
        outputs[layout] = run.output_token_ids
        write("throughput", results)
    if importlib.util.find_spec("transformers") is not None:
        from pagedrs.bench.hf_baseline import load_hf_model, run_hf, static_batch_size

        model = load_hf_model(folder, args.dtype).to(args.device)
        results["hf"] = run_hf(model, workload.requests, static_batch_size(budget.slots, workload.requests),
                               budget.bytes_per_token)  # fmt: skip
        del model
    else:
        results["hf"] = {"skipped": "transformers is not installed"}
    paged = results["paged"]["tokens_per_s"]
    results["speedup"] = {"paged_vs_contiguous": paged / results["contiguous"]["tokens_per_s"]}
    if "tokens_per_s" in results["hf"]:
        results["speedup"]["paged_vs_hf"] = paged / results["hf"]["tokens_per_s"]
    same = sum(outputs["paged"][r.request_id] == outputs["contiguous"][r.request_id] for r in workload.requests)
    results["paged_contiguous_identical_outputs"] = f"{same}/{len(workload.requests)}"
    write("throughput", results)


SECTIONS = {"decode": section_decode, "throughput": section_throughput}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <section>.json, written as each runs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--quick", action="store_true", help="small sizes (with --device cpu: seconds)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    parser.add_argument("--requests", type=int, default=None,
                        help="throughput requests (default 16; 4 with --device cpu --quick): transformers' static "
                             "batch of 2 under the 4-sequence budget makes each one cost seconds")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.batches = (1, 4) if cpu and args.quick else (1, 32, 256)
    args.max_tokens = 12 if cpu and args.quick else 128
    args.requests = args.requests or (4 if cpu and args.quick else 16)
    args.out.mkdir(parents=True, exist_ok=True)

    def write(section: str, data: dict[str, Any]) -> None:
        (args.out / f"{section}.json").write_text(json.dumps(data, indent=1, default=str))

    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "smollm2-geometry", TINY if cpu and args.quick else SMOLLM2)
        for name in args.sections.split(","):
            start = time.perf_counter()
            try:
                SECTIONS[name](args, folder, write)
                print(f"gpu_e2e {name}: done in {time.perf_counter() - start:.1f} s -> {args.out / (name + '.json')}")
            except Exception:  # noqa: BLE001 - one section's failure must not lose the others
                status = 1
                (args.out / f"{name}.error.txt").write_text(traceback.format_exc())
                print(f"gpu_e2e {name}: FAILED after {time.perf_counter() - start:.1f} s\n{traceback.format_exc()}",
                      file=sys.stderr)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
