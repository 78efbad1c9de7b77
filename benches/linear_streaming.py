"""The batch-1 ceiling each weight format's kernels allow: every linear layer of a step, nothing else.

A batch-1 decode step reads every weight once, so its bound is ``bandwidth / weight bytes``
(``pagedrs bench decode``'s stream bound). This times what the linear kernels alone make of
it: the model's own bound linear closures (all layers' QKV, O, gate/up, down, then the head)
called in a step's order on one token, weights streaming from memory as in a real step
(``pagedrs bench limits`` times one layer-sized GEMM over and over, whose weight stays in the
cache, which overstates the kernel at M = 1). Printed per format: milliseconds per pass, the
weight bytes read per second, tokens/s if a step were only this, and that ceiling as a share
of the stream bound. Medians of CPU time (the machine may be shared).

    python benches/linear_streaming.py [--threads 1] [--formats float32,bfloat16,int8,int4]
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


def kernel_pass_seconds(model: torch.nn.Module, repeats: int = 7) -> float:
    """Median CPU seconds of one pass over the model's linear closures at M = 1."""
    layers = model.bind()  # type: ignore[operator]  # LlamaForCausalLM.bind
    calls = []
    for layer in layers:
        for fn, width in ((layer.qkv, layer.input_norm.numel()), (layer.o, layer.num_heads * layer.head_dim),
                          (layer.gate_up, layer.input_norm.numel()), (layer.down, None)):
            calls.append((fn, width))
    hidden = layers[0].input_norm.numel()
    intermediate = layers[0].gate_up(torch.zeros(1, hidden)).shape[1] // 2
    inputs = [torch.randn(1, intermediate if width is None else width) for _, width in calls]
    head_input = torch.randn(1, hidden)
    head: Any = model._bound_head

    def one_pass() -> None:
        for (fn, _), x in zip(calls, inputs, strict=True):
            fn(x)
        head(head_input)

    samples = []
    with torch.inference_mode():
        one_pass()
        for _ in range(repeats):
            start = time.process_time()
            one_pass()
            samples.append(time.process_time() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--formats", default="float32,bfloat16,int8,int4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(1 << 30)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (float32 sum over 1 GiB)")
    print("| weights | ms per pass | weight GB/s | tokens/s ceiling | stream bound | ceiling / bound |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        loaded = load_model(args.model, weight_dtype=fmt)
        torch.set_num_threads(args.threads)
        weight_bytes = loaded.model.weight_bytes()
        seconds = kernel_pass_seconds(loaded.model)
        bound = bandwidth / weight_bytes
        name = loaded.weight_format.name if loaded.weight_format else fmt
        print(f"| {name} | {seconds * 1e3:.2f} | {weight_bytes / seconds / 1e9:.1f} | "
              f"{1 / seconds:.0f} | {bound:.0f} | {1 / seconds / bound:.0%} |")
        del loaded
    print(f"Machine: {describe_machine().describe()}")


if __name__ == "__main__":
    main()
