"""``pagedrs/gguf_reader.py``: gguf-py's reader with the header parsed from memory gives gguf-py's own fields
and tensors (the referee is ``gguf.GGUFReader`` on the same file), faster, and fails as it does."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagedrs.gguf_reader import HeaderInMemoryReader, header_in_memory_everywhere  # noqa: E402
from pagedrs.models.gguf_loader import open_gguf  # noqa: E402
from pagedrs.models.loader import embedded_model_path  # noqa: E402


def assert_same_reading(path) -> None:
    want, got = gguf.GGUFReader(str(path)), HeaderInMemoryReader(path)
    assert list(got.fields) == list(want.fields)
    for key, w in want.fields.items():
        g = got.fields[key]
        assert (g.offset, g.types, g.data) == (w.offset, w.types, w.data), key
        assert len(g.parts) == len(w.parts), key
        for gp, wp in zip(g.parts, w.parts):
            assert gp.dtype == wp.dtype and np.array_equal(gp, wp), key
        assert g.contents() == w.contents(), key
    assert (got.data_offset, got.alignment, len(got.tensors)) == (want.data_offset, want.alignment, len(want.tensors))
    for g, w in zip(got.tensors, want.tensors):
        assert (g.name, g.tensor_type, list(g.shape), g.n_elements, g.n_bytes, g.data_offset) == (
            w.name, w.tensor_type, list(w.shape), w.n_elements, w.n_bytes, w.data_offset)
        assert isinstance(g.data, np.memmap) and np.array_equal(g.data, w.data), g.name  # the data: the map's views


def test_the_embedded_models_header_reads_as_gguf_py_reads_it(monkeypatch):
    """SmolLM2's file: 49,152 token strings and 48,900 merges; the header is read past the first MiB."""
    monkeypatch.setattr(HeaderInMemoryReader, "_FIRST_READ", 4096)  # every growth step runs
    assert_same_reading(embedded_model_path())


def test_a_file_cut_inside_its_header_fails_as_with_gguf_py(tmp_path):
    with embedded_model_path().open("rb") as f:
        data = f.read(300_000)
    for cut in (3, 100, 4096, 300_000):  # in the magic, the counts, the first fields, the token strings
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(Exception) as want:
            gguf.GGUFReader(str(short))
        with pytest.raises(type(want.value)):
            HeaderInMemoryReader(short)
        if cut >= 4:
            with pytest.raises(ValueError, match="truncated or corrupt"):
                open_gguf(short)


def test_it_is_used_only_where_gguf_py_s_private_methods_fit(monkeypatch):
    from pagedrs import gguf_reader

    assert gguf_reader.fits_this_gguf()  # gguf 0.19, requirements-dev.txt's pin
    assert type(open_gguf(embedded_model_path())) is HeaderInMemoryReader
    gguf_reader.fits_this_gguf.cache_clear()
    monkeypatch.setattr(gguf.GGUFReader, "_build_tensors", lambda self, start_offs, fields, extra=None: None)
    try:
        assert not gguf_reader.fits_this_gguf()
        assert type(gguf_reader.reader(embedded_model_path())) is gguf.GGUFReader
        with header_in_memory_everywhere():
            assert gguf.GGUFReader is not HeaderInMemoryReader
    finally:
        gguf_reader.fits_this_gguf.cache_clear()


def test_transformers_reads_through_it_only_inside_the_block():
    original = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="inside"):
        with header_in_memory_everywhere():
            assert gguf.GGUFReader is HeaderInMemoryReader
            from gguf import GGUFReader  # what transformers' load_gguf_checkpoint does at call time

            assert GGUFReader is HeaderInMemoryReader
            raise RuntimeError("inside")
    assert gguf.GGUFReader is original
