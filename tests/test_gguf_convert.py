"""GGUF types the kernel does not read, converted at load (``models/gguf_convert.py``).

The referee is gguf-py's own dequantization of the file's blocks: Q4_K -> Q4_1 moves each weight by
at most the f16 rounding of its sub-block's scale and minimum (and not at all where those are exact
in f16); the requantized types are exactly ``quantize(dequantize(blocks), Q8_0)``, within half a
Q8_0 step (and the f16 rounding of the step) of the file's weights. A Q4_K_M-like model runs wholly on the kernel and decodes the tokens
its dequantized float32 weights decode; scales that are not finite are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import Q4_K, dequantize, quantize  # noqa: E402

from engine_runs import final_outputs  # noqa: E402
from kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k  # noqa: E402
from pagedrs import Engine, EngineArgs, SamplingParams  # noqa: E402
from pagedrs.models import load_model  # noqa: E402
from pagedrs.models.gguf_convert import (  # noqa: E402
    common_type,
    k_quant_to_block_of_32,
    kernel_type,
    narrower,
    requantize_q8_0,
    to_kernel,
)
from pagedrs.models.layers import LinearBase  # noqa: E402


def q4_k_to_q4_1(blocks: np.ndarray, cols: int, name: str) -> np.ndarray:
    return k_quant_to_block_of_32(blocks, cols, "Q4_K", name)


def random_q4_k(rows: int, cols: int, d: float, dmin: float, seed: int = 0, size: int = 144) -> np.ndarray:
    """Valid Q4_K (``size`` 176: Q5_K) blocks with every scale, minimum, fifth bit and code byte random (all
    bit patterns are valid), and the given f16 super-block scales."""
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    blocks[:, 0:2] = np.array([d], dtype=np.float16).view(np.uint8)
    blocks[:, 2:4] = np.array([dmin], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("d,dmin,exact", [(0.0123, 0.0071, False), (3.1e-6, 2.2e-7, True), (-0.02, 0.5, False)])
def test_q4_k_becomes_q4_1_within_the_f16_rounding_of_its_scales(d, dmin, exact):
    """Random blocks cover every packing of the 6-bit scales and mins and every code; the f16 scales
    include subnormal ones (52 and 4 steps of 2^-24: times a 6-bit integer they need at most 10
    significant bits, so every product is exact in f16) and a negative d."""
    blocks = random_q4_k(6, 512, d, dmin)
    ref = dequantize(blocks, T.Q4_K)
    q41 = q4_k_to_q4_1(blocks, 512, "w")
    assert q41.shape == (6, 512 // 32 * 20) and q41.dtype == np.uint8
    got = dequantize(q41, T.Q4_1)
    sc, mn = Q4_K.get_scale_min(blocks.reshape(-1, 144)[:, 4:16].copy())
    d16 = np.float32(np.float16(d))
    dmin16 = np.float32(np.float16(dmin))
    step = np.repeat(np.abs(d16 * sc.astype(np.float32)), 32, axis=-1).reshape(6, 512)
    low = np.repeat(np.abs(dmin16 * mn.astype(np.float32)), 32, axis=-1).reshape(6, 512)
    bound = (15 * step + low) * 2.0**-11 + 16 * 2.0**-25  # half an f16 step of each, normal or subnormal
    assert (np.abs(got - ref) <= bound).all()
    assert (got == ref).all() == exact  # where the products are not all exact in f16, the bound was exercised


def test_q4_k_with_f16_exact_scales_converts_bit_for_bit():
    """d = 2^-10 and dmin = 2^-9 times a 6-bit integer are exact in f16: no rounding at all."""
    blocks = random_q4_k(4, 768, 2.0**-10, 2.0**-9, seed=1)
    np.testing.assert_array_equal(dequantize(q4_k_to_q4_1(blocks, 768, "w"), T.Q4_1), dequantize(blocks, T.Q4_K))


@pytest.mark.parametrize("d,dmin,exact", [(0.0123, 0.0071, False), (3.1e-6, 2.2e-7, True), (-0.02, 0.5, False),
                                          (2.0**-10, 2.0**-9, True)])
def test_q5_k_becomes_q5_1_within_the_f16_rounding_of_its_scales(d, dmin, exact):
    """What a tensor-parallel shard that cuts a Q5_K super-block runs: as Q4_K above, with the fifth bits
    moved from Q5_K's ``qh`` (bit s of byte l: sub-block s, element l) into each Q5_1 block's u32."""
    blocks = random_q4_k(6, 512, d, dmin, size=176)
    ref = dequantize(blocks, T.Q5_K)
    q51 = k_quant_to_block_of_32(blocks, 512, "Q5_K", "w")
    assert q51.shape == (6, 512 // 32 * 24) and q51.dtype == np.uint8
    got = dequantize(q51, T.Q5_1)
    sc, mn = Q4_K.get_scale_min(blocks.reshape(-1, 176)[:, 4:16].copy())
    step = np.repeat(np.abs(np.float32(np.float16(d)) * sc.astype(np.float32)), 32, axis=-1).reshape(6, 512)
    low = np.repeat(np.abs(np.float32(np.float16(dmin)) * mn.astype(np.float32)), 32, axis=-1).reshape(6, 512)
    assert (np.abs(got - ref) <= (31 * step + low) * 2.0**-11 + 32 * 2.0**-25).all()
    assert (got == ref).all() == exact  # exact cases: every fifth bit moved (a lost one is off by 16 d sc)


@pytest.mark.parametrize("d,exact", [(0.0123, False), (3.1e-6, True), (-2.0**-8, True)])
def test_iq4_xs_becomes_iq4_nl_within_the_f16_rounding_of_its_scales(d, exact):
    """What a tensor-parallel shard that cuts an IQ4_XS super-block runs: the same codes, each sub-block's scale
    ``d * (ls - 32)`` rounded once to f16 (exact where d has few significant bits: subnormal, a power of two).
    Random bytes cover every 6-bit scale (4 low bits in ``scales_l``, 2 high in ``scales_h``) and every code."""
    blocks = np.random.default_rng(4).integers(0, 256, (6 * 2, 136), dtype=np.uint8)
    blocks[:, 0:2] = np.array([d], dtype=np.float16).view(np.uint8)
    blocks = blocks.reshape(6, 2 * 136)
    ref = dequantize(blocks, T.IQ4_XS)
    nl = to_kernel(blocks, 512, "IQ4_XS", "IQ4_NL", "w")
    assert nl.shape == (6, 512 // 32 * 18) and nl.dtype == np.uint8
    got = dequantize(nl, T.IQ4_NL)
    step = np.abs(np.float32(np.float16(d))) * 32 * 127  # the largest |d (ls - 32) code|
    assert (np.abs(got - ref) <= step * 2.0**-11 + 2.0**-24 * 127).all()
    assert (got == ref).all() == exact
    with pytest.raises(ValueError, match=r"'w' \(IQ4_XS\): 100 bytes a row for 256 columns; IQ4_XS needs 136"):
        to_kernel(np.zeros((2, 100), dtype=np.uint8), 256, "IQ4_XS", "IQ4_NL", "w")
    spoiled = blocks.copy()
    spoiled[1, 136:138] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # row 1, super-block 1
    with pytest.raises(ValueError, match=r"'w' \(IQ4_XS\): row 1, super-block 1 has a scale that is not finite"):
        to_kernel(spoiled, 512, "IQ4_XS", "IQ4_NL", "w")


def test_the_narrower_formats_of_a_cut_super_block():
    assert [narrower(t) for t in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q5_0", "Q8_0", "IQ4_NL", "Q3_K")] == [
        "Q4_1", "Q5_1", "Q8_0", "IQ4_NL", "Q5_0", "Q8_0", "IQ4_NL", "Q8_0"]
    blocks = random_q4_k(2, 256, 0.01, 0.01, size=176)
    np.testing.assert_array_equal(to_kernel(blocks, 256, "Q5_K", "Q5_1", "w"),
                                  k_quant_to_block_of_32(blocks, 256, "Q5_K", "w"))


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q3_K])
def test_other_types_are_requantized_to_q8_0_within_half_a_step(qtype):
    """Q8_0 is what a fused sibling of another type runs in (any type), and every type the kernel does not read."""
    g = np.random.default_rng(2)
    w = (g.standard_normal((5, 512)) * 0.05).astype(np.float32)
    if qtype == T.Q3_K:  # gguf-py cannot write Q3_K: random bytes are valid blocks (110 bytes each)
        blocks = g.integers(0, 256, (5, 2 * 110), dtype=np.uint8)
        blocks.reshape(-1, 110)[:, 108:110] = np.array([0.001], dtype=np.float16).view(np.uint8)
        w = dequantize(blocks, qtype)
    else:
        blocks = {T.Q6_K: quantize_q6_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k}.get(qtype, lambda x: quantize(x, qtype))(w)
    ref = dequantize(blocks, qtype)
    q8 = requantize_q8_0(blocks, 512, qtype.name, "w")
    np.testing.assert_array_equal(q8, quantize(ref, T.Q8_0))  # the definition
    # half a step, plus what the f16 rounding of the step moves the largest code (127 x 2^-11 of a step)
    step = q8.reshape(5, 16, 34)[:, :, :2].copy().view(np.float16).astype(np.float32)  # [5, 16, 1]
    bound = np.repeat(step * (0.5 + 127 * 2.0**-11), 32, axis=-1).reshape(5, 512)
    assert (np.abs(dequantize(q8, T.Q8_0) - ref) <= bound).all()
    assert np.abs(ref - w).max() < 0.1 * np.abs(w).max()  # (the test quantizers wrote the weights they were given)


def test_types_and_the_format_fused_siblings_share():
    types = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "IQ4_XS", "IQ4_NL", "IQ3_S",
             "F16", "BF16", "F32")
    assert [kernel_type(t) for t in types] == [
        "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "IQ4_XS", "IQ4_NL", "Q8_0",
        None, None, None]
    assert common_type(["Q4_K", "Q4_K"]) == "Q4_K"
    assert common_type(["Q4_K", "Q4_K", "Q6_K"]) == "Q8_0"  # Q4_K_M's q/k/v
    assert common_type(["Q4_0", "Q4_1"]) == "Q8_0"
    assert common_type(["Q5_0", "Q5_0", "Q8_0"]) == "Q8_0"  # a small model's Q4_K_M q/k/v (576 wide: Q5_0 for Q4_K)
    assert common_type(["Q8_0", "F16"]) is None and common_type([]) is None
    blocks = random_q4_k(2, 256, 0.01, 0.01)
    assert to_kernel(blocks, 256, "Q4_K", "Q4_K", "w") is blocks  # nothing to do
    with pytest.raises(ValueError, match="GGUF tensor 'w': no conversion from Q4_K to Q4_0"):
        to_kernel(blocks, 256, "Q4_K", "Q4_0", "w")


@pytest.mark.parametrize("d,dmin,what", [(np.inf, 0.01, "d inf"), (0.01, np.nan, "dmin nan"), (60000.0, 0.01, "d sc overflows")])
def test_q4_k_scales_that_are_not_finite_are_refused_by_name(d, dmin, what):
    blocks = random_q4_k(3, 512, d, dmin)
    blocks.reshape(-1, 144)[:, 4:16] = 0xFF  # every scale and min 63: 60000 * 63 overflows f16
    with pytest.raises(ValueError, match=r"GGUF tensor 'model\.layers\.0\.mlp\.up_proj\.weight' \(Q4_K\): row 0, "
                                         r"super-block 0 has a scale that is not finite as float16"):
        q4_k_to_q4_1(blocks, 512, "model.layers.0.mlp.up_proj.weight")
    past = "a weight that is not finite" if what != "d sc overflows" else r"weights up to .*, past what Q8_0's f16 scale holds"
    with pytest.raises(ValueError, match=rf"'w' \(Q4_K\): row 0 has {past}"):
        requantize_q8_0(blocks, 512, "Q4_K", "w")


def test_a_q4_k_with_the_wrong_row_size_is_refused():
    with pytest.raises(ValueError, match=r"'w' \(Q4_K\): 100 bytes a row for 256 columns; Q4_K needs 144 bytes per 256"):
        q4_k_to_q4_1(np.zeros((2, 100), dtype=np.uint8), 256, "w")


def preconverted(kind: str, blocks: np.ndarray, cols: int, qtype):
    """What the loader makes of a file's tensors, done before writing (``write_gguf``'s ``recode``): every
    tensor in its kernel format (fused siblings of different types stay so: one part each)."""
    target = kernel_type(qtype.name)
    return to_kernel(blocks, cols, qtype.name, target, kind), T[target]


# Q4_K_M's mix with the products the kernel does not read in MXFP4 (converted to Q8_0 at load): what a
# first load converts and keeps
CONVERTING_QTYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.MXFP4,
                     "ffn_gate": T.MXFP4, "ffn_up": T.MXFP4, "ffn_down": T.Q5_K}


@pytest.fixture(scope="module")
def q4_k_m_files(tmp_path_factory):
    """A 2-layer random llama (widths multiples of 256, as K-quants need) written with Q4_K_M's mix, with
    a mix whose o / gate / up the loader converts (``CONVERTING_QTYPES``), and that one's blocks written
    already converted (kernel types only)."""
    from conftest import make_tiny_model
    from gguf_writer import Q4_K_M_QTYPES, write_gguf

    d = tmp_path_factory.mktemp("q4_k_m")
    model = make_tiny_model("llama", d / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            head_dim=64)
    write_gguf(model, d / "hf", d / "q4_k_m.gguf", qtypes=Q4_K_M_QTYPES)
    write_gguf(model, d / "hf", d / "converting.gguf", qtypes=CONVERTING_QTYPES)
    write_gguf(model, d / "hf", d / "converted.gguf", qtypes=CONVERTING_QTYPES, recode=preconverted)
    return d / "q4_k_m.gguf", d / "converting.gguf", d / "converted.gguf"


def decode(path, weight_dtype: str):
    prompts = [[3 + (7 * i + 5 * j) % 200 for j in range(4 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = Engine(EngineArgs(model=str(path), weight_dtype=weight_dtype, block_size=4, num_gpu_blocks=64,
                               max_model_len=128, cpu_threads=1))
    return [(list(o.outputs[0].token_ids), [dict(lp) for lp in o.outputs[0].logprobs])
            for o in final_outputs(engine, prompts, params)]


def formats_of(path) -> dict[str, str]:
    loaded = load_model(path)  # auto
    assert loaded.weight_format is not None and loaded.weight_format.name == "gguf"
    assert loaded.model.fused_cpu_decode is not None  # the one-call decode runs it
    return {n.rsplit(".", 1)[-1]: m.gguf_matrix.format for n, m in loaded.model.named_modules()
            if isinstance(m, LinearBase) and n != "lm_head"}


def test_a_q4_k_m_model_runs_wholly_on_the_kernel_in_the_files_own_types(q4_k_m_files, monkeypatch):
    """Nothing of a Q4_K_M file is converted: q/k (Q4_K) beside v (Q6_K) run as one product of three parts,
    each in its own type (they all ran as Q8_0 before). Its first positions' log-probabilities are those of
    the file's weights dequantized to float32 within the int8 rounding of the activations, up to where the
    greedy tokens part on a near tie of this random model: mean difference 0.087 (0.091 with q/k/v in Q8_0);
    with k's and v's parts swapped the two models' top tokens no longer overlap."""
    from pagedrs.models import gguf_convert, quant

    k_quants, _, _ = q4_k_m_files
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)  # (every CI machine has AVX2 anyway)
    monkeypatch.setattr(gguf_convert, "requantize_q8_0", None)  # nothing may convert
    assert formats_of(k_quants) == {"qkv_proj": "q4_k+q4_k+q6_k", "o_proj": "q4_k", "gate_up_proj": "q4_k",
                                    "down_proj": "q6_k"}
    got, want = decode(k_quants, "gguf"), decode(k_quants, "float32")
    # the positions whose context both runs share (up to the first greedy token on which they part)
    same = [(a, b) for (tg, la), (tw, lb) in zip(got, want) for p, (a, b) in enumerate(zip(la, lb)) if tg[:p] == tw[:p]]
    assert len(same) >= 12 and all(a.keys() & b.keys() for a, b in same)
    diffs = [abs(a[t] - b[t]) for a, b in same for t in a.keys() & b.keys()]
    assert float(np.mean(diffs)) < 0.12, diffs


