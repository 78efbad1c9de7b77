"""The Rust GEMV over GGUF blocks (``pagedrs._core.GgufMatrix``) from Python.

The reference is gguf-py's own definition of the formats (``gguf.quants`` quantizes and
dequantizes), so these tests check our reading of the GGUF layout independently of the
Rust tests: every kernel this CPU runs gives the same bits, within the float64 bound of the
dequantized weights times the quantized activations, and bad input raises ValueError
naming the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedrs import _core

FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
KERNELS = _core.gemv_kernels()


def _gguf(fmt: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw block bytes, float64 dequantized weights) of a random [rows, cols] tensor."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    qtype = GGMLQuantizationType[fmt.upper()]
    raw = quantize(w, qtype)
    return raw.reshape(-1), dequantize(raw, qtype).astype(np.float64).reshape(rows, cols)


def _quantized_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Q8 scheme in numpy: (x rounded to its int8 grid, the per-value scale d)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    scaled = (blocks * inv).astype(np.float64)  # the f32 product, as the Rust code forms it
    q = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127)  # roundf: half away from zero
    return (q * d).reshape(x.shape).astype(np.float64), np.broadcast_to(d, blocks.shape).reshape(x.shape)


def test_scalar_is_always_available() -> None:
    assert KERNELS[0] == "scalar"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rows", "cols", "m"), [(1, 32, 1), (37, 96, 3), (130, 576, 8), (16, 1536, 2),
                                                (37, 96, 17), (50, 192, 33)])  # m >= 16: AMX's groups where the CPU has it
def test_kernels_agree_and_match_gguf(fmt: str, rows: int, cols: int, m: int) -> None:
    raw, w = _gguf(fmt, rows, cols, seed=rows * cols + m)
    mat = _core.GgufMatrix(raw, rows, cols, fmt, "blk.0.test")
    assert (mat.rows, mat.cols, mat.format, mat.weight_bytes) == (rows, cols, fmt, raw.size)
    _assert_kernels_agree_within_bound(mat, w, m)


def _assert_kernels_agree_within_bound(mat: _core.GgufMatrix, w: np.ndarray, m: int) -> None:
    """Every kernel this CPU runs, on 1 and 2 threads, gives the scalar kernel's bits, within the float64
    bound of the dequantized weights ``w`` times the quantized activations of a random ``[m, cols]`` input."""
    rows, cols = w.shape
    x = np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32)
    outs = {k: mat.matmul(x, threads=t, kernel=k) for k in KERNELS for t in (1, 2)}
    first = outs[KERNELS[0]]
    assert first.shape == (m, rows) and first.dtype == np.float32
    for k, y in outs.items():
        assert np.array_equal(y.view(np.uint32), first.view(np.uint32)), f"kernel {k} differs from scalar"
    xq, d = _quantized_activations(x)
    exact = xq @ w.T
    bound = 3 * (cols / 32 + 2) * np.finfo(np.float32).eps * (np.abs(xq) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(first - exact) <= bound)
    # Against unquantized activations: each value is off by at most d / 2.
    assert np.all(np.abs(first - x.astype(np.float64) @ w.T) <= (d / 2) @ np.abs(w).T + bound)


def test_torch_and_strided_inputs() -> None:
    raw, _ = _gguf("q4_1", 48, 64, seed=1)
    mat = _core.GgufMatrix(raw, 48, 64, "Q4_1")
    x = torch.randn(3, 128)[:, ::2]  # not contiguous
    assert np.array_equal(mat.matmul(x), mat.matmul(np.ascontiguousarray(x.numpy())))
    assert np.array_equal(mat.matmul(torch.ones(1, 64)), mat.matmul(np.ones((1, 64), np.float32)))


def test_bad_input_names_the_tensor() -> None:
    raw, _ = _gguf("q4_0", 4, 64, seed=2)
    with pytest.raises(ValueError, match=r'"blk.3.ffn_up.weight".*needs 144 bytes, got 143'):
        _core.GgufMatrix(raw[:-1], 4, 64, "q4_0", "blk.3.ffn_up.weight")
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        _core.GgufMatrix(raw, 8, 36, "q4_0", "w")
    with pytest.raises(ValueError, match=r'format "q2_k" is not supported; allowed: "q4_0", "q4_1", "q8_0"'):
        _core.GgufMatrix(raw, 4, 64, "q2_k", "w")
    nan = raw.copy()
    nan[18:20] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # row 0, block 1's d
    with pytest.raises(ValueError, match=r'"w": scale field "d" of row 0, block 1 is not finite'):
        _core.GgufMatrix(nan, 4, 64, "q4_0", "w")
    mat = _core.GgufMatrix(raw, 4, 64, "q4_0", "w")
    with pytest.raises(ValueError, match=r"x has shape \[1, 32\]; this weight needs \[M, 64\]"):
        mat.matmul(np.ones((1, 32), np.float32))
    with pytest.raises(TypeError, match="2-D float32"):
        mat.matmul(np.ones((1, 64), np.float64))
    bad = np.ones((2, 64), np.float32)
    bad[1, 7] = np.inf
    with pytest.raises(ValueError, match=r"x\[1, 7\] is NaN or infinite"):
        mat.matmul(bad)
    for threads in (0, 1025, 10**6):  # a wrong cpu_threads is an error, not a million threads spawned
        with pytest.raises(ValueError, match=f"threads is {threads}; allowed: 1 to 1024"):
            mat.matmul(np.ones((2, 64), np.float32), threads=threads)
    with pytest.raises(ValueError, match='kernel "avx9" is unknown'):
        mat.matmul(np.ones((1, 64), np.float32), kernel="avx9")


def test_embedded_head_through_the_kernel() -> None:
    """SmolLM2's own Q8_0 token embedding (the tied head): the kernel against gguf-py's dequantization."""
    from pagedrs.models.gguf_loader import open_gguf
    from pagedrs.models.loader import embedded_model_path

    reader = open_gguf(embedded_model_path())
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    cols, rows = (int(s) for s in t.shape)
    data = np.ascontiguousarray(t.data[:512]).reshape(-1)  # the first 512 rows
    mat = _core.GgufMatrix(data, 512, cols, t.tensor_type.name, t.name)
    w = dequantize(np.asarray(t.data[:512]), t.tensor_type).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((2, cols)).astype(np.float32)
    xq, _ = _quantized_activations(x)
    y = mat.matmul(x)
    assert np.abs(y - xq @ w.T).max() <= 1e-4 * np.abs(xq @ w.T).max()


@pytest.fixture(scope="module")
def gguf_model():
    from pagedrs.models import load_model

    return load_model("smollm2-135m", weight_dtype="gguf")


def test_gguf_layers_hold_the_files_blocks(gguf_model) -> None:
    """Fused QKV = the file's q, k, v blocks (Q/K rows unpermuted), multiplied exactly as one GgufMatrix."""
    from pagedrs.models.gguf_loader import open_gguf, unpermute_qk
    from pagedrs.models.loader import embedded_model_path

    model = gguf_model.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.gguf_matrix.format == "q4_1" and qkv.gguf_matrix.rows == 960
    assert model.lm_head.gguf_matrix.format == "q8_0" and model.lm_head.gguf_matrix.rows == 49152
    assert model.model.embed_tokens.qtype == "Q8_0"  # the lookup reads the file's blocks (exact: test_embedding.py)
    reader = open_gguf(embedded_model_path())
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_model.config

    def deq(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64))

    w = torch.cat([unpermute_qk(deq("blk.0.attn_q.weight"), config.num_attention_heads),
                   unpermute_qk(deq("blk.0.attn_k.weight"), config.num_key_value_heads), deq("blk.0.attn_v.weight")])
    x = torch.randn(2, 576)
    xq, _ = _quantized_activations(x.numpy())
    y = model.bind()[0].qkv(x)
    expected = torch.from_numpy(xq) @ w.T
    assert (y.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert model.weight_bytes() == sum(t.n_bytes for t in reader.tensors if len(t.shape) == 2 and t.name != "output.weight")


def test_concurrent_callers_get_the_same_bits() -> None:
    """Python threads calling at once (the GIL released): one owns a team, the others run their
    products inline (rust/src/gemv/pool.rs); every answer equals the 1-thread one, bit for bit,
    and no call hangs (each bounded by the executor's timeout)."""
    from concurrent.futures import ThreadPoolExecutor

    mats = {}
    # 1 tile, many, many more; 3 activation rows, and 33 (AMX's groups of 16 where the CPU has them:
    # each thread configures its own tile state)
    for rows, cols, seed, m in ((16, 64, 1, 3), (600, 576, 2, 3), (1536, 576, 3, 3), (160, 576, 4, 33)):
        raw, _ = _gguf("q4_1", rows, cols, seed)
        mats[rows] = (_core.GgufMatrix(raw, rows, cols, "q4_1", f"t{rows}"),
                      np.random.default_rng(seed).standard_normal((m, cols)).astype(np.float32))
    want = {r: mat.matmul(x, threads=1) for r, (mat, x) in mats.items()}

    def call(i: int) -> bool:
        rows = list(mats)[i % len(mats)]
        mat, x = mats[rows]
        return bool(np.array_equal(mat.matmul(x, threads=1 + i % 3), want[rows]))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(call, range(120), timeout=120))


