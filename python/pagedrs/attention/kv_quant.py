"""The fp8 KV cache: its storage dtypes, its per-tensor scales, and the one quantize rule.

``EngineArgs.kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"`` stores every page in 8 bits
(``torch.float8_e4m3fn`` / ``torch.float8_e5m2``; ``"auto"`` stores the model dtype). A value
``x`` is stored as ``x / scale``, rounded to nearest even and saturated to the format's largest
finite value (vLLM's ``__NV_SATFINITE``: an outlier is clamped, never made NaN or inf), and read
back as ``stored * scale``. The torch backend, the CUDA kernels (cuda/dtype.cuh) and the
emulator agree on these bits, so a page written by one is read right by the other.

Scales: one K scale and one V scale (float32 tensors of one element on the cache's device:
the kernels read them through pointers), 1.0 unless given — vLLM's default for a checkpoint
without calibrated scales. On SmolLM2, per-layer scales calibrated from a prefill (amax / 448,
and vLLM's ``calculate_kv_scales``: amax / 200 for K, / 100 for V) did not do consistently better
(benches/fp8_kv_scales.py; the README's fp8 section). Unit scales also make a page mean the same
in every process, so the disk tier can keep fp8 pages across restarts (its geometry records the
kv dtype and the scale rule).
"""

from __future__ import annotations

import torch

# EngineArgs.kv_cache_dtype -> the storage dtype (None: the model dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
# How a store's pages were scaled (the disk tier's geometry): a store of other scales is refused.
SCALE_RULE = "unit"

KvScales = tuple[torch.Tensor, torch.Tensor]  # (k_scale, v_scale): float32 [1] each


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype pages are stored in; ValueError naming the field and the allowed values."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype is {kv_cache_dtype!r}; allowed: {', '.join(repr(k) for k in KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def unit_scales(device: torch.device) -> KvScales:
    """(1.0, 1.0) on ``device``, made once per device (a launch must not allocate)."""
    device = torch.device(device)
    scales = _UNIT.get(device)
    if scales is None:
        scales = _UNIT[device] = (torch.ones(1, dtype=torch.float32, device=device),
                                  torch.ones(1, dtype=torch.float32, device=device))  # fmt: skip
    return scales


_UNIT: dict[torch.device, KvScales] = {}


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, saturated, rounded to nearest even into ``dtype`` (the kernels' rule)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored * scale`` in ``dtype`` (exact for unit scales: every fp8 value is a 16-bit value)."""
    return stored.to(dtype).mul_(scale)
