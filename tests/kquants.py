"""Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS quantizers for tests (gguf-py dequantizes K-quants but cannot write them).

Plain round-to-nearest choices, not llama.cpp's search for the best scales: what matters here is
that the bytes are valid blocks of each layout, which ``tests/test_gguf_convert.py`` checks
through gguf-py's own dequantization.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _k_with_min(w: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's (``top`` 15) or Q5_K's (31) choices for float32 ``w``: (f16 d, f16 dmin, the 12 bytes of packed
    6-bit scales and minima per super-block, the codes ``[n, 8 sub-blocks, 32]`` in 0..top)."""
    sub = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # the code 0 means -dmin * m <= 0
    scale = (sub.max(axis=-1) - lo) / top
    d = _f16(np.maximum(scale.max(axis=-1), 1e-8) / 63)
    dmin = _f16(np.maximum((-lo).max(axis=-1), 1e-8) / 63)
    sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32)[:, None] * sc, 1e-12)[..., None]
    q = np.clip(np.round((sub + (dmin.astype(np.float32)[:, None] * m)[..., None]) / step), 0, top).astype(np.uint8)
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=-1)
    return d, dmin, scales, q


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, cols]`` (cols a multiple of 256) -> uint8 ``[rows, cols / 256 * 144]``."""
    rows, cols = w.shape
    d, dmin, scales, q = _k_with_min(w, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=-1)
    return out.reshape(rows, cols // QK_K * 144)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, cols]`` (cols a multiple of 256) -> uint8 ``[rows, cols / 256 * 176]``: f16 d, f16
    dmin, Q4_K's 12 bytes of 6-bit scales and minima, ``qh[32]`` (bit ``2c`` of byte ``l``: the fifth bit of
    element ``64c + l``, bit ``2c + 1``: of element ``64c + 32 + l``), ``qs[128]`` (Q4_K's low nibbles)."""
    rows, cols = w.shape
    d, dmin, scales, q = _k_with_min(w, 31)
    low, high = q & 0x0F, (q >> 4).astype(np.uint8)  # [n, 8 sub-blocks, 32]
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh, qs], axis=-1)
    return out.reshape(rows, cols // QK_K * 176)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, cols]`` (cols a multiple of 256) -> uint8 ``[rows, cols / 256 * 210]``."""
    rows, cols = w.shape
    blocks = w.astype(np.float32).reshape(-1, QK_K)
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _f16(np.maximum(scale.max(axis=-1), 1e-8) / 127)
    sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    step = np.where(step == 0, 1.0, step)[..., None]
    q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [n, half, element]
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)  # byte 64h + t: elements 128h + t, 128h + 64 + t
    qh = high.reshape(-1, 2, 4, 32)  # bits 2s of byte 32h + t: element 128h + 32s + t
    qh = (qh[:, :, 0] | (qh[:, :, 1] << 2) | (qh[:, :, 2] << 4) | (qh[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=-1)
    return out.reshape(rows, cols // QK_K * 210)


KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, cols]`` (cols a multiple of 256) -> uint8 ``[rows, cols / 256 * 136]``: f16 d, u16
    scales_h (bits 2i..2i+1: sub-block i's scale's high bits), scales_l[4] (nibble i % 2 of byte i / 2: its low
    bits), qs[128] (sub-block i's 16 bytes: element j low, j + 16 high); weight = d (ls - 32) kvalues[code]."""
    rows, cols = w.shape
    sub = w.astype(np.float32).reshape(-1, 8, 32)
    want = np.abs(sub).max(axis=-1) / 127  # each sub-block's ideal scale (>= 0)
    d = _f16(np.maximum(want.max(axis=-1), 1e-8) / 31)
    ls = np.clip(np.round(want / d.astype(np.float32)[:, None]) + 32, 0, 63).astype(np.int32)  # [n, 8]
    scale = (d.astype(np.float32)[:, None] * (ls - 32))[..., None]
    scale = np.where(scale == 0, 1.0, scale)
    codes = np.abs(sub[..., None] / scale[..., None] - KVALUES_IQ4NL).argmin(axis=-1).astype(np.uint8)  # [n, 8, 32]
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(-1, 128)
    high = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1).astype("<u2")
    low = (ls & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), scales_l, qs], axis=-1)
    return out.reshape(rows, cols // QK_K * 136)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, cols]`` (cols a multiple of 256) -> uint8 ``[rows, cols / 256 * 110]``: per sub-block of
    16 a step ``max|w| / 4`` (codes -4..3), as ``d * (sc - 32)`` with ``sc - 32`` in 0..31 and ``d`` an f16 per
    super-block. Bytes: hmask[32] (the codes' third bit), qs[64] (their low 2 bits), scales[12] (16 six-bit
    values: low nibbles in bytes 0..7, high bit pairs in 8..11), d."""
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 4
    d = _f16(np.maximum(step.max(axis=-1), 1e-8) / 31)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 0, 31).astype(np.int64) + 32  # sc - 32 in 0..31
    scale = np.maximum(d.astype(np.float32)[:, None] * (sc - 32), 1e-12)[..., None]
    q = (np.clip(np.round(sub / scale), -4, 3).astype(np.int64) + 4).reshape(-1, QK_K)  # q + 4 in 0..7
    i = np.arange(QK_K)
    low, high = q & 3, q >> 2
    qs = np.zeros((q.shape[0], 64), dtype=np.int64)
    hmask = np.zeros((q.shape[0], 32), dtype=np.int64)
    np.add.at(qs, (slice(None), (i // 128) * 32 + i % 32), low << (2 * ((i % 128) // 32)))
    np.add.at(hmask, (slice(None), i % 32), high << (i // 32))
    j = np.arange(16)
    scales = np.zeros((q.shape[0], 12), dtype=np.int64)
    np.add.at(scales, (slice(None), j % 8), (sc & 0x0F) << (4 * (j // 8)))
    np.add.at(scales, (slice(None), 8 + j % 4), (sc >> 4) << (2 * (j // 4)))
    out = np.concatenate([hmask, qs, scales], axis=-1).astype(np.uint8)
    return np.concatenate([out, d.reshape(-1, 1).view(np.uint8)], axis=-1).reshape(rows, -1)
