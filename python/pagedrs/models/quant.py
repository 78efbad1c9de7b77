"""Weight formats: which ``LinearMethod`` each linear layer gets for a ``weight_dtype``.

The quantized methods are weight-only: activations stay in the model's dtype between
layers, and only inside the GEMM are they cast to bfloat16, because PyTorch's packed
CPU kernels (``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``) take
bfloat16 activations and scales (with float32 activations they fall back to a path
measured 20-100x slower). Weights land dense through each layer's ``weight_loader``
and are quantized once in ``process_weights_after_loading``, so every checkpoint source
(safetensors, GGUF) feeds every format.

- ``int8``: symmetric, one scale per output channel: ``W ≈ q * scale[n]``, q in [-127, 127].
- ``int4``: asymmetric, one (scale, min) per group of ``group_size`` input features:
  ``W ≈ q * scale + min``, q in [0, 15]. This is exactly GGUF's Q4_1 with group 32, so a
  Q4_1 checkpoint re-quantizes to (nearly) its own values. Layers the kernel cannot
  pack (output features not a multiple of 16, input not a multiple of the group) fall
  back to int8. The LM head is int8 in both formats (``head_method``): the GGUF files keep
  their token embedding / output tensor above 4 bits (the embedded SmolLM2: Q8_0), and an
  int4 head measured on it cut teacher-forced greedy agreement from 99.0% to 88.0% and
  added 2.6 points of perplexity for about 5% of batch-1 decode speed. A tied embedding
  stays dense for the lookup (it reads only the step's rows), so the head is a separate
  packed copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pagedrs.engine_args import WEIGHT_DTYPES
from pagedrs.models.block_quant import BLOCK_FORMATS, BlockQuantizedMethod
from pagedrs.models.gguf_convert import kernel_type
from pagedrs.models.gguf_linear import GgufLinearMethod, cpu_runs_gguf_kernel
from pagedrs.models.layers import DenseLinearMethod, LinearBase, LinearMethod

COMPUTE_DTYPE = torch.bfloat16  # what the packed kernels multiply in
INT4_GROUP_SIZE = 32  # GGUF Q4_1's block; every SmolLM2/Llama width is a multiple of it


class _StagedDenseWeight(LinearMethod):
    """Shared by the quantized methods: load into a dense float32 weight, quantize it afterwards."""

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, device: Any) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32, device=device),
                                    requires_grad=False)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach().float()
        del layer.weight  # the dense copy is what the format exists to avoid reading
        layer.register_parameter("weight", None)
        for name, tensor in self.quantize(weight).items():
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def weight_bytes(self, layer: LinearBase) -> int:
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "bias")


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out: int) -> torch.Tensor:
    y = y.to(x.dtype).view(*x.shape[:-1], out)
    return y if bias is None else y + bias


class Int8WeightOnlyMethod(_StagedDenseWeight):
    name = "int8"

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(("qweight", "scales"), quantize_int8(weight), strict=True))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        x2 = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(x2, qweight, scales)
        return _finish(y, x, bias, qweight.shape[0])

    def bind(self, layer: LinearBase, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        if bias is not None:
            return super().bind(layer, bias)
        qweight, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        mm = torch.ops.aten._weight_int8pack_mm.default  # the overload, resolved once
        return lambda x: mm(x.to(COMPUTE_DTYPE), qweight, scales).to(x.dtype)


class Int4WeightOnlyMethod(_StagedDenseWeight):
    name = "int4"

    def __init__(self, params_dtype: torch.dtype, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__(params_dtype)
        self.group_size = group_size

    @staticmethod
    def can_pack(in_features: int, out_features: int, group_size: int = INT4_GROUP_SIZE) -> bool:
        """The CPU kernel packs N in tiles of 16 and needs whole groups along K."""
        return out_features % 16 == 0 and in_features % group_size == 0

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Packs this rank's weight; a shard that does not pack (tensor parallelism cut K below a group: 4
        ranks of a 64-wide input) runs int8, as ``WeightFormat.method`` picks for a whole weight that does
        not pack. It failed in the quantizer's reshape ("shape '[64, 0, 32]' is invalid")."""
        out_features, in_features = layer.weight.shape
        if not self.can_pack(in_features, out_features, self.group_size):
            layer.method = Int8WeightOnlyMethod(self.params_dtype)
            layer.method.process_weights_after_loading(layer)
            return
        super().process_weights_after_loading(layer)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale, minimum = quantize_int4(weight, self.group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale: [K / group, N, 2]
        scales_zeros = torch.stack([scale.T, (minimum + 8 * scale).T], dim=-1).contiguous().to(COMPUTE_DTYPE)
        return {"qweight": packed, "scales_zeros": scales_zeros}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scales_zeros = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales_zeros)
        x2 = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, qweight, self.group_size, scales_zeros)
        return _finish(y, x, bias, qweight.shape[0])

    def bind(self, layer: LinearBase, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        if bias is not None:
            return super().bind(layer, bias)
        qweight, scales_zeros = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales_zeros)
        mm, group = torch.ops.aten._weight_int4pack_mm_for_cpu.default, self.group_size
        return lambda x: mm(x.to(COMPUTE_DTYPE), qweight, group, scales_zeros).to(x.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale bf16 [N]) with ``W ≈ q * scale``; the bf16 scale is the one the kernel uses."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).to(COMPUTE_DTYPE)
    q = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in 0..15, scale [N, K / g], min [N, K / g]) with ``W ≈ q * scale + min`` per group."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group_size, group_size)
    minimum = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - minimum) / 15).clamp(min=1e-12)
    q = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, minimum


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN then runs bf16 GEMMs natively (elsewhere bf16 is emulated, slower than fp32)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "avx512_bf16" in flags or "amx_bf16" in flags or torch.backends.cpu.get_cpu_capability() == "AVX512_AMX"


