"""``weight_dtype="q4_0" | "q4_1" | "q8_0"``: any checkpoint's linear weights quantized at load into a
GGUF block format, then multiplied by the Rust GEMV (and run by the fused CPU decode).

Why: a Hugging Face folder (safetensors, no GGUF file) on a CPU ran its products dense (float32: 32
bits a weight streamed per token at batch 1) or through aten's packed int8 / int4 kernels (under 40% of
the read bandwidth at M = 1, issue 30). Quantized into the blocks the Rust kernel reads, the same
model streams 8.5 (Q8_0) or 4.5-5 (Q4_0 / Q4_1) bits a weight at the kernel's speed, and every decode
step is one Rust call (``cpu_decode.py``). A GGUF file asked for in one of these formats is dequantized
and quantized again (a second rounding; ``weight_dtype="gguf"`` reads its own blocks instead).

Quantizers: gguf-py's (``gguf.quants.quantize``, llama.cpp's reference rules): Q8_0 ``d = max|w| /
127``; Q4_0 ``d = w_maxabs / -8`` (the signed extreme), codes ``w / d + 8``; Q4_1 ``d = (max - min) /
15``, ``m = min``; per block of 32 input features, scales in f16. A layer whose input width (this
rank's) is not a multiple of 32 keeps the dense product. The output head is Q8_0 under the 4-bit
formats, as llama.cpp's files keep theirs above 4 bits and as ``int4``'s head is int8 (see
``quant.py``: a 4-bit head measured 11 points of greedy agreement lower on SmolLM2).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedrs.models.gguf_convert import QK, first_unscalable_row
from pagedrs.models.gguf_linear import GgufLinearMethod
from pagedrs.models.layers import LinearBase

BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0")  # weight_dtype values


class BlockQuantizedMethod(GgufLinearMethod):
    """Loads a dense float32 weight like the dense path, then quantizes it into ``name``'s blocks (the
    ``block_format``) for a ``GgufMatrix`` (``GgufLinearMethod``'s product, threads and fused decode)."""

    def __init__(self, params_dtype: torch.dtype, block_format: str) -> None:
        if block_format not in BLOCK_FORMATS:
            raise ValueError(f"block format {block_format!r} is not one of {', '.join(BLOCK_FORMATS)}")
        super().__init__(params_dtype)
        self.name = block_format  # LinearMethod's name: the block format

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if getattr(layer, "gguf_matrix", None) is not None or layer.in_per_rank % QK:
            return  # installed already, or not whole blocks: the dense product
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quantize

        from pagedrs._core import GgufMatrix

        weight = layer.weight.detach().to(torch.float32).contiguous().numpy()
        if not np.isfinite(weight).all():
            bad = int(np.argmin(np.isfinite(weight).all(axis=1)))
            raise ValueError(f"weight_dtype {self.name!r}: {type(layer).__name__} (in={layer.in_features}, "
                             f"out={layer.out_features}) has a weight that is not finite in row {bad}")
        with np.errstate(over="ignore"):
            blocks = np.ascontiguousarray(quantize(weight, GGMLQuantizationType[self.name.upper()]))
        row = first_unscalable_row(blocks, self.name.upper())
        if row is not None:
            raise ValueError(f"weight_dtype {self.name!r}: {type(layer).__name__} (in={layer.in_features}, "
                             f"out={layer.out_features}) has weights up to {float(np.abs(weight[row]).max()):.6g} in row "
                             f"{row}, past what the format's f16 scale holds; use float32 or bfloat16")
        rows, cols = weight.shape
        GgufLinearMethod.install(layer, GgufMatrix(blocks.reshape(-1), rows, cols, self.name,
                                                   f"{self.name} of a [{rows}, {cols}] weight"))
