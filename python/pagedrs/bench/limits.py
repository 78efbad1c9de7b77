"""The machine's own limits, measured: read bandwidth and GEMM FLOP/s, so tokens/s has a bound beside it.

Decode is bound by one of two things. At batch 1 every step reads every weight once, so
``tokens/s <= bandwidth / weight bytes``; at large batches the weights are reused across
the batch and ``tokens/s <= GEMM FLOP/s / (2 * linear parameters)``. Both are measured
here rather than taken from a datasheet, on the thread count the benchmark runs with:

- bandwidth: ``sum()`` over a float32 tensor far larger than the last-level cache;
- GEMM: ``[M, hidden] x [hidden, intermediate]`` (the model's own MLP shape) for each M
  and weight format: dense float32 and bfloat16 (oneDNN), the packed int8 / int4
  kernels the quantized formats use, and our GGUF kernel on random Q4_1 blocks.

Medians of several repeats; the machine may be shared, so a benchmark reports its
tokens/s as a ratio to limits measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.decode_grid import batch_sizes
from pagedrs.bench.report import Column, markdown_table, render

FORMATS = ("float32", "bfloat16", "int8", "int4")


def _median_seconds(fn: Callable[[], Any], repeats: int, min_time: float = 0.02) -> float:
    """Median seconds of one call; each sample loops until ``min_time`` so that tiny GEMMs are timed well."""
    fn()
    samples = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def read_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a float32 reduction over ``num_bytes`` (well past any cache), in 2 MiB pages as the
    engine's weights and CPU KV cache are (``pagedrs.huge_pages``): the bound is the best read."""
    import torch

    from pagedrs import huge_pages

    x = huge_pages.zeros((num_bytes // 4,), torch.float32).fill_(1.0)
    return num_bytes / _median_seconds(lambda: x.sum(), repeats, min_time=0.0)


def _layer(fmt: str, k: int, n: int) -> Any:
    import torch

    from pagedrs.models.layers import ReplicatedLinear
    from pagedrs.models.quant import WeightFormat

    layer = ReplicatedLinear(k, n, method=WeightFormat(fmt, torch.float32).method(k, n))
    if fmt == "gguf":  # the kernel reads a file's blocks, not a dense weight: random Q4_1 ones
        _install_random_q4_1(layer, k, n)
        return layer
    layer.weight_loader(layer.weight, torch.randn(n, k, generator=torch.Generator().manual_seed(0)))
    layer.process_weights_after_loading()
    return layer


def random_q4_1_blocks(n: int, k: int, seed: int = 0) -> Any:
    """[n * k / 32, 20] uint8: random Q4_1 blocks (the embedded model's body format: f16 scale, f16
    minimum, 32 nibbles) of an [n, k] weight, scaled like SmolLM2's."""
    import numpy as np

    if k % 32:
        raise ValueError(f"Q4_1 blocks: in_features {k} is not a multiple of the block size 32")
    rng = np.random.default_rng(seed)
    blocks = n * (k // 32)
    raw = np.empty((blocks, 20), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(0.001, 0.01, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    raw[:, 2:4] = rng.uniform(-0.08, 0.0, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    raw[:, 4:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return raw


def _install_random_q4_1(layer: Any, k: int, n: int) -> None:
    """So the GGUF kernel's GEMM throughput is measured, not the dense fallback's."""
    from pagedrs._core import GgufMatrix
    from pagedrs.models.gguf_linear import GgufLinearMethod

    raw = random_q4_1_blocks(n, k)
    GgufLinearMethod.install(layer, GgufMatrix(raw.reshape(-1), n, k, "Q4_1", "limits.random_q4_1"))


def gemm_flops(fmt: str, m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` through the linear method of ``fmt`` (float32 activations in and out)."""
    import torch

    layer = _layer(fmt, k, n)
    x = torch.randn(m, k)
    with torch.inference_mode():
        seconds = _median_seconds(lambda: layer(x), repeats)
    return 2.0 * m * k * n / seconds


def measure(batch_sizes: tuple[int, ...], formats: tuple[str, ...], hidden: int, intermediate: int,
            *, quick: bool) -> dict[str, Any]:
    bandwidth = read_bandwidth(256 << 20 if quick else 1 << 30, repeats=3 if quick else 5)
    repeats = 3 if quick else 5
    gemm = {fmt: {m: gemm_flops(fmt, m, hidden, intermediate, repeats) for m in batch_sizes} for fmt in formats}
    return {"read_bandwidth_bytes_per_s": bandwidth, "gemm_flops": gemm,
            "gemm_shape": [hidden, intermediate], "batch_sizes": list(batch_sizes)}


def model_shape(model: str) -> tuple[int, int]:
    """(hidden_size, intermediate_size) of the benchmark's model."""
    import json

    from pagedrs.bench.model_spec import resolve_model

    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    return int(cfg["hidden_size"]), int(cfg["intermediate_size"])


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    hidden, intermediate = model_shape(cfg.model)
    data = measure(batch_sizes(cfg.quick), FORMATS, hidden, intermediate, quick=cfg.quick)
    data["machine"] = machine
    return data, markdown(data, machine)


def markdown(data: dict[str, Any], machine: str) -> str:
    sizes = data["batch_sizes"]
    rows = [{"fmt": fmt, **{f"m{m}": data["gemm_flops"][fmt][m] / 1e9 for m in sizes}} for fmt in data["gemm_flops"]]
    columns = [Column("weights", "fmt")] + [Column(f"GFLOP/s M={m}", f"m{m}", "{:.1f}") for m in sizes]
    k, n = data["gemm_shape"]
    notes = [
        f"Read bandwidth (float32 sum over a tensor past the caches): "
        f"{data['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s.",
        f"GEMM: [M, {k}] x [{k}, {n}] through each format's linear method, float32 activations in and out "
        "(the quantized kernels multiply in bfloat16). Medians.",
    ]
    return render("Machine limits (measured)", markdown_table(rows, columns), notes, machine)