@dataclass(frozen=True)
class WeightFormat:
    """A resolved ``weight_dtype`` (never "auto"): builds the linear method of each layer."""

    name: str  # float32 | bfloat16 | int8 | int4 | gguf | q4_0 | q4_1 | q8_0 (float32: the activations' dtype, exact)
    params_dtype: torch.dtype  # the model's activation dtype

    def head_method(self, in_features: int, out_features: int) -> LinearMethod:
        """The output head's method: int8 where the body is int4 (see the module docs), Q8_0 where it is
        Q4_0 / Q4_1 (``block_quant``); gguf in the file's format."""
        if self.name == "gguf":
            return _gguf_method(self.params_dtype)
        if self.name == "int4":
            return Int8WeightOnlyMethod(self.params_dtype)
        if self.name in ("q4_0", "q4_1"):
            return BlockQuantizedMethod(self.params_dtype, "q8_0")
        return self.method(in_features, out_features)

    def method(self, in_features: int, out_features: int) -> LinearMethod:
        if self.name == "gguf":
            return _gguf_method(self.params_dtype)
        if self.name in BLOCK_FORMATS:
            return BlockQuantizedMethod(self.params_dtype, self.name)
        if self.name == "int4" and Int4WeightOnlyMethod.can_pack(in_features, out_features):
            return Int4WeightOnlyMethod(self.params_dtype)
        if self.name in ("int4", "int8"):
            return Int8WeightOnlyMethod(self.params_dtype)
        if self.name == "bfloat16":
            return DenseLinearMethod(self.params_dtype, torch.bfloat16)
        return DenseLinearMethod(self.params_dtype)


def resolve_weight_format(weight_dtype: str, params_dtype: torch.dtype, *, gguf_types: list[str] | None,
                          device: torch.device, whole_block_shards: bool = True) -> WeightFormat:
    """``auto`` -> the exact dense path for Hugging Face folders. For a quantized GGUF on a CPU:
    ``gguf`` (the file's own blocks through the Rust GEMV and the fused CPU decode) when every
    tensor is quantized in a type the kernel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
    IQ4_XS) or that ``gguf_convert`` turns into one (Q2_K and the other i-quant types -> Q8_0) and the CPU has a SIMD kernel; else, on a
    CPU with fast bf16, the nearest aten format (Q4_* -> int4, other quantized types -> int8).
    Why gguf first: on the embedded SmolLM2 (tests/test_quant.py, 24 prompts x 32 positions) it
    agrees with float32 on 97.3% of greedy choices against int4's 97.4%, with perplexity -0.07%
    against +0.27%, and decodes 1.9-2.8x faster at batch 1 (README, issue 30).
    ``bfloat16`` on a CPU without AVX512-BF16 / AMX stays float32. ``whole_block_shards``: whether this
    many tensor-parallel ranks split the file's row-parallel products on block boundaries
    (``gguf_linear.shards_hold_whole_blocks``); where not, ``auto`` does not pick ``gguf``.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype {weight_dtype!r} is not supported; allowed: {', '.join(WEIGHT_DTYPES)}")
    if weight_dtype != "auto":
        if weight_dtype in ("int8", "int4", "gguf", *BLOCK_FORMATS) and device.type != "cpu":
            raise ValueError(f"weight_dtype {weight_dtype!r} runs on the CPU only (device {device.type!r}); "
                             "use float32 or bfloat16 there")
        if weight_dtype == "bfloat16" and device.type == "cpu" and not cpu_has_fast_bf16():
            return WeightFormat("float32", params_dtype)  # emulated bf16 GEMMs are slower than float32 ones
        return WeightFormat(weight_dtype, params_dtype)
    if gguf_types is None or device.type != "cpu" or params_dtype != torch.float32:
        return WeightFormat("float32", params_dtype)
    if gguf_types and all(kernel_type(t) is not None for t in gguf_types) and cpu_runs_gguf_kernel() and whole_block_shards:
        return WeightFormat("gguf", params_dtype)
    if not cpu_has_fast_bf16():
        return WeightFormat("float32", params_dtype)
    return WeightFormat(nearest_format(gguf_types), params_dtype)


def _gguf_method(params_dtype: torch.dtype) -> LinearMethod:
    return GgufLinearMethod(params_dtype)


def nearest_format(gguf_types: list[str]) -> str:
    """The format closest to a GGUF file's linear weights (the most common type among them)."""
    if not gguf_types:
        return "float32"
    most = max(set(gguf_types), key=gguf_types.count)
    if most in ("F32", "F16", "BF16", "F64"):
        return "float32"
    return "int4" if most.startswith(("Q4", "IQ4", "Q3", "Q2", "IQ3", "IQ2", "IQ1")) else "int8"
