"""The token lookup kept in a GGUF file's blocks (``weight_dtype="gguf"``), rows dequantized as they are looked up.

Why: a block-format load made every product a matrix of the file's blocks, but the lookup table
was still dequantized to float32 whole: 4 bytes a weight for the largest tensor of a small model
(SmolLM2: 113 MB of a 94 MB file) and 2.1 GB for Llama 3's 128k x 4096 table, against 0.56 GB in
Q8_0. A step looks up one row per token: a batch-1 step's lookup costs 11 us in Q8_0 (against 1 us
from a float32 table; 0.2% of SmolLM2's step) and ~37 us in Q6_K (a tied K-quant head's table; gguf-py's
generic call took 80-93 us, most of it fixed cost per call).

A tied head's table (``BlockEmbedding.of_head``) is read from the head's own tiles instead of a copy of
its blocks (``GgufMatrix.dequantize_rows``, ``rust/src/gemv/rows.rs``), in the formats llama.cpp writes
such a table in (Q8_0, Q6_K): the bytes are held once (SmolLM2's 28 MB; ~0.56 GB of Llama 3's Q8_0
table), and a lookup costs a Rust call (the same floats: the tiles hold the file's scales and codes).

Exactness: a row is dequantized by the function a dense load dequantizes the whole table with
(gguf-py's ``dequantize``); Q8_0 and Q6_K, the common embedding types, by the same float32 products
in fewer NumPy calls, checked equal to it bit for bit, so the lookup returns the floats the float32
table held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pagedrs.models.gguf_convert import QK

if TYPE_CHECKING:
    from pagedrs._core import GgufMatrix

_Q8_0_BYTES = 2 + QK  # an f16 scale, then 32 int8 codes


class BlockEmbedding(nn.Module):
    """``[num_embeddings, embedding_dim]`` in the GGUF type ``qtype``'s blocks (uint8 ``[rows, bytes per row]``)."""

    def __init__(self, blocks: np.ndarray, qtype: str, embedding_dim: int, dtype: torch.dtype,
                 name: str = "token_embd.weight") -> None:
        super().__init__()
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        if blocks.ndim != 2 or blocks.dtype != np.uint8 or embedding_dim % per_block or \
                blocks.shape[1] != embedding_dim // per_block * size:
            raise ValueError(f"embedding blocks of shape {blocks.shape} ({blocks.dtype}) are not {qtype} rows of "
                             f"{embedding_dim} weights ({embedding_dim // per_block * size} bytes a row)")
        self.blocks: np.ndarray | None = np.array(blocks, dtype=np.uint8, order="C", copy=True)  # not a view of the mapped file
        self.head: GgufMatrix | None = None  # of_head: the rows are read from the head's tiles instead
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.dtype = dtype
        self._dequantize = _LEAN_ROWS.get(qtype) or _gguf_rows(GGMLQuantizationType[qtype])
        self._check_scales(size, name)

    def _check_scales(self, block_bytes: int, name: str) -> None:
        """Refuse a table with a NaN or infinite f16 scale (or minimum) in any block, naming the tensor, the
        row (token) and the block: a lookup dequantizes rows only as tokens come, so a bad block would
        otherwise load and later give NaN rows (or be blamed on the first product they reach). The f16
        fields of the common types are read where they lie (one f16 a block: milliseconds for a large
        table); another type's rows are dequantized in runs and checked."""
        assert self.blocks is not None
        rows = self.blocks.shape[0]
        fields = _F16_FIELDS.get(self.qtype)
        if fields is None:
            step = max(1, (1 << 22) // self.embedding_dim)
            for first in range(0, rows, step):
                values = self._dequantize(self.blocks[first:first + step]).reshape(-1, self.embedding_dim)
                bad = np.argwhere(~np.isfinite(values))
                if bad.size:
                    row, col = first + int(bad[0][0]), int(bad[0][1])
                    raise ValueError(f"GGUF tensor {name!r}: row {row} (token {row}) holds {float(values[tuple(bad[0])])} "
                                     f"at column {col}; a model needs finite weights (the file is corrupt)")
            return
        blocks = self.blocks.reshape(rows, -1, block_bytes)
        for field, offset in fields:
            bits = np.ascontiguousarray(blocks[:, :, offset:offset + 2]).view(np.uint16)[..., 0]
            bad = np.argwhere((bits & 0x7C00) == 0x7C00)  # an f16 with every exponent bit set: inf or NaN
            if bad.size:
                row, block = int(bad[0][0]), int(bad[0][1])
                value = float(np.array(bits[row, block], dtype=np.uint16).view(np.float16))
                raise ValueError(f"GGUF tensor {name!r}: {self.qtype} {field} of row {row} (token {row}), block {block} is "
                                 f"{value} (f16 bits {int(bits[row, block]):#06x}); a model needs finite scales (the "
                                 "file is corrupt)")

    @staticmethod
    def head_serves(head: GgufMatrix, qtype: str) -> bool:
        """Whether ``head``, packed from a token table of GGUF type ``qtype``, gives that table's rows: one
        part, in that type, one ``dequantize_rows`` reads (Q8_0, Q6_K)."""
        return bool(head.reads_rows) and head.format == qtype.lower()

    @classmethod
    def of_head(cls, head: GgufMatrix, qtype: str, dtype: torch.dtype) -> BlockEmbedding:
        """The lookup of a tied head's table read from the head's matrix (packed from the same blocks of
        GGUF type ``qtype``: ``head_serves``): no copy."""
        if not cls.head_serves(head, qtype):
            raise ValueError(f"the head {head.name!r} ({head.format}) cannot serve a {qtype} token table's rows; "
                             f"a q8_0 or q6_k head packed from that table can")
        table = cls.__new__(cls)
        nn.Module.__init__(table)
        table.blocks, table.head, table.qtype = None, head, qtype
        table.num_embeddings, table.embedding_dim, table.dtype = head.rows, head.cols, dtype
        return table

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[len(ids), embedding_dim]``; a token outside the vocabulary is refused by name."""
        ids = np.asarray(ids).reshape(-1)
        if not ids.size:
            return np.empty((0, self.embedding_dim), dtype=np.float32)
        if ids.dtype.kind not in "iu":  # (a float id would be truncated to a row)
            raise TypeError(f"input_ids: token ids must be integers, got {ids.dtype}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.num_embeddings:
            raise ValueError(f"input_ids: token {lo if lo < 0 else hi} is outside the vocabulary; allowed 0 to "
                             f"{self.num_embeddings - 1}")
        if self.head is not None:
            return self.head.dequantize_rows(ids.astype(np.int64, copy=False))
        assert self.blocks is not None
        return self._dequantize(self.blocks.take(ids, axis=0)).reshape(ids.size, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(self.rows(ids.detach().cpu().numpy())).view(*ids.shape, self.embedding_dim)
        return out if self.dtype is torch.float32 else out.to(self.dtype)

    def weight_bytes(self) -> int:
        """Bytes this lookup holds of its own: 0 when it reads the head's (``of_head``)."""
        return 0 if self.blocks is None else int(self.blocks.nbytes)

    def extra_repr(self) -> str:
        where = f", the head's tiles ({self.head.name})" if self.head is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.qtype}{where}"


