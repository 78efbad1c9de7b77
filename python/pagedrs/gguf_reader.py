"""gguf-py's ``GGUFReader``, with the file's header parsed from memory instead of through its memory map.

Why: a GGUF's header holds the tokenizer (SmolLM2's 49,152 tokens and 48,900 merges; Llama 3's 128,256
and ~280,000), and gguf-py makes a few NumPy views per string, each a slice of the ``np.memmap`` of the
whole file; a memmap slice costs several times a plain array's (``memmap.__getitem__`` and
``__array_finalize__`` were most of a first load's profile). A first load parses the header twice (our
index and config, then transformers' tokenizer conversion), ~3.5 s each for SmolLM2's vocabulary here.
Reading the header's bytes into memory and slicing those gives the same fields (the same parts, values,
types and offsets) in ~40% of the time; the tensors' data stay views of the memory map, as before (tested
field by field and tensor by tensor against ``gguf.GGUFReader``).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader


class HeaderInMemoryReader(GGUFReader):
    """``GGUFReader`` whose metadata and tensor infos are read from an in-memory copy of the header."""

    _FIRST_READ = 1 << 20  # bytes read first; doubled (or more) whenever the parse goes past them

    def __init__(self, path: os.PathLike[str] | str, mode: Literal["r", "r+", "c"] = "r") -> None:
        self._path = os.fspath(path)
        self._size = os.path.getsize(self._path)
        self._head = np.empty(0, dtype=np.uint8)
        self._in_header = True  # until the tensors' data are reached: those come from the memory map
        super().__init__(path, mode)

    def _grow(self, end: int) -> None:
        want = min(self._size, max(end, 2 * len(self._head), self._FIRST_READ))
        with open(self._path, "rb") as f:
            self._head = np.frombuffer(f.read(want), dtype=np.uint8)

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> Any:
        if not self._in_header:
            return super()._get(offset, dtype, count, override_order)
        count = int(count)
        end = offset + int(np.dtype(dtype).itemsize) * count
        if len(self._head) < min(end, self._size):
            self._grow(end)
        # what the base class does, on the in-memory copy (a short read past the file's end gives the
        # same short array, so a truncated file fails as it would)
        arr = self._head[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: Any) -> None:
        self._in_header = False
        # before gguf-py slices (and reshapes) any tensor's data: its errors name no tensor, and it adds
        # each offset to the data's start in uint64, so a huge offset wraps to bytes before the data
        check_tensor_infos(tensor_infos(fields), int(start_offs), int(self.alignment), self._size)
        super()._build_tensors(start_offs, fields)


class TensorInfoError(ValueError):
    """A tensor's entry in a GGUF header that no loader may read from (``check_tensor_infos``)."""


class TensorPastEnd(TensorInfoError):
    """A tensor whose bytes lie (partly) past the file's end: a truncated file, or a corrupt offset or shape."""


def tensor_infos(fields: Any) -> list[tuple[str, list[int], int, int]]:
    """(name, GGUF dims (innermost first), raw type, offset in the data region) of gguf-py's tensor-info
    fields, as Python ints."""
    infos = []
    for field in fields:
        _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
        infos.append((bytes(name_data).decode("utf-8", "replace"), [int(d) for d in dims], int(raw_dtype[0]),
                      int(offset[0])))
    return infos


MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


def check_tensor_infos(infos: list[tuple[str, list[int], int, int]], data_start: int, alignment: int,
                       file_size: int) -> None:
    """Refuse, naming the tensor, any tensor entry whose bytes cannot be this tensor's alone: an unknown
    type, no or too many dimensions, a zero dimension, rows that are not whole blocks of its type, an
    offset that is not a multiple of the file's alignment, bytes past the file's end, or bytes that
    another tensor's overlap (``TensorInfoError``). In Python ints: nothing wraps."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    spans: list[tuple[int, int, str]] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise TensorInfoError(f"tensor {name!r} appears twice in the header")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise TensorInfoError(f"tensor {name!r} has type {raw_type}, which is no GGML type gguf-py "
                                  "knows") from None
        shape = tuple(reversed(dims))  # row-major, as the loader names shapes
        if not 1 <= len(dims) <= MAX_DIMS:
            raise TensorInfoError(f"tensor {name!r} has {len(dims)} dimensions; 1 to {MAX_DIMS} are allowed")
        if any(d < 1 for d in dims):
            raise TensorInfoError(f"tensor {name!r} has shape {shape}; every dimension must be at least 1")
        if dims[0] % block:
            raise TensorInfoError(f"tensor {name!r} of shape {shape}: its rows of {dims[0]} values are not whole "
                                  f"{qtype.name} blocks ({block} values each)")
        if offset % alignment:
            raise TensorInfoError(f"tensor {name!r} starts at data offset {offset}, not a multiple of the file's "
                                  f"alignment {alignment} (general.alignment)")
        start = data_start + offset
        end = start + math.prod(dims) // block * type_size
        if end > file_size:
            raise TensorPastEnd(f"tensor {name!r} ({qtype.name}, shape {shape}) needs bytes {start}..{end}, "
                                f"the file has {file_size}")
        spans.append((start, end, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise TensorInfoError(f"tensors {first!r} and {second!r} overlap: {second!r} starts at byte {start}, "
                                  f"before {first!r} ends at byte {end}")


@functools.cache
def fits_this_gguf() -> bool:
    """Whether gguf-py's private methods that ``HeaderInMemoryReader`` overrides have the parameters it was
    written against (gguf 0.10-0.19: ``pyproject.toml`` allows any later one); where not, gguf-py's own
    reader is used, slower and never wrong."""
    try:
        get = list(inspect.signature(GGUFReader._get).parameters)
        build = list(inspect.signature(GGUFReader._build_tensors).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return get == ["self", "offset", "dtype", "count", "override_order"] and build == ["self", "start_offs", "fields"]


def reader(path: os.PathLike[str] | str) -> GGUFReader:
    """The fast reader where it fits this gguf-py, else gguf-py's own."""
    return HeaderInMemoryReader(path) if fits_this_gguf() else GGUFReader(path)


_SWAP = threading.Lock()


@contextmanager
def header_in_memory_everywhere() -> Iterator[None]:
    """While the block runs, ``gguf.GGUFReader`` is ``HeaderInMemoryReader``: for transformers' GGUF
    tokenizer conversion, which builds its own reader (``from gguf import GGUFReader`` at call time).
    The reader gives the same fields and tensors, so another thread that builds one meanwhile gets the
    same result, sooner."""
    import gguf

    if not fits_this_gguf():
        yield
        return
    with _SWAP:
        original = gguf.GGUFReader
        gguf.GGUFReader = HeaderInMemoryReader  # type: ignore[misc]
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]