@pytest.fixture(scope="module")
def q3_k_m_file(tmp_path_factory):
    """The q4_k_m_files fixture's model shape written in llama.cpp's Q3_K_M mix (tests/kquants.quantize_q3_k)."""
    from conftest import make_tiny_model
    from gguf_writer import Q3_K_M_QTYPES, write_gguf

    d = tmp_path_factory.mktemp("q3_k_m")
    model = make_tiny_model("llama", d / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            head_dim=64)
    write_gguf(model, d / "hf", d / "q3_k_m.gguf", qtypes=Q3_K_M_QTYPES)
    return d / "q3_k_m.gguf"


def test_a_q3_k_m_model_runs_wholly_on_the_kernel_in_the_files_own_types(q3_k_m_file, monkeypatch):
    """Q3_K runs as the file stores it (it was requantized to Q8_0): q/k (Q3_K) beside v (Q5_K) as one product of
    parts, gate/up Q3_K, o and down Q4_K. Its log-probabilities are those of the file's weights dequantized
    to float32 within the int8 rounding of the activations (the bound of the Q4_K_M test above)."""
    from pagedrs.models import gguf_convert, quant

    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)
    monkeypatch.setattr(gguf_convert, "requantize_q8_0", None)  # nothing may convert
    assert formats_of(q3_k_m_file) == {"qkv_proj": "q3_k+q3_k+q5_k", "o_proj": "q4_k", "gate_up_proj": "q3_k",
                                       "down_proj": "q4_k"}
    got, want = decode(q3_k_m_file, "gguf"), decode(q3_k_m_file, "float32")
    same = [(a, b) for (tg, la), (tw, lb) in zip(got, want) for p, (a, b) in enumerate(zip(la, lb)) if tg[:p] == tw[:p]]
    assert len(same) >= 12 and all(a.keys() & b.keys() for a, b in same)
    diffs = [abs(a[t] - b[t]) for a, b in same for t in a.keys() & b.keys()]
    assert float(np.mean(diffs)) < 0.12, diffs


