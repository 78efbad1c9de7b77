"""A token lookup kept in GGUF blocks (``models/embedding.py``): the floats of the dense table, never a wrong row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.models.embedding import _LEAN_ROWS, BlockEmbedding, _q6_k_rows, _q8_0_rows


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
    NaN scales (a table holding a NaN scale is refused when built: ``test_a_non_finite_scale_is_refused_at_load``;
    the function still computes what gguf-py does)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(8, 3 * 34), dtype=np.uint8)
    scales = np.array([6e-8, -1.5, 65504.0, 0.0, np.nan, -0.0, 1e-5, 3.0], dtype=np.float16)
    for r, scale in enumerate(scales):
        blocks[r, :2] = np.frombuffer(scale.tobytes(), np.uint8)
    want = np.asarray(dequantize(blocks, GGMLQuantizationType.Q8_0), dtype=np.float32)
    assert _LEAN_ROWS["Q8_0"] is _q8_0_rows  # the table's own path, not gguf-py's
    got = _q8_0_rows(blocks).reshape(8, 96)
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
    assert _LEAN_ROWS["Q6_K"] is _q6_k_rows  # the table's own path, not gguf-py's
    ids = np.array([15, 0, 4, 4, 9, 3, 1])
    got = _q6_k_rows(blocks[ids])
    assert np.array_equal(np.isnan(got), np.isnan(want[ids]))
    assert np.array_equal(np.nan_to_num(got).view(np.uint32), np.nan_to_num(want[ids]).view(np.uint32))


@pytest.mark.parametrize("qtype,field,offset", [("Q8_0", "d", 0), ("Q4_1", "m", 2), ("Q6_K", "d", 208),
                                                 ("Q4_K", "dmin", 2), ("Q2_K", "d", 80)])
@pytest.mark.parametrize("bits", [0x7E00, 0x7C00, 0xFC00])
def test_a_non_finite_scale_is_refused_at_load(qtype, field, offset, bits):
    """A NaN or infinite f16 scale (or minimum) in any block of the table is refused when the table is built,
    naming the tensor, the row (token) and the block; it used to load, and fail only when that token came
    (blaming the first product its NaN row reached), or give NaN logits."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    from kquants import quantize_q4_k, quantize_q6_k

    per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    cols = 2 * max(per_block, 256)
    w = np.random.default_rng(3).standard_normal((6, cols)).astype(np.float32) * 0.05
    if qtype == "Q2_K":  # (gguf-py cannot write K-quants; any bytes with finite d and dmin do)
        blocks = np.random.default_rng(4).integers(0, 256, size=(6, cols // per_block * size), dtype=np.uint8)
        for b in range(cols // per_block):
            blocks[:, b * size + 80:b * size + 84] = np.frombuffer(np.array([0.01, 0.02], np.float16).tobytes(), np.uint8)
    else:
        blocks = {"Q6_K": quantize_q6_k, "Q4_K": quantize_q4_k}.get(qtype, lambda a: quantize(a, GGMLQuantizationType[qtype]))(w)
    blocks = np.ascontiguousarray(blocks).reshape(6, -1)
    BlockEmbedding(blocks, qtype, cols, torch.float32)  # finite: built
    row, block = 4, cols // per_block - 1
    blocks[row, block * size + offset:block * size + offset + 2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    value = "nan" if bits == 0x7E00 else "inf" if bits == 0x7C00 else "-inf"
    with pytest.raises(ValueError, match=rf"GGUF tensor 'token_embd\.weight': {qtype} {field} of row 4 \(token 4\), "
                                         rf"block {block} is {value} \(f16 bits {bits:#06x}\)"):
        BlockEmbedding(blocks, qtype, cols, torch.float32)


def test_a_non_finite_weight_of_another_type_is_refused_at_load():
    """A type whose blocks' f16 fields are not listed is dequantized whole and checked."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = np.ascontiguousarray(quantize(np.ones((4, 32), np.float32), GGMLQuantizationType.Q8_0))
    blocks[2, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    with pytest.MonkeyPatch.context() as patch:
        from pagedrs.models import embedding

        patch.delitem(embedding._F16_FIELDS, "Q8_0")
        with pytest.raises(ValueError, match=r"GGUF tensor 'token_embd\.weight': row 2 \(token 2\) holds nan at column 0"):
            BlockEmbedding(blocks, "Q8_0", 32, torch.float32)


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


def _q6_k_blocks(rows: int, supers: int, seed: int) -> np.ndarray:
    """Random Q6_K rows (every code and int8 scale) whose ``d`` are finite (a matrix refuses others)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, supers * 210), dtype=np.uint8)
    d = (rng.standard_normal((rows, supers)) * 0.01).astype(np.float16)
    for s in range(supers):
        blocks[:, 210 * s + 208:210 * s + 210] = d[:, s:s + 1].view(np.uint8)
    return blocks


@pytest.mark.parametrize("qtype, cols", [("Q8_0", 96), ("Q6_K", 512)])
def test_a_tied_heads_lookup_reads_the_heads_tiles_bit_for_bit(qtype, cols):
    """``of_head``: a tied head's table read from the head's own matrix (``GgufMatrix.dequantize_rows``: no
    second copy of the bytes) gives the floats of the table's blocks, gguf-py's dequantization, for any ids
    (every row of 37: past two 16-row tiles, reversed, repeated); the same refusals as a table of its own."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedrs._core import GgufMatrix

    blocks = _table(qtype, 37, cols)[0] if qtype == "Q8_0" else _q6_k_blocks(37, cols // 256, 3)
    dense = np.asarray(dequantize(blocks, GGMLQuantizationType[qtype]), dtype=np.float32)
    head = GgufMatrix(blocks.reshape(-1), 37, cols, qtype.lower(), "output.weight")
    assert head.reads_rows
    table = BlockEmbedding.of_head(head, qtype, torch.float32)
    ids = np.concatenate([np.arange(37), [5, 5, 36, 0]])[::-1].copy()
    got = table.rows(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), cols)
    assert np.array_equal(got.view(np.uint32), dense[ids].view(np.uint32))
    assert np.array_equal(got.view(np.uint32), BlockEmbedding(blocks, qtype, cols, torch.float32).rows(ids).view(np.uint32))
    assert table.rows(np.zeros(0, np.int64)).shape == (0, cols)
    out = table(torch.tensor([[1, 2], [3, 36]]))
    assert out.shape == (2, 2, cols) and torch.equal(out.reshape(4, cols), torch.from_numpy(dense[[1, 2, 3, 36]]))
    assert table.blocks is None and table.weight_bytes() == 0 and "the head's tiles (output.weight)" in repr(table)
    for bad in [-1, 37, 2**40]:
        with pytest.raises(ValueError, match=rf"input_ids: token {bad} is outside the vocabulary; allowed 0 to 36"):
            table.rows(np.array([1, bad], np.int64))
    with pytest.raises(TypeError, match=r"input_ids: token ids must be integers, got float64"):
        table.rows(np.array([1.5]))
    # the Rust call checks its ids itself, whoever calls it
    with pytest.raises(ValueError, match=r"tensor \"output.weight\": row id -1 is out of range; allowed 0 to 36"):
        head.dequantize_rows(np.array([-1], np.int64))


def test_only_a_head_packed_from_the_table_in_a_format_whose_rows_are_read_serves_it():
    """``of_head`` refuses a head of another format than the table's type, a format whose rows it does not
    read, and a fused product (several parts): the loader then keeps the table's own blocks."""
    from pagedrs._core import GgufMatrix

    blocks, _ = _table("Q8_0", 16, 64)
    q8 = GgufMatrix(blocks.reshape(-1), 16, 64, "q8_0", "output.weight")
    with pytest.raises(ValueError, match=r"the head 'output.weight' \(q8_0\) cannot serve a Q6_K token table's rows"):
        BlockEmbedding.of_head(q8, "Q6_K", torch.float32)
    q4 = GgufMatrix(_table("Q4_0", 16, 64)[0].reshape(-1), 16, 64, "q4_0", "w")
    assert not q4.reads_rows
    with pytest.raises(ValueError, match=r"\(q4_0\) cannot serve a Q4_0 token table's rows"):
        BlockEmbedding.of_head(q4, "Q4_0", torch.float32)
    fused = GgufMatrix.fused([q8, q8], "qkv")
    assert not fused.reads_rows
    with pytest.raises(ValueError, match=r"tensor \"qkv\": rows of a fused product \(q8_0\+q8_0\) cannot be read"):
        fused.dequantize_rows(np.array([0], np.int64))
    with pytest.raises(ValueError, match=r"row id 2 is out of range; allowed 0 to 1|cannot be read"):
        GgufMatrix(blocks[:2].reshape(-1), 2, 64, "q8_0", "t").dequantize_rows(np.array([2], np.int64))


def test_the_embedded_models_lookup_equals_its_float32_table(smollm2):
    """SmolLM2's Q8_0 table under ``weight_dtype="gguf"``: every row the dense load's float32 table holds,
    read from the tied head's matrix (no bytes of its own; a copy of its blocks was a quarter of the float32
    table's)."""
    from pagedrs.models import load_model

    loaded = load_model("smollm2-135m", weight_dtype="gguf")
    table = loaded.model.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and table.qtype == "Q8_0"
    dense = smollm2.model.model.embed_tokens.weight
    got = table(torch.arange(dense.shape[0]))
    assert torch.equal(got, dense)
    # the tied head's matrix holds the table's bytes once: the lookup reads its tiles (28 MB not kept twice)
    assert table.head is loaded.model.lm_head.gguf_matrix and table.blocks is None and table.weight_bytes() == 0
