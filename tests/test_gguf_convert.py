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
from kquants import quantize_q4_k, quantize_q6_k  # noqa: E402
from pagedrs import Engine, EngineArgs, SamplingParams  # noqa: E402
from pagedrs.models import load_model  # noqa: E402
from pagedrs.models.gguf_convert import common_type, kernel_type, q4_k_to_q4_1, requantize_q8_0, to_kernel  # noqa: E402
from pagedrs.models.layers import LinearBase  # noqa: E402


def random_q4_k(rows: int, cols: int, d: float, dmin: float, seed: int = 0) -> np.ndarray:
    """Valid Q4_K blocks with every scale, minimum and code byte random (all bit patterns are valid),
    and the given f16 super-block scales."""
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
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


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q5_0, T.Q5_1, T.Q4_K])
def test_other_types_are_requantized_to_q8_0_within_half_a_step(qtype):
    g = np.random.default_rng(2)
    w = (g.standard_normal((5, 512)) * 0.05).astype(np.float32)
    blocks = {T.Q6_K: quantize_q6_k, T.Q4_K: quantize_q4_k}.get(qtype, lambda x: quantize(x, qtype))(w)
    ref = dequantize(blocks, qtype)
    q8 = requantize_q8_0(blocks, 512, qtype.name, "w")
    np.testing.assert_array_equal(q8, quantize(ref, T.Q8_0))  # the definition
    # half a step, plus what the f16 rounding of the step moves the largest code (127 x 2^-11 of a step)
    step = q8.reshape(5, 16, 34)[:, :, :2].copy().view(np.float16).astype(np.float32)  # [5, 16, 1]
    bound = np.repeat(step * (0.5 + 127 * 2.0**-11), 32, axis=-1).reshape(5, 512)
    assert (np.abs(dequantize(q8, T.Q8_0) - ref) <= bound).all()
    assert np.abs(ref - w).max() < 0.1 * np.abs(w).max()  # (the test quantizers wrote the weights they were given)


def test_types_and_the_format_fused_siblings_share():
    assert [kernel_type(t) for t in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "IQ4_XS", "F16", "BF16", "F32")] == [
        "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q8_0", "Q8_0", None, None, None]
    assert common_type(["Q4_K", "Q4_K"]) == "Q4_K"
    assert common_type(["Q4_K", "Q4_K", "Q6_K"]) == "Q8_0"  # Q4_K_M's q/k/v
    assert common_type(["Q4_0", "Q4_1"]) == "Q8_0"
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
    """What the loader makes of Q4_K_M's tensors, done before writing (``write_gguf``'s ``recode``):
    q/k/v in Q8_0 (their types differ), every other tensor in its own kernel format."""
    target = "Q8_0" if kind in ("attn_q", "attn_k", "attn_v") else kernel_type(qtype.name)
    return to_kernel(blocks, cols, qtype.name, target, kind), T[target]


@pytest.fixture(scope="module")
def q4_k_m_files(tmp_path_factory):
    """A 2-layer random llama (widths multiples of 256, as K-quants need) written with Q4_K_M's mix,
    and the same blocks written already converted (native kernel types only)."""
    from conftest import make_tiny_model
    from gguf_writer import Q4_K_M_QTYPES, write_gguf

    d = tmp_path_factory.mktemp("q4_k_m")
    model = make_tiny_model("llama", d / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            head_dim=64)
    write_gguf(model, d / "hf", d / "q4_k_m.gguf", qtypes=Q4_K_M_QTYPES)
    write_gguf(model, d / "hf", d / "converted.gguf", qtypes=Q4_K_M_QTYPES, recode=preconverted)
    return d / "q4_k_m.gguf", d / "converted.gguf"


def decode(path, weight_dtype: str):
    prompts = [[3 + (7 * i + 5 * j) % 200 for j in range(4 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = Engine(EngineArgs(model=str(path), weight_dtype=weight_dtype, block_size=4, num_gpu_blocks=64,
                               max_model_len=128, cpu_threads=1))
    return [(list(o.outputs[0].token_ids), [dict(lp) for lp in o.outputs[0].logprobs])
            for o in final_outputs(engine, prompts, params)]


def test_a_q4_k_m_model_runs_wholly_on_the_kernel_as_its_converted_blocks(q4_k_m_files, monkeypatch):
    """The Q4_K_M file decodes, bit for bit, what the file of the blocks converted beforehand decodes
    (native kernel types only): the loader converts every tensor, and fuses q/k/v as Q8_0."""
    from pagedrs.models import quant

    k_quants, converted = q4_k_m_files
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)  # (every CI machine has AVX2 anyway)
    loaded = load_model(k_quants)  # auto
    assert loaded.weight_format is not None and loaded.weight_format.name == "gguf"
    formats = {n.rsplit(".", 1)[-1]: m.gguf_matrix.format for n, m in loaded.model.named_modules()
               if isinstance(m, LinearBase) and n != "lm_head"}
    # q/k (Q4_K) beside v (Q6_K): all Q8_0; o, gate/up: Q4_K as it is; down: Q6_K as it is
    assert formats == {"qkv_proj": "q8_0", "o_proj": "q4_k", "gate_up_proj": "q4_k", "down_proj": "q6_k"}
    assert loaded.model.fused_cpu_decode is not None  # the one-call decode runs it
    from pagedrs.models.gguf_loader import linear_tensor_types

    assert set(linear_tensor_types(converted)) == {"Q4_K", "Q8_0", "Q6_K"}
    assert decode(k_quants, "gguf") == decode(converted, "gguf")


def test_converted_blocks_are_kept_for_the_next_load(q4_k_m_files, tmp_path, monkeypatch, caplog):
    """The first load of a K-quant file converts and keeps each converted tensor in the cache folder (every
    load converted again: ~100 s for an 8B Q4_K_M); the next load reads them back, converting nothing,
    and decodes the same bits. A kept file of the wrong size (a cut-short copy) is converted again and
    rewritten, and so is one whose checksum fails (a bit flipped on disk); a write that fails (a full disk) loses only the saving: the load goes on, says so, and
    leaves no partial file."""
    import errno

    from pagedrs.models import gguf_cache, gguf_convert, gguf_loader, quant

    k_quants, _ = q4_k_m_files
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    fresh = decode(k_quants, "gguf")
    kept_dir = gguf_cache.convert_gguf_cached(k_quants) / "converted"
    index = gguf_loader.tensor_index(k_quants, kept_dir.parent)
    types = {gguf_loader._hf_name(t["name"], k_quants): t["type"] for t in index["tensors"]}

    def target(name: str) -> str | None:  # q/k/v share one format (fused): Q8_0 where their types differ
        if ".self_attn." in name and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            return common_type([types[name.replace(name.rsplit(".", 2)[-2], p)] for p in ("q_proj", "k_proj", "v_proj")])
        return kernel_type(types[name])

    converted_types = {n for n, t in types.items() if target(n) not in (None, t)}
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
