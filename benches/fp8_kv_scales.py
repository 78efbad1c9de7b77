"""How to choose an fp8 KV cache's scales: unit (vLLM's uncalibrated default, what pagedrs uses)
against per-layer scales calibrated from a prefill, on the embedded SmolLM2.

    PYTHONPATH=python python benches/fp8_kv_scales.py

One prefill of tests/fp8_quality_text.txt measures each layer's K and V amax; then the same
prefill runs with every layer's K and V rounded through fp8 at (a) scale 1, (b) amax / 448 (the
format filled) and (c) vLLM's ``calculate_kv_scales`` (K amax / 200, V amax / 100), and prints
the perplexity change against float32 pages and the top-1 agreement with them. The rounding is
``attention.kv_quant``'s own (quantize, then dequantize), applied to the rows before they are
written, which is what storing them in fp8 means for every later read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from pagedrs.attention import AttentionMetadata, TorchAttentionBackend
from pagedrs.attention.kv_quant import dequantize, quantize
from pagedrs.models import load_model

TEXT = (Path(__file__).resolve().parents[1] / "tests" / "fp8_quality_text.txt").read_text()
Scales = Callable[[int], tuple[float, float]]


class RoundingBackend(TorchAttentionBackend):
    """Rounds each layer's new K and V through ``fp8`` with that layer's scales (None: no rounding),
    and records each layer's amax. Layers are counted by write_kv calls (one per layer, in order)."""

    def __init__(self, num_layers: int, fp8: torch.dtype | None = None, scales: Scales | None = None) -> None:
        super().__init__()
        self.num_layers, self.fp8, self.scales, self.calls = num_layers, fp8, scales, 0
        self.amax = [[0.0, 0.0] for _ in range(num_layers)]

    def write_kv(self, key, value, key_cache, value_cache, meta) -> None:  # type: ignore[no-untyped-def]
        layer = self.calls % self.num_layers
        self.calls += 1
        self.amax[layer] = [max(self.amax[layer][0], float(key.abs().max())), max(self.amax[layer][1], float(value.abs().max()))]
        if self.fp8 is not None and self.scales is not None:
            ks, vs = (torch.tensor([s]) for s in self.scales(layer))
            key = dequantize(quantize(key, ks, self.fp8), ks, key.dtype)
            value = dequantize(quantize(value, vs, self.fp8), vs, value.dtype)
        super().write_kv(key, value, key_cache, value_cache, meta)


def prefill_logits(loaded, ids: list[int], backend: TorchAttentionBackend) -> torch.Tensor:
    model, n, block = loaded.model, len(ids), 16
    pages = -(-n // block)
    meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                             torch.arange(pages, dtype=torch.int32)[None], n, n, [0, n], [n])  # fmt: skip
    backend.plan(meta, block)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), torch.zeros(model.kv_cache_shape(pages, block)),
                                          meta, backend))  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m", weight_dtype="float32")
    layers = loaded.config.num_hidden_layers
    ids = loaded.tokenizer.encode(TEXT)
    target = torch.tensor(ids[1:])
    probe = RoundingBackend(layers)
    base = prefill_logits(loaded, ids, probe)
    base_nll = float(torch.nn.functional.cross_entropy(base[:-1], target))
    amax = probe.amax
    print(f"{len(ids)} tokens; float32 pages: perplexity {math.exp(base_nll):.4f}")
    print("K amax per layer", [round(a[0], 1) for a in amax])
    print("V amax per layer", [round(a[1], 2) for a in amax])
    rules: dict[str, Scales] = {
        "unit (1.0)": lambda layer: (1.0, 1.0),
        "amax / 448": lambda layer: (amax[layer][0] / 448, amax[layer][1] / 448),
        "vLLM calculate_kv_scales (K amax/200, V amax/100)": lambda layer: (amax[layer][0] / 200, amax[layer][1] / 100),
    }
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for name, rule in rules.items():
            logits = prefill_logits(loaded, ids, RoundingBackend(layers, fp8, rule))
            nll = float(torch.nn.functional.cross_entropy(logits[:-1], target))
            agree = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
            print(f"{str(fp8).removeprefix('torch.'):14} {name:52} perplexity {100 * (math.exp(nll - base_nll) - 1):+.2f}%  "
                  f"top-1 agreement {100 * agree:.1f}%")


if __name__ == "__main__":
    main()
