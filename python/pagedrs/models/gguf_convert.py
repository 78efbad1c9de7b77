"""GGUF types the Rust GEMV does not read, turned at load into blocks it does read.

Why: most GGUF files people download are llama.cpp's K-quants ("Q4_K_M": Q4_K for most
tensors, Q6_K for the output head and some value / down projections; "Q5_K_M", "Q6_K") or the
i-quant types. The kernel reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS
as they are; without a conversion any other type ran dequantized (float32 on a CPU without fast
bfloat16: 32 bits a weight streamed per token, against 4.5).

- **Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL and IQ4_XS run as they are** (the kernel's own formats: 4.625,
  5.625, 7, 5.5, 6, 4.5 and ~4.5 bits a weight streamed, the file's weights exactly). Before, Q4_K was
  converted to Q4_1 as below and the others requantized to Q8_0 (8.5 bits and a second rounding). Q5_0 and Q5_1 matter
  beyond 5-bit files: llama.cpp writes them for a K-quant tensor whose rows are not whole super-blocks
  of 256 (a small model's 576- or 896-wide layers in a "Q4_K_M" file).
- **Q4_K -> Q4_1, Q5_K -> Q5_1 and IQ4_XS -> IQ4_NL** where such a tensor cannot run as it is (a
  tensor-parallel shard that cuts its 256-column super-blocks), one block per sub-block of 32: the same
  codes, scale ``d * sc`` (IQ4_XS: ``d * (ls - 32)``) and minimum ``-dmin * m`` (each exact in float32: an
  f16 times a 6-bit integer) stored as f16, so each
  is rounded once, by at most 2^-11 of itself (half an f16 step; below 2^-14 the products stay on
  the subnormal grid and are exact). A Q4_K weight moves by at most ``15 * |d sc| * 2^-11 + |dmin m| *
  2^-11`` (a 4-bit step is ``|d sc|``: under 1% of one step; Q5_K's 31 codes: under 2%). 5 (6) bits a
  weight instead of 4.625 (5.625). Q6_K in such a shard is requantized to Q8_0.
- **Q3_K runs as it is** too (llama.cpp's Q3_K_S / Q3_K_M / Q3_K_L files; since 2026-12-07, before
  requantized to Q8_0); a tensor-parallel shard that cuts its super-blocks is requantized to Q8_0, as Q6_K's.
- **Every other quantized type gguf-py dequantizes** (Q2_K, the other IQ types, TQ, MXFP4) ->
  **Q8_0**: dequantized exactly (float32), then quantized again per block of 32 by the Q8_0 rule
  (``gguf.quants.quantize``: ``d = max|w| / 127`` stored as f16, codes rounded): a weight moves by at
  most half a Q8_0 step, ``max|w| / 254`` of its block, plus the f16 rounding of the step times its
  code (at most 127 x 2^-11 of a step). 8.5 bits a weight.
- Fused siblings (q/k/v, gate/up) of different types (Q4_K_M's Q4_K queries beside Q6_K values) run as
  one product of parts, each in its own format (``GgufMatrix.fused``, ``gguf_linear``); until 2026-12-07
  every such sibling went to Q8_0.

F32, F16 and BF16 tensors are not converted: their layers keep the dense product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# what the Rust kernel reads as they are
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# quantized types gguf-py dequantizes (gguf 0.19), requantized to Q8_0
REQUANTIZED_TYPES = (
    "Q2_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4",
)
QK = 32  # weights a block of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 covers (the kernel's step; its activations' blocks)
SUPER_BLOCK = {"Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256}  # a format whose scales span more columns: its rows are whole runs of these


def block_columns(kernel_format: str) -> int:
    """Columns one block of ``kernel_format`` (a KERNEL_TYPES name) spans: a slice of columns must start and
    end on a multiple of this (a tensor-parallel shard), and a row holds a whole number of them."""
    return SUPER_BLOCK.get(kernel_format, QK)


def kernel_type(type_name: str) -> str | None:
    """The block format a GGUF tensor of ``type_name`` runs in on the kernel; None: not on the kernel (dense)."""
    if type_name in KERNEL_TYPES:
        return type_name
    if type_name in REQUANTIZED_TYPES:
        return "Q8_0"
    return None


def common_type(type_names: Sequence[str]) -> str | None:
    """The one format fused siblings of these GGUF types run in: their shared target, Q8_0 where the
    targets differ, None when any is not on the kernel."""
    targets = {kernel_type(t) for t in type_names}
    if None in targets or not targets:
        return None
    return targets.pop() if len(targets) == 1 else "Q8_0"


def narrower(kernel_format: str) -> str:
    """The format a tensor of ``kernel_format`` runs in where its columns are cut inside a super-block (a
    tensor-parallel shard of 32-column multiples): Q4_K as Q4_1, Q5_K as Q5_1 and IQ4_XS as IQ4_NL (their
    sub-blocks' scales rounded to f16), Q3_K and Q6_K as Q8_0 (requantized); any other format is already per block of 32."""
    return {"Q4_K": "Q4_1", "Q5_K": "Q5_1", "IQ4_XS": "IQ4_NL", "Q3_K": "Q8_0", "Q6_K": "Q8_0"}.get(kernel_format, kernel_format)


def to_kernel(blocks: np.ndarray, cols: int, type_name: str, target: str, name: str) -> np.ndarray:
    """A GGUF tensor's raw blocks (uint8 ``[rows, bytes per row]``) in the kernel format ``target``
    (``kernel_type(type_name)``, ``narrower(...)`` of it, or Q8_0 for any tensor on the kernel): uint8
    ``[rows, cols / block_columns(target) * block bytes]``. Non-finite scales or weights are refused naming
    ``name`` (Q4_K's and Q6_K's as they are by the kernel's packing)."""
    if type_name == target:
        return blocks
    if (type_name, target) in (("Q4_K", "Q4_1"), ("Q5_K", "Q5_1")):
        return k_quant_to_block_of_32(blocks, cols, type_name, name)
    if (type_name, target) == ("IQ4_XS", "IQ4_NL"):
        return iq4_xs_to_iq4_nl(blocks, cols, name)
    if target != "Q8_0" or kernel_type(type_name) is None:
        raise ValueError(f"GGUF tensor {name!r}: no conversion from {type_name} to {target}")
    return requantize_q8_0(blocks, cols, type_name, name)


def _super_blocks(blocks: np.ndarray, cols: int, type_name: str, name: str) -> np.ndarray:
    """A tensor's raw blocks (uint8 ``[rows, bytes per row]``) as ``[super-blocks, bytes]`` of ``type_name``,
    refused naming ``name`` when the row's bytes are not its ``cols`` in that type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    weights_per, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if cols % weights_per or blocks.shape[1] != cols // weights_per * size:
        raise ValueError(f"GGUF tensor {name!r} ({type_name}): {blocks.shape[1]} bytes a row for {cols} columns; "
                         f"{type_name} needs {size} bytes per {weights_per} columns")
    return np.ascontiguousarray(blocks).reshape(-1, size)


def _refuse_unscalable(bad: np.ndarray, cols: int, type_name: str, name: str, scales: Callable[[int], str]) -> None:
    """A ValueError naming the first super-block in ``bad`` (one flag each, rows of ``cols / 256``), its row
    and ``scales(i)`` (its f16 scales), when a sub-block's scale is not finite as float16."""
    if bad.any():
        i, per_row = int(np.argmax(bad)), cols // 256
        raise ValueError(f"GGUF tensor {name!r} ({type_name}): row {i // per_row}, super-block {i % per_row} "
                         f"has a scale that is not finite as float16 ({scales(i)})")


def k_quant_to_block_of_32(blocks: np.ndarray, cols: int, type_name: str, name: str) -> np.ndarray:
    """Q4_K (Q5_K) super-blocks (256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, Q5_K's 32
    bytes of fifth bits, 128 bytes of low nibbles) -> 8 Q4_1 (Q5_1) blocks each (see the module docs)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import Q4_K

    target = {"Q4_K": "Q4_1", "Q5_K": "Q5_1"}[type_name]
    out_size = GGML_QUANT_SIZES[GGMLQuantizationType[target]][1]
    rows, sb = blocks.shape[0], _super_blocks(blocks, cols, type_name, name)
    size = sb.shape[1]
    d = sb[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(sb[:, 4:16].copy())  # [n, 8] each, 0..63 (Q5_K packs them as Q4_K does)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = (d * sc.astype(np.float32)).astype(np.float16)  # exact in float32, rounded once to f16
        minimum = (-(dmin * mn.astype(np.float32))).astype(np.float16)
    bad = ~(np.isfinite(scale) & np.isfinite(minimum)).all(axis=1) | ~np.isfinite(d[:, 0]) | ~np.isfinite(dmin[:, 0])
    _refuse_unscalable(bad, cols, type_name, name, lambda i: f"d {float(d[i, 0])}, dmin {float(dmin[i, 0])}")
    # low nibbles: 4 chunks of 32 bytes, the low nibbles sub-block 2c, the high ones 2c + 1
    qs = sb[:, size - 128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(-1, 8, 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # byte t = element t (low), element t + 16 (high)
    parts = [scale.view(np.uint8).reshape(-1, 8, 2), minimum.view(np.uint8).reshape(-1, 8, 2)]
    if type_name == "Q5_K":  # bit s of qh[l]: sub-block s's element l's fifth bit -> Q5_1's u32, bit l
        qh = sb[:, 16:48]  # [n, 32]
        bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
        word = (bits.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
        parts.append(word.astype("<u4").view(np.uint8).reshape(-1, 8, 4))
    out = np.concatenate([*parts, packed], axis=-1)
    return np.ascontiguousarray(out.reshape(rows, cols // QK * out_size))


def iq4_xs_to_iq4_nl(blocks: np.ndarray, cols: int, name: str) -> np.ndarray:
    """IQ4_XS super-blocks (256 weights: f16 d, u16 scales_h, scales_l[4], qs[128]) -> 8 IQ4_NL blocks each
    (f16 d, qs[16]): the same codes, the sub-block's scale ``d * (ls - 32)`` (exact in float32: an f16 times an
    integer in -32..31) stored as f16, rounded once (at most 2^-11 of itself)."""
    rows, sb = blocks.shape[0], _super_blocks(blocks, cols, "IQ4_XS", name)
    d = sb[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    high = sb[:, 2:4].copy().view("<u2").astype(np.int32)  # [n, 1]
    ib = np.arange(8)
    low = (sb[:, 4 + ib // 2].astype(np.int32) >> (4 * (ib % 2))) & 0xF  # [n, 8]
    ls = low | (((high >> (2 * ib)) & 3) << 4)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = (d * (ls - 32).astype(np.float32)).astype(np.float16)  # [n, 8]
    bad = ~np.isfinite(scale).all(axis=1) | ~np.isfinite(d[:, 0])
    _refuse_unscalable(bad, cols, "IQ4_XS", name, lambda i: f"d {float(d[i, 0])}")
    qs = sb[:, 8:].reshape(-1, 8, 16)  # sub-block ib's 16 bytes, IQ4_NL's own layout
    out = np.concatenate([scale.view(np.uint8).reshape(-1, 8, 2), qs], axis=-1)
    return np.ascontiguousarray(out.reshape(rows, cols // QK * 18))


def requantize_q8_0(blocks: np.ndarray, cols: int, type_name: str, name: str) -> np.ndarray:
    """Any tensor gguf-py dequantizes, dequantized exactly and quantized again to Q8_0."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    with np.errstate(over="ignore", invalid="ignore"):
        weights = np.asarray(dequantize(np.ascontiguousarray(blocks), qtype), dtype=np.float32).reshape(blocks.shape[0], -1)
    if weights.shape[1] != cols:
        raise ValueError(f"GGUF tensor {name!r} ({type_name}): {weights.shape[1]} weights a row, not {cols}")
    finite = np.isfinite(weights).all(axis=1)
    if not finite.all():
        raise ValueError(f"GGUF tensor {name!r} ({type_name}): row {int(np.argmin(finite))} has a weight that is not "
                         "finite (a NaN or infinite scale)")
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(quantize(weights, GGMLQuantizationType.Q8_0))
    row = first_unscalable_row(out, "Q8_0")
    if row is not None:
        raise ValueError(f"GGUF tensor {name!r} ({type_name}): row {row} has weights up to "
                         f"{float(np.abs(weights[row]).max()):.6g}, past what Q8_0's f16 scale holds (127 x 65504)")
    return out


def first_unscalable_row(blocks: np.ndarray, block_type: str) -> int | None:
    """The first row of ``blocks`` (uint8 ``[rows, bytes per row]`` of a KERNEL_TYPES format) holding a
    scale or minimum that is not a finite f16 (a weight too large for the format's f16 scale); None if none.
    Each block starts with its f16 scale ``d``, and Q4_1's and Q5_1's with its minimum ``m`` after it."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType[block_type]][1]
    scales = np.ascontiguousarray(blocks.reshape(-1, size)[:, :4 if block_type in ("Q4_1", "Q5_1") else 2]).view(np.float16)
    fits = np.isfinite(scales).all(axis=1).reshape(blocks.shape[0], -1).all(axis=1)
    return None if fits.all() else int(np.argmin(fits))
