"""``weight_dtype="q4_0" | "q4_1" | "q8_0"`` (``models/block_quant.py``): any checkpoint quantized at load
into GGUF blocks for the Rust GEMV.

What must hold: every product whose input width is whole blocks holds exactly gguf-py's quantization
of its (rank's) weight, the head Q8_0 under the 4-bit formats, the fused CPU decode runs the model;
narrower layers keep the dense product; two ranks decode what one does; non-finite weights and a CUDA
device are refused by name. Quality on SmolLM2: tests/test_quant.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from engine_runs import greedy_tokens  # noqa: E402
from pagedrs import Engine, EngineArgs, SamplingParams  # noqa: E402
from pagedrs._core import GgufMatrix  # noqa: E402
from pagedrs.models import load_model  # noqa: E402
from pagedrs.models.layers import LinearBase  # noqa: E402
from pagedrs.models.quant import resolve_weight_format  # noqa: E402


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_every_product_holds_gguf_pys_blocks_of_its_weight(tiny_llama_dir, fmt):
    dense = load_model(tiny_llama_dir, weight_dtype="float32")
    quantized = load_model(tiny_llama_dir, weight_dtype=fmt)
    assert quantized.weight_format.name == fmt
    assert quantized.model.fused_cpu_decode is not None  # wholly on the kernel: one Rust call a step
    weights = {n: m.weight.detach() for n, m in dense.model.named_modules() if isinstance(m, LinearBase)}
    g = np.random.default_rng(0)
    for name, layer in quantized.model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        expected_format = "q8_0" if name == "lm_head" else fmt  # the head stays above 4 bits
        matrix = layer.gguf_matrix
        assert matrix.format == expected_format and layer.method.name == expected_format
        w = weights[name].numpy()
        blocks = quantize(w, T[expected_format.upper()])
        x = g.standard_normal((3, w.shape[1])).astype(np.float32)
        reference = GgufMatrix(np.ascontiguousarray(blocks).reshape(-1), w.shape[0], w.shape[1], expected_format)
        np.testing.assert_array_equal(matrix.matmul(x, 1), reference.matmul(x, 1))
        # and that is the product of the quantized weights (the activations' int8 rounding aside)
        exact = x @ dequantize(blocks, T[expected_format.upper()]).T
        assert np.abs(matrix.matmul(x, 1) - exact).max() <= 0.02 * np.abs(exact).max()


def test_two_ranks_quantize_their_shards_and_decode_what_one_rank_does(tiny_llama_dir):
    """Row-parallel shards of 32 columns: each rank's blocks are the blocks one rank has there."""
    pytest.importorskip("psutil")
    prompts = [[5 + (11 * i + 3 * j) % 200 for j in range(3 + 4 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(model=str(tiny_llama_dir), weight_dtype="q8_0", block_size=4, num_gpu_blocks=64, max_model_len=128,
              cpu_threads=1)
    expected = greedy_tokens(Engine(EngineArgs(**kw)), prompts, params)
    two = Engine(EngineArgs(tensor_parallel_size=2, **kw))
    try:
        assert two.executor.loaded.weight_format.name == "q8_0"
        assert greedy_tokens(two, prompts, params) == expected
    finally:
        two.shutdown()


def test_a_layer_without_whole_blocks_keeps_the_dense_product(tmp_path):
    """Hidden 48: q/k/v, o, gate/up and the head read 48 inputs (not whole blocks of 32): dense; down_proj
    reads 128: blocks. The model then runs through torch ops around the kernel (no fused decode)."""
    from conftest import make_tiny_model

    make_tiny_model("llama", tmp_path, hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16)
    loaded = load_model(tmp_path, weight_dtype="q8_0")
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.qkv_proj.gguf_matrix is None and layer.mlp.down_proj.gguf_matrix is not None
    assert loaded.model.fused_cpu_decode is None
    engine = Engine(EngineArgs(model=str(tmp_path), weight_dtype="q8_0", block_size=4, num_gpu_blocks=32,
                               max_model_len=64, cpu_threads=1))
    dense = Engine(EngineArgs(model=str(tmp_path), weight_dtype="float32", block_size=4, num_gpu_blocks=32,
                              max_model_len=64, cpu_threads=1))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert [len(greedy_tokens(e, [[3, 4, 5, 6]], params)[0]) for e in (engine, dense)] == [4, 4]


def test_non_finite_or_too_large_weights_and_a_cuda_device_are_refused_by_name(tmp_path):
    from conftest import make_tiny_model

    model = make_tiny_model("llama", tmp_path)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[7, 3] = float("nan")
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"weight_dtype 'q4_1': MergedColumnParallelLinear \(in=64, out=256\) has a "
                                         r"weight that is not finite in row 135"):
        load_model(tmp_path, weight_dtype="q4_1")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[7, 3] = 1e7  # 1e7 / 127 is past f16's 65504
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"weight_dtype 'q8_0': MergedColumnParallelLinear \(in=64, out=256\) has "
                                         r"weights up to 1e\+07 in row 135, past what the format's f16 scale holds"):
        load_model(tmp_path, weight_dtype="q8_0")
    with pytest.raises(ValueError, match=r"weight_dtype 'q8_0' runs on the CPU only \(device 'cuda'\)"):
        resolve_weight_format("q8_0", torch.float32, gguf_types=None, device=torch.device("cuda"))