def _q8_0_rows(rows: np.ndarray) -> np.ndarray:
    """gguf-py's Q8_0 dequantization (``codes * scale`` in float32) without its generic reshaping."""
    blocks = rows.reshape(rows.shape[0], -1, _Q8_0_BYTES)
    scale = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).astype(np.float32)
    return np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).astype(np.float32) * scale


_Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, an f16 d; 256 weights
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_PAIR_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _q6_k_rows(rows: np.ndarray) -> np.ndarray:
    """gguf-py's Q6_K dequantization (``(d * scale) * (q - 32)`` in float32, per 16 weights) in fewer calls:
    in each half of a super-block, weight ``l`` takes its low 4 bits from nibble ``l`` (the low nibbles of
    64 bytes, then their high nibbles) and its top 2 bits from bit pair ``l // 32`` of byte ``l % 32``."""
    b = rows.reshape(-1, _Q6_K_BYTES)
    n = b.shape[0]
    scale = np.ascontiguousarray(b[:, 208:210]).view(np.float16).astype(np.float32) * b[:, 192:208].view(np.int8)
    low = (b[:, :128].reshape(n, 2, 1, 64) >> _NIBBLE_SHIFTS) & np.uint8(15)  # [super-block, half, low/high, 64]
    top = (b[:, 128:192].reshape(n, 2, 1, 32) >> _PAIR_SHIFTS) & np.uint8(3)  # [super-block, half, pair, 32]
    q = (low.reshape(n, 16, 16) | (top.reshape(n, 16, 16) << np.uint8(4))).view(np.int8) - np.int8(32)
    return (scale[:, :, None] * q).reshape(rows.shape[0], -1)


_LEAN_ROWS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Q8_0": _q8_0_rows, "Q6_K": _q6_k_rows}
# each block's f16 fields (name, byte offset) per GGUF type, as ggml lays its blocks out: when they are all
# finite, so is every weight the block dequantizes to (codes and sub-block scales are small integers)
_F16_FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    "Q4_0": (("d", 0),), "Q4_1": (("d", 0), ("m", 2)), "Q5_0": (("d", 0),), "Q5_1": (("d", 0), ("m", 2)),
    "Q8_0": (("d", 0),), "IQ4_NL": (("d", 0),), "IQ4_XS": (("d", 0),), "Q2_K": (("d", 80), ("dmin", 82)),
    "Q3_K": (("d", 108),), "Q4_K": (("d", 0), ("dmin", 2)), "Q5_K": (("d", 0), ("dmin", 2)), "Q6_K": (("d", 208),),
}


def _gguf_rows(qtype: object) -> Callable[[np.ndarray], np.ndarray]:
    from gguf.quants import dequantize

    return lambda rows: np.asarray(dequantize(rows, qtype), dtype=np.float32)  # type: ignore[arg-type]


def lookup(embedding: nn.Embedding | BlockEmbedding) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids -> rows`` for the model's forward: ``F.embedding`` over a dense table, else the blocks' rows."""
    if isinstance(embedding, BlockEmbedding):
        return embedding.forward
    weight = embedding.weight
    return lambda ids: torch.nn.functional.embedding(ids, weight)


def numpy_rows(embedding: nn.Embedding | BlockEmbedding) -> Callable[[np.ndarray], np.ndarray] | None:
    """``ids -> float32 rows`` in NumPy for the fused CPU decode (no torch op), None for a table that is not
    float32 on the CPU. A dense table's lookup does not check the ids (the caller does)."""
    if isinstance(embedding, BlockEmbedding):
        return embedding.rows
    weight = embedding.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    table = weight.detach().numpy()
    return lambda ids: table.take(ids, axis=0)
