"""The batch-1 ceiling each weight format's kernels allow: every linear layer of a step, nothing else.

A batch-1 decode step reads every weight once, so its bound is ``bandwidth / weight bytes``
(``pagedrs bench decode``'s stream bound). This times what the linear kernels alone make of
it: the model's own bound linear closures (all layers' QKV, O, gate/up, down, then the head)
called in a step's order on one token, weights streaming from memory as in a real step
(``pagedrs bench limits`` times one layer-sized GEMM over and over, whose weight stays in the
cache, which overstates the kernel at M = 1). Printed per format: milliseconds per pass, the
weight bytes read per second, tokens/s if a step were only this, and that ceiling as a share
of the stream bound. Medians of CPU time (the machine may be shared).

Each row also gives the bandwidth of the same reduction over a buffer of the weights' size, read
again and again, and the kernel's share of it: on a CPU whose cache holds the weights (the machine
line names the last-level cache) that, not DRAM, is what a step streams them from.

``--rows 1,2,3,4,8`` times passes of that many rows (a small decode batch), and float32 is
timed twice: in the layout the loader keeps (column-major on an MKL CPU,
``models/layers.py``) and row-major as in the checkpoint, the evidence for that choice.

``gguf`` is the Rust GEMV over the file's own blocks (``models/gguf_linear.py``). ``--clock wall``
times wall-clock seconds instead, the fair clock with ``--threads 2`` (CPU time adds up the
workers, and the GEMV's pool spins briefly between calls).

    python benches/linear_streaming.py [--threads 1] [--formats float32,bfloat16,int8,int4,gguf] [--rows 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pagedrs.bench.limits import read_bandwidth
from pagedrs.bench.machine import describe_machine
from pagedrs.models import load_model
from pagedrs.models.layers import LinearBase


def kernel_pass_seconds(model: torch.nn.Module, rows: int = 1, repeats: int = 7, clock: str = "cpu") -> float:
    """Median CPU (or wall-clock) seconds of one pass over the model's linear closures at M = ``rows``."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    layers = model.bind()  # type: ignore[operator]  # LlamaForCausalLM.bind
    calls = []
    for layer in layers:
        for fn, width in ((layer.qkv, layer.input_norm.numel()), (layer.o, layer.num_heads * layer.head_dim),
                          (layer.gate_up, layer.input_norm.numel()), (layer.down, None)):
            calls.append((fn, width))
    hidden = layers[0].input_norm.numel()
    intermediate = layers[0].gate_up(torch.zeros(1, hidden)).shape[1] // 2
    inputs = [torch.randn(rows, intermediate if width is None else width) for _, width in calls]
    head_input = torch.randn(rows, hidden)
    head: Any = model._bound_head

    def one_pass() -> None:
        for (fn, _), x in zip(calls, inputs, strict=True):
            fn(x)
        head(head_input)

    samples = []
    with torch.inference_mode():
        one_pass()
        for _ in range(repeats):
            start = now()
            one_pass()
            samples.append(now() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--formats", default="float32,bfloat16,int8,int4")
    parser.add_argument("--rows", default="1", help="comma-separated batch rows (M) per pass")
    parser.add_argument("--clock", default="cpu", choices=["cpu", "wall"])
    args = parser.parse_args()
    try:
        all_rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        all_rows = []
    if not all_rows or min(all_rows) < 1:
        parser.error(f"--rows is {args.rows!r}; allowed: comma-separated integers >= 1")
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(1 << 30)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (float32 sum over 1 GiB)")
    print("| weights | rows | ms per pass | weight GB/s | tokens/s ceiling | stream bound (tokens/s) | ceiling / bound "
          "| bandwidth of a weights-sized buffer | ceiling / that bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        loaded = load_model(args.model, weight_dtype=fmt)
        torch.set_num_threads(args.threads)
        weight_bytes = loaded.model.weight_bytes()
        # the same reduction over a buffer the size of these weights, summed again and again: where a
        # cache holds them (a large L3), the step reads them from there, above the DRAM bound
        resident = read_bandwidth(max(weight_bytes // 4 * 4, 1 << 20))
        name = loaded.weight_format.name if loaded.weight_format else fmt
        labels = [""]
        if any(_column_major(m) for m in loaded.model.modules()):
            labels.append(" (row-major)")
        for label in labels:
            if label:
                _to_row_major(loaded.model)
            for rows in all_rows:
                seconds = kernel_pass_seconds(loaded.model, rows, clock=args.clock)
                bound = bandwidth / weight_bytes * rows
                print(f"| {name}{label} | {rows} | {seconds * 1e3:.2f} | {weight_bytes / seconds / 1e9:.1f} | "
                      f"{rows / seconds:.0f} | {bound:.0f} | {rows / seconds / bound:.0%} | {resident / 1e9:.1f} GB/s | "
                      f"{weight_bytes / seconds / resident:.0%} |")
        del loaded
    print(f"Machine: {describe_machine().describe()}; {cpu_flags()}; clock {args.clock}")


def cpu_flags() -> str:
    """The instruction sets the kernels care about, from /proc/cpuinfo, and the GEMV kernels detected."""
    from pagedrs._core import gemv_kernels

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        flags = set()
    names = ("avx2", "avx512_vnni", "avx512_bf16", "amx_int8")
    return "flags " + " ".join(f"{n}={'yes' if n in flags else 'no'}" for n in names) + f", gemv kernels {gemv_kernels()}"


def _column_major(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(module, LinearBase) and weight is not None and weight.dim() == 2 and weight.stride(0) == 1


def _to_row_major(model: torch.nn.Module) -> None:
    """The checkpoint's layout again for every column-major dense weight (then rebinds the closures)."""
    for module in model.modules():
        if _column_major(module):
            module.weight.data = module.weight.data.contiguous()
    model.bind()  # type: ignore[operator]


if __name__ == "__main__":
    main()