def test_the_engine_hands_its_cpu_threads_to_the_kernel(gguf_model) -> None:
    """Two pools of cpu_threads would fight for the cores (torch's OpenMP workers spin): the
    kernel's team gets them and torch one; a model with no GGUF layer changes nothing."""
    from pagedrs.models import load_model
    from pagedrs.models.gguf_linear import GgufLinearMethod, hand_cpu_threads_to_gemv

    before = torch.get_num_threads()
    try:
        dense = load_model("smollm2-135m", weight_dtype="float32").model
        assert not hand_cpu_threads_to_gemv([dense], 2) and torch.get_num_threads() == before
        model = gguf_model.model
        x = torch.randn(1, 576)
        y1 = model.lm_head(x)
        assert hand_cpu_threads_to_gemv([model], 2) and torch.get_num_threads() == 1
        methods = [m.method for m in model.modules() if isinstance(getattr(m, "method", None), GgufLinearMethod)]
        assert methods and all(m.threads == 2 for m in methods)
        assert torch.equal(model.lm_head(x), y1)  # the same bits on the team of 2
        from pagedrs import Engine, EngineArgs

        torch.set_num_threads(2)
        engine = Engine(EngineArgs(model="smollm2-135m", weight_dtype="gguf", cpu_threads=2, num_gpu_blocks=16))
        assert torch.get_num_threads() == 1  # the executor made the hand-off
        kernel_layers = [m.method for m in engine.loaded.model.modules()
                         if isinstance(getattr(m, "method", None), GgufLinearMethod)]
        assert kernel_layers and all(m.threads == 2 for m in kernel_layers)
    finally:
        for m in gguf_model.model.modules():
            if isinstance(getattr(m, "method", None), GgufLinearMethod):
                m.method.threads = None
        torch.set_num_threads(before)


