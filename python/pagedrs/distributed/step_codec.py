"""A StepInput as one contiguous byte buffer, for broadcasting a step to tensor-parallel ranks.

Rank 0 plans each step once (one Rust scheduler); every rank needs the same plan. Sending
it as pickled Python objects would cost an allocation per field and run pickle's
interpreter every step; instead the NumPy arrays are laid out back to back after a small
fixed header of (dtype, ndim, shape) per array, and the transfers' ids and tier names are
a few integers more. One ``broadcast`` of the length and one of the bytes moves a step.

Layout (all little-endian)::

    u32 magic | u32 version | u32 num_arrays | u32 num_transfers
    per transfer: u64 id | u8 src tier | u8 dst tier | u16 pad | u32 index of its pairs array
    per array:    u8 dtype code | u8 ndim | u16 pad | u64 shape[0..ndim] | u64 byte offset
    payload:      the arrays' bytes, each 8-byte aligned
"""

from __future__ import annotations

import struct
from dataclasses import fields
from typing import Any

import numpy as np

from pagedrs.step_input import TIERS, StepInput, Transfer

MAGIC = 0x50525354  # "PRST"
VERSION = 1
_DTYPES = [np.dtype(t) for t in ("int64", "int32", "uint64", "bool", "uint32")]
_ARRAY_FIELDS = [f.name for f in fields(StepInput) if f.name != "transfers"]
_HEADER = struct.Struct("<IIII")
_TRANSFER = struct.Struct("<QBBHI")
_ARRAY = struct.Struct("<BBH")


def encode(step: StepInput) -> bytes:
    arrays = [np.ascontiguousarray(getattr(step, name)) for name in _ARRAY_FIELDS]
    arrays += [np.ascontiguousarray(t.pairs, dtype=np.int64) for t in step.transfers]
    head = bytearray(_HEADER.pack(MAGIC, VERSION, len(arrays), len(step.transfers)))
    for i, t in enumerate(step.transfers):
        head += _TRANSFER.pack(t.id, TIERS.index(t.src), TIERS.index(t.dst), 0, len(_ARRAY_FIELDS) + i)
    meta_size = sum(_ARRAY.size + 8 * (a.ndim + 1) for a in arrays)
    offset = _align(len(head) + meta_size)
    payload = []
    for a in arrays:
        if a.dtype not in _DTYPES:
            raise TypeError(f"step_codec: array of dtype {a.dtype} cannot be encoded; allowed {[str(d) for d in _DTYPES]}")
        head += _ARRAY.pack(_DTYPES.index(a.dtype), a.ndim, 0)
        head += struct.pack(f"<{a.ndim}Q", *a.shape) + struct.pack("<Q", offset)
        payload.append((offset, a))
        offset = _align(offset + a.nbytes)
    out = bytearray(offset)
    out[: len(head)] = head
    for start, a in payload:
        out[start : start + a.nbytes] = a.tobytes()
    return bytes(out)


def decode(buf: Any) -> StepInput:
    """The StepInput ``encode`` wrote; arrays are copies (the buffer may be reused)."""
    view = memoryview(buf).cast("B")
    magic, version, num_arrays, num_transfers = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"step_codec: not a step buffer (magic {magic:#x}, version {version}; want {MAGIC:#x}, {VERSION})")
    pos = _HEADER.size
    transfers = []
    for _ in range(num_transfers):
        transfers.append(_TRANSFER.unpack_from(view, pos))
        pos += _TRANSFER.size
    arrays = []
    for _ in range(num_arrays):
        code, ndim, _pad = _ARRAY.unpack_from(view, pos)
        pos += _ARRAY.size
        shape = struct.unpack_from(f"<{ndim}Q", view, pos)
        pos += 8 * ndim
        (offset,) = struct.unpack_from("<Q", view, pos)
        pos += 8
        dtype = _DTYPES[code]
        count = int(np.prod(shape)) if ndim else 1
        arrays.append(np.frombuffer(view, dtype=dtype, count=count, offset=offset).reshape(shape).copy())
    values: dict[str, Any] = dict(zip(_ARRAY_FIELDS, arrays[: len(_ARRAY_FIELDS)]))
    values["step_id"] = int(values["step_id"].reshape(-1)[0])  # a scalar, carried as a 1-element array
    values["transfers"] = tuple(
        Transfer(int(tid), TIERS[src], TIERS[dst], arrays[index]) for tid, src, dst, _pad, index in transfers
    )
    return StepInput(**values)


def _align(n: int) -> int:
    return (n + 7) & ~7