def test_converted_files_decode_as_the_blocks_converted_beforehand(q4_k_m_files, monkeypatch):
    """A file whose products the kernel does not read (MXFP4) decodes, bit for bit, what the file of its
    blocks converted beforehand decodes; its q/k/v (Q4_K, Q4_K, Q6_K) and Q5_K down run as they are."""
    from pagedrs.models import quant
    from pagedrs.models.gguf_loader import linear_tensor_types

    _, converting, converted = q4_k_m_files
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)
    assert formats_of(converting) == {"qkv_proj": "q4_k+q4_k+q6_k", "o_proj": "q8_0", "gate_up_proj": "q8_0",
                                      "down_proj": "q5_k"}
    assert set(linear_tensor_types(converted)) == {"Q4_K", "Q8_0", "Q6_K", "Q5_K"}
    assert decode(converting, "gguf") == decode(converted, "gguf")


def test_converted_blocks_are_kept_for_the_next_load(q4_k_m_files, tmp_path, monkeypatch, caplog):
    """The first load of a K-quant file converts and keeps each converted tensor in the cache folder (every
    load converted again: ~100 s for an 8B Q4_K_M); the next load reads them back, converting nothing,
    and decodes the same bits. A kept file of the wrong size (a cut-short copy) is converted again and
    rewritten, and so is one whose checksum fails (a bit flipped on disk); a write that fails (a full disk) loses only the saving: the load goes on, says so, and
    leaves no partial file."""
    import errno

    from pagedrs.models import gguf_cache, gguf_convert, gguf_loader, quant

    _, k_quants, _ = q4_k_m_files  # (its o / gate / up convert)
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    fresh = decode(k_quants, "gguf")
    kept_dir = gguf_cache.convert_gguf_cached(k_quants) / "converted"
    index = gguf_loader.tensor_index(k_quants, kept_dir.parent)
    types = {gguf_loader._hf_name(t["name"], k_quants): t["type"] for t in index["tensors"]}

    converted_types = {n for n, t in types.items() if kernel_type(t) not in (None, t)}
    kept = {p.name.rsplit(".", 1)[0] for p in kept_dir.iterdir()}
    assert kept == converted_types and len(kept) >= 6  # every converted tensor (q/k/v), no temporary file
    real = gguf_convert.to_kernel
    conversions: list[str] = []

    def counting(blocks, cols, type_name, target, name):
        if type_name != target:
            conversions.append(name)
        return real(blocks, cols, type_name, target, name)

    monkeypatch.setattr(gguf_convert, "to_kernel", counting)
    assert decode(k_quants, "gguf") == fresh and conversions == []
    cut, spoiled = sorted(kept_dir.iterdir())[:2]
    size, intact = cut.stat().st_size, spoiled.read_bytes()
    cut.write_bytes(cut.read_bytes()[: size // 2])
    spoiled.write_bytes(intact[:100] + bytes([intact[100] ^ 1]) + intact[101:])  # one bit flipped, the size kept
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        assert decode(k_quants, "gguf") == fresh
    assert sorted(conversions) == sorted(p.name.rsplit(".", 1)[0] for p in (cut, spoiled))
    assert cut.stat().st_size == size and spoiled.read_bytes() == intact  # both rewritten
    assert "fails its checksum" in caplog.text
    caplog.clear()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "full"))
    gguf_cache.convert_gguf_cached(k_quants)  # the folder itself (config, index) is written before the disk fills
    monkeypatch.setattr(gguf_cache.tempfile, "mkstemp", full_disk)
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        assert decode(k_quants, "gguf") == fresh
    assert "were not kept" in caplog.text and "No space left on device" in caplog.text
    assert not any((gguf_cache.convert_gguf_cached(k_quants) / "converted").glob("*"))


def test_matrices_are_packed_on_threads_and_the_first_failure_in_order_is_raised(q4_k_m_files, tmp_path, monkeypatch):
    """``install_gguf_weights`` converts and packs on several threads; when two layers fail, the error is the
    first one's in model order (what one thread reported), though the later one fails first in time."""
    import threading
    import time

    from pagedrs.models import gguf_convert, gguf_linear, quant

    _, converting, _ = q4_k_m_files
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_linear, "LOAD_THREADS", 4)
    real, threads = gguf_convert.to_kernel, set()

    def failing(blocks, cols, type_name, target, name):
        threads.add(threading.get_ident())
        if name == "model.layers.0.self_attn.o_proj.weight":
            time.sleep(0.5)
            raise ValueError(f"first: {name}")
        if name == "model.layers.1.self_attn.o_proj.weight":
            raise ValueError(f"second: {name}")
        return real(blocks, cols, type_name, target, name)

    monkeypatch.setattr(gguf_convert, "to_kernel", failing)
    with pytest.raises(ValueError, match=r"^first: model\.layers\.0\.self_attn\.o_proj\.weight$"):
        load_model(converting)
    assert len(threads) > 1