def test_the_limits_bench_times_the_kernel_on_real_blocks_not_the_dense_fallback() -> None:
    """`bench limits`/`decode` bound gguf rows by this layer's GEMM rate: it must run the GGUF kernel
    on Q4_1 blocks (a dense float32 fallback measured 13 GFLOP/s against the kernel's ~90 at M = 1)."""
    from pagedrs.bench.limits import _layer, random_q4_1_blocks

    n, k = 48, 96
    layer = _layer("gguf", k, n)
    assert layer.gguf_matrix is not None and layer.gguf_matrix.format == "q4_1"
    raw = random_q4_1_blocks(n, k)  # the same seed: the blocks the layer holds
    w = dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q4_1).astype(np.float64)  # gguf-py's reading
    assert w.shape == (n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = layer(x).double().numpy()
    ref = x.double().numpy() @ w.T
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()  # int8 activations: about 1% of the scale
    with pytest.raises(ValueError, match="in_features 40 is not a multiple of the block size 32"):
        random_q4_1_blocks(8, 40)


def test_every_input_layout_gives_the_fast_paths_bits(gguf_model) -> None:
    """The common input (float32, contiguous, no grad) skips detach/float; a strided view, one that
    requires grad and a bfloat16 one take the other path and must give the same bits."""
    layer = gguf_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = layer(x)
    strided = torch.randn(1536, 3).t()  # [3, 1536], not contiguous
    strided.copy_(x)
    assert not strided.is_contiguous()
    with torch.inference_mode():
        assert torch.equal(layer(strided), want)
    assert torch.equal(layer(x.clone().requires_grad_(True)), want)
    xb = x.bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(xb), layer(xb.float()))


