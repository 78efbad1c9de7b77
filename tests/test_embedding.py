"""A token lookup kept in GGUF blocks (``models/embedding.py``): the floats of the dense table, never a wrong row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.models.embedding import BlockEmbedding


def _table(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random weights quantized to ``qtype`` by gguf-py (blocks) and gguf-py's dequantization of them (floats)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[3, :] = 0.0  # an all-zero row (zero scales)
    kind = GGMLQuantizationType[qtype]
    blocks = np.ascontiguousarray(quantize(w, kind))
    return blocks, np.asarray(dequantize(blocks, kind), dtype=np.float32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_rows_are_the_dense_tables_floats_bit_for_bit(qtype):
    """Every row, any order, repeated ids, an empty lookup: what gguf-py's dequantization of the whole
    table holds (Q8_0 through its own NumPy path, the others through gguf-py itself)."""
    blocks, dense = _table(qtype, 97, 96)
    table = BlockEmbedding(blocks, qtype, 96, torch.float32)
    ids = np.concatenate([np.arange(97), [5, 5, 96, 0]])[::-1].copy()
    got = table.rows(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), 96)
    assert np.array_equal(got.view(np.uint32), dense[ids].view(np.uint32))
    assert table.rows(np.zeros(0, np.int64)).shape == (0, 96)
    out = table(torch.tensor([[1, 2], [3, 96]]))  # the module: any shape of ids, rows in the last dim
    assert out.shape == (2, 2, 96) and torch.equal(out.reshape(4, 96), torch.from_numpy(dense[[1, 2, 3, 96]]))
    assert table.weight_bytes() == blocks.nbytes


def test_q8_0_matches_gguf_py_on_special_scales():
    """Q8_0's own path against gguf-py's where floats are delicate: subnormal, negative, huge, zero and
    NaN scales (a NaN scale gives NaN rows, which the fused decode then refuses by name)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(8, 3 * 34), dtype=np.uint8)
    scales = np.array([6e-8, -1.5, 65504.0, 0.0, np.nan, -0.0, 1e-5, 3.0], dtype=np.float16)
    for r, scale in enumerate(scales):
        blocks[r, :2] = np.frombuffer(scale.tobytes(), np.uint8)
    want = np.asarray(dequantize(blocks, GGMLQuantizationType.Q8_0), dtype=np.float32)
    got = BlockEmbedding(blocks, "Q8_0", 96, torch.float32).rows(np.arange(8))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.nan_to_num(got).view(np.uint32), np.nan_to_num(want).view(np.uint32))


def test_q6_k_matches_gguf_py_on_every_code_scale_and_special_d():
    """Q6_K's own path (a tied K-quant head's table) against gguf-py's on random bytes: every 6-bit code, every
    int8 scale (-128..127), and d subnormal, negative, huge, zero, -0 and NaN."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(16, 2 * 210), dtype=np.uint8)
    ds = np.array([6e-8, -1.5, 65504.0, 0.0, np.nan, -0.0, 1e-5, 3.0, 0.01, -0.02, 2.0**-14, 7.0, 1.0, -1.0, 0.5, 9e-3],
                  dtype=np.float16)
    for r, d in enumerate(ds):
        blocks[r, 208:210] = np.frombuffer(d.tobytes(), np.uint8)  # each row's first super-block
    with np.errstate(invalid="ignore"):  # (gguf-py's NaN d)
        want = np.asarray(dequantize(blocks, GGMLQuantizationType.Q6_K), dtype=np.float32)
    table = BlockEmbedding(blocks, "Q6_K", 512, torch.float32)
    assert table._dequantize.__name__ == "_q6_k_rows"  # its own path, not gguf-py's
    ids = np.array([15, 0, 4, 4, 9, 3, 1])
    got = table.rows(ids)
    assert np.array_equal(np.isnan(got), np.isnan(want[ids]))
    assert np.array_equal(np.nan_to_num(got).view(np.uint32), np.nan_to_num(want[ids]).view(np.uint32))


@pytest.mark.parametrize("bad", [-1, 97, 2**40, -(2**40)])
def test_a_token_outside_the_vocabulary_is_refused_by_name(bad):
    """NumPy's ``take`` would wrap a negative id to a row from the end: refused instead, naming the range."""
    blocks, _ = _table("Q8_0", 97, 64)
    table = BlockEmbedding(blocks, "Q8_0", 64, torch.float32)
    with pytest.raises(ValueError, match=rf"input_ids: token {bad} is outside the vocabulary; allowed 0 to 96"):
        table.rows(np.array([1, bad], np.int64))


def test_blocks_that_are_not_the_types_rows_are_refused():
    blocks, _ = _table("Q8_0", 4, 64)
    with pytest.raises(ValueError, match=r"not Q4_0 rows of 64 weights \(36 bytes a row\)"):
        BlockEmbedding(blocks, "Q4_0", 64, torch.float32)
    with pytest.raises(ValueError, match=r"not Q8_0 rows of 96 weights"):
        BlockEmbedding(blocks, "Q8_0", 96, torch.float32)


def test_the_table_is_a_private_copy():
    """The loader hands views of the mapped file; the lookup keeps its own bytes (a file rewritten while the
    engine runs cannot change the weights, as the matrices, packed at load, cannot change either)."""
    blocks, dense = _table("Q8_0", 8, 64)
    table = BlockEmbedding(blocks, "Q8_0", 64, torch.float32)
    blocks[:] = 0
    assert np.array_equal(table.rows(np.arange(8)), dense)


def test_the_embedded_models_lookup_equals_its_float32_table(smollm2):
    """SmolLM2's Q8_0 table under ``weight_dtype="gguf"``: every row the dense load's float32 table holds,
    at a quarter of its bytes."""
    from pagedrs.models import load_model

    loaded = load_model("smollm2-135m", weight_dtype="gguf")
    table = loaded.model.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and table.qtype == "Q8_0"
    dense = smollm2.model.model.embed_tokens.weight
    got = table(torch.arange(dense.shape[0]))
    assert torch.equal(got, dense)
    assert table.weight_bytes() * 3 < dense.numel() * dense.element_size()