# ---- K-quants: the kernel reads llama.cpp's Q6_K and Q4_K as the file stores them ------------------


def _k_quant(qtype: str, rows: int, cols: int, seed: int, random_bytes: bool) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, float64 weights gguf-py dequantizes them to) of a K-quant: a quantized random tensor, or
    blocks whose every code, scale (and minimum) byte is random, with random f16 super-block scales, some
    subnormal and some negative. Q6_K: d at bytes 208-209 of 210; Q3_K: 108-109 of 110; Q4_K (Q5_K): d and dmin at
    bytes 0-3 of 144 (176)."""
    from kquants import quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k

    size, first, count = {"Q6_K": (210, 208, 1), "Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "IQ4_XS": (136, 0, 1),
                          "IQ4_NL": (18, 0, 1), "Q3_K": (110, 108, 1)}[qtype]
    g = np.random.default_rng(seed)
    if random_bytes or qtype.startswith("IQ4"):  # (gguf-py cannot write the IQ4 types: any bytes are valid blocks)
        raw = g.integers(0, 256, (rows * cols // (32 if qtype == "IQ4_NL" else 256), size), dtype=np.uint8)
        d = (g.standard_normal((raw.shape[0], count)) * 1e-3).astype(np.float16)
        d[::7] = np.array([3, 5][:count], dtype=np.uint16).view(np.float16)  # subnormal
        raw[:, first:first + 2 * count] = d.view(np.uint8).reshape(-1, 2 * count)
    else:
        quantizer = {"Q6_K": quantize_q6_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q3_K": quantize_q3_k}[qtype]
        raw = quantizer((g.standard_normal((rows, cols)) * 0.05).astype(np.float32))
    raw = raw.reshape(rows, -1)
    return raw.reshape(-1), dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64).reshape(rows, cols)


# Bytes a row of 256 weights streams: Q6_K 7 bits a weight (the file: 6.5625, d repeated per block of 32),
# Q4_K at most 4.625 (as the file, d and dmin once per super-block; Q4_1 took 5), Q5_K 5.625 (the file: 5.5).
# IQ4_NL 4.5 (the file's blocks), IQ4_XS 4.3125 (the file: 4.25; d and the 8 scales as bytes per super-block).
# Q3_K 3.5625 (the file: 3.4375; d once a super-block, the 16 group scales as bytes).
STREAMED_PER_256 = {"Q6_K": 224, "Q4_K": 148, "Q5_K": 180, "IQ4_NL": 144, "IQ4_XS": 138, "Q3_K": 114}


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K", "Q5_K", "IQ4_XS", "IQ4_NL", "Q3_K"])
@pytest.mark.parametrize("random_bytes", [False, True])
@pytest.mark.parametrize(("rows", "cols", "m"), [(1, 256, 1), (37, 512, 3), (130, 768, 8), (16, 1536, 2),
                                                (37, 256, 17), (50, 512, 33)])
def test_k_quant_kernels_agree_and_match_gguf(qtype: str, rows: int, cols: int, m: int, random_bytes: bool) -> None:
    raw, w = _k_quant(qtype, rows, cols, seed=rows * cols + m, random_bytes=random_bytes)
    mat = _core.GgufMatrix(raw, rows, cols, qtype, "blk.0.ffn_down.weight")
    assert (mat.rows, mat.cols, mat.format) == (rows, cols, qtype.lower())
    assert mat.weight_bytes <= rows * cols // 256 * STREAMED_PER_256[qtype]
    _assert_kernels_agree_within_bound(mat, w, m)


def test_iq4_nl_bad_input_names_the_tensor() -> None:
    raw, _ = _k_quant("IQ4_NL", 4, 512, seed=3, random_bytes=True)
    with pytest.raises(ValueError, match=r'"blk.3.attn_q.weight".*needs 1152 bytes, got 1151'):
        _core.GgufMatrix(raw[:-1], 4, 512, "IQ4_NL", "blk.3.attn_q.weight")
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        _core.GgufMatrix(raw[:18 * 3], 2, 48, "IQ4_NL", "w")
    spoiled = raw.copy()
    spoiled[18 * 17:18 * 17 + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # row 1, block 1
    with pytest.raises(ValueError, match=r'"w": scale field "d" of row 1, block 1 is not finite'):
        _core.GgufMatrix(spoiled, 4, 512, "IQ4_NL", "w")


@pytest.mark.parametrize("qtype, scales", [("Q6_K", (("d", 208),)), ("Q3_K", (("d", 108),)), ("Q4_K", (("d", 0), ("dmin", 2))),
                                           ("Q5_K", (("d", 0), ("dmin", 2))), ("IQ4_XS", (("d", 0),))])
def test_k_quant_bad_input_names_the_tensor(qtype: str, scales: tuple[tuple[str, int], ...]) -> None:
    raw, _ = _k_quant(qtype, 4, 512, seed=3, random_bytes=False)
    row = raw.size // 4
    with pytest.raises(ValueError, match=rf'"blk.3.ffn_down.weight".*needs {raw.size} bytes, got {raw.size - 1}'):
        _core.GgufMatrix(raw[:-1], 4, 512, qtype, "blk.3.ffn_down.weight")
    with pytest.raises(ValueError, match="multiple of 256"):
        _core.GgufMatrix(raw[:row], 7, 288, qtype, "w")
    for field, offset in scales:
        for bad in (np.inf, np.nan):
            spoiled = raw.copy()
            spoiled[row + offset:row + offset + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)  # row 1
            with pytest.raises(ValueError, match=rf'"w": scale field "{field}" of row 1, block 0 is not finite'):
                _core.GgufMatrix(spoiled, 4, 512, qtype, "w")


# ---- a fused product of parts in different formats (a K-quant mix's q / k beside v) ------------------


@pytest.mark.parametrize(("parts", "cols"), [((("q4_0", 40), ("q8_0", 56), ("q4_1", 33)), 96),
                                             ((("Q4_K", 48), ("Q4_K", 16), ("Q6_K", 21)), 512),
                                             ((("q8_0", 7),), 64)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_a_fused_product_is_each_parts_product_bit_for_bit(parts: tuple[tuple[str, int], ...], cols: int, m: int) -> None:
    """Each part writes its own columns (parts that end inside a 16-row tile included), the activations
    quantized once for all: the same bits as each part alone, on every kernel and thread count."""
    mats = []
    for i, (fmt, rows) in enumerate(parts):
        raw = _k_quant(fmt, rows, cols, seed=i, random_bytes=True)[0] if fmt.endswith("_K") else _gguf(fmt, rows, cols, seed=i)[0]
        mats.append(_core.GgufMatrix(raw, rows, cols, fmt, f"part{i}"))
    fused = _core.GgufMatrix.fused(mats, "q+k+v")
    assert (fused.rows, fused.cols, fused.name) == (sum(r for _, r in parts), cols, "q+k+v")
    assert fused.format == "+".join(f.lower() for f, _ in parts)
    assert fused.weight_bytes == sum(p.weight_bytes for p in mats)
    x = np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32)
    for kernel in KERNELS:
        want = np.concatenate([p.matmul(x, threads=1, kernel=kernel) for p in mats], axis=1)
        for threads in (1, 2, 3):
            got = fused.matmul(x, threads=threads, kernel=kernel)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (kernel, threads)


def test_a_fused_product_refuses_parts_that_do_not_fit_naming_them() -> None:
    a = _core.GgufMatrix(_gguf("q8_0", 4, 64, seed=1)[0], 4, 64, "q8_0", "blk.0.attn_q.weight")
    b = _core.GgufMatrix(_gguf("q8_0", 4, 96, seed=2)[0], 4, 96, "q8_0", "blk.0.attn_v.weight")
    with pytest.raises(ValueError, match=r'"q\+v": part "blk.0.attn_v.weight" has 96 columns \(K\); part '
                                         r'"blk.0.attn_q.weight" has 64: fused parts share their input'):
        _core.GgufMatrix.fused([a, b], "q+v")
    with pytest.raises(ValueError, match='"empty": a fused product needs at least one part'):
        _core.GgufMatrix.fused([], "empty")
    fused = _core.GgufMatrix.fused([a, a], "q+q")
    bad = np.ones((2, 64), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match=r'"q\+q".*x\[1, 3\] is NaN or infinite'):
        fused.matmul(bad)
