"""models/layers.py and models/quant.py: where checkpoint tensors land, tensor-parallel shards, linear methods.

The tensor-parallel tests build every rank of a layer in one process and check the two
facts a multi-process executor will rely on: column shards concatenate back to the full
weight (and output), and row-parallel partial outputs sum to the full output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedrs.models import quant
from pagedrs.models.config import ModelConfig
from pagedrs.models.layers import (
    ColumnParallelLinear,
    DenseLinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedrs.models.llama import rms_norm
from pagedrs.models.quant import (
    Int4WeightOnlyMethod,
    Int8WeightOnlyMethod,
    WeightFormat,
    nearest_format,
    quantize_int4,
    quantize_int8,
    resolve_weight_format,
)
from pagedrs.models.rotary import Rotary, apply_rotary_

F32 = torch.float32


def _dense() -> DenseLinearMethod:
    return DenseLinearMethod(F32)


def _ranks(cls, *args, tp_size: int = 2, **kwargs):
    return [cls(*args, method=_dense(), tp_rank=r, tp_size=tp_size, **kwargs) for r in range(tp_size)]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_column_parallel_shards_concatenate_to_the_full_weight_and_output(gen):
    w, b, x = torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen), torch.randn(5, 8, generator=gen)
    ranks = _ranks(ColumnParallelLinear, 8, 12, bias=True)
    for layer in ranks:
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
    assert [tuple(r.weight.shape) for r in ranks] == [(6, 8), (6, 8)]
    assert torch.equal(torch.cat([r.weight for r in ranks]), w)
    torch.testing.assert_close(torch.cat([r(x) for r in ranks], dim=-1), F.linear(x, w, b))


def test_row_parallel_partial_outputs_sum_to_the_full_output(gen):
    w, b, x = torch.randn(6, 10, generator=gen), torch.randn(6, generator=gen), torch.randn(4, 10, generator=gen)
    ranks = _ranks(RowParallelLinear, 10, 6, bias=True)
    for layer in ranks:
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
    assert torch.equal(torch.cat([r.weight for r in ranks], dim=1), w)
    # each rank sees its slice of the input features; the bias is added once (rank 0)
    partials = [r(x[:, 5 * i : 5 * (i + 1)]) for i, r in enumerate(ranks)]
    torch.testing.assert_close(partials[0] + partials[1], F.linear(x, w, b))
    torch.testing.assert_close(partials[1], F.linear(x[:, 5:], w[:, 5:]))


def test_merged_gate_up_puts_each_ranks_part_of_every_sibling_side_by_side(gen):
    gate, up, x = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(3, 4, generator=gen)
    ranks = _ranks(MergedColumnParallelLinear, 4, [8, 8])
    for layer in ranks:
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
    assert torch.equal(ranks[0].weight, torch.cat([gate[:4], up[:4]]))
    assert torch.equal(ranks[1].weight, torch.cat([gate[4:], up[4:]]))
    outs = [r(x).chunk(2, dim=-1) for r in ranks]  # (gate part, up part) per rank
    torch.testing.assert_close(torch.cat([g for g, _ in outs], dim=-1), x @ gate.T)
    torch.testing.assert_close(torch.cat([u for _, u in outs], dim=-1), x @ up.T)


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # 1 < tp_size: the KV head is replicated on both ranks
def test_qkv_shards_by_heads(gen, num_kv_heads):
    head_dim, heads, hidden = 3, 4, 5
    q = torch.randn(heads * head_dim, hidden, generator=gen)
    k = torch.randn(num_kv_heads * head_dim, hidden, generator=gen)
    v = torch.randn(num_kv_heads * head_dim, hidden, generator=gen)
    bias = {s: torch.randn(t.shape[0], generator=gen) for s, t in zip("qkv", (q, k, v))}
    ranks = _ranks(QKVParallelLinear, hidden, head_dim, heads, num_kv_heads, bias=True)
    for layer in ranks:
        for shard, t in zip("qkv", (q, k, v)):
            layer.weight_loader(layer.weight, t, shard)
            layer.weight_loader(layer.bias, bias[shard], shard)
    q_parts = [r.weight[: r.q_size] for r in ranks]
    assert torch.equal(torch.cat(q_parts), q)
    k_parts = [r.weight[r.q_size : r.q_size + r.kv_size] for r in ranks]
    v_parts = [r.weight[r.q_size + r.kv_size :] for r in ranks]
    if num_kv_heads == 2:
        assert torch.equal(torch.cat(k_parts), k) and torch.equal(torch.cat(v_parts), v)
    else:
        assert all(torch.equal(p, k) for p in k_parts) and all(torch.equal(p, v) for p in v_parts)
    assert torch.equal(torch.cat([r.bias[: r.q_size] for r in ranks]), bias["q"])


def test_tp_size_one_is_the_whole_fused_tensor(gen):
    q, k, v = (torch.randn(n, 4, generator=gen) for n in (8, 4, 4))
    layer = QKVParallelLinear(4, 2, 4, 2, method=_dense())
    for shard, t in zip("qkv", (q, k, v)):
        layer.weight_loader(layer.weight, t, shard)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))


def test_loader_errors_name_layer_shard_and_shapes():
    layer = QKVParallelLinear(4, 2, 4, 2, method=_dense())
    with pytest.raises(ValueError, match=r"QKVParallelLinear \(shard 'k'\) got a tensor of shape \(6, 4\).*"
                                         r"expects a shard of shape \(4, 4\)"):
        layer.weight_loader(layer.weight, torch.zeros(6, 4), "k")
    with pytest.raises(ValueError, match="shard_id 'x' is not one of 'q', 'k', 'v'"):
        layer.weight_loader(layer.weight, torch.zeros(8, 4), "x")
    merged = MergedColumnParallelLinear(4, [6, 6], method=_dense())
    with pytest.raises(ValueError, match=r"shard_id 2 is not one of 0\.\.1"):
        merged.weight_loader(merged.weight, torch.zeros(6, 4), 2)
    with pytest.raises(ValueError, match="out_features=6 is not divisible by tp_size=4"):
        ColumnParallelLinear(4, 6, method=_dense(), tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank=2, tp_size=2"):
        ReplicatedLinear(4, 4, method=_dense(), tp_rank=2, tp_size=2)


def test_int8_quantization_error_is_at_most_half_a_step(gen):
    w = torch.randn(32, 64, generator=gen) * torch.rand(32, 1, generator=gen)  # rows with different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (32,)
    err = (q.float() * scale.float()[:, None] - w).abs()
    assert (err <= scale.float()[:, None] / 2 + 1e-6).all()


def test_int4_recovers_a_q4_1_grid_exactly(gen):
    """Weights already on a Q4_1 grid (q * scale + min, with 0 and 15 in every group) come back unchanged."""
    n, k, g = 16, 64, 32
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[:, ::g], q[:, 1::g] = 0, 15
    scale = torch.rand(n, k // g, generator=gen) + 0.1
    minimum = torch.randn(n, k // g, generator=gen)
    w = (q.view(n, k // g, g) * scale[..., None] + minimum[..., None]).view(n, k)
    q2, scale2, min2 = quantize_int4(w, g)
    assert torch.equal(q2, q.int())
    torch.testing.assert_close(scale2, scale)
    torch.testing.assert_close(min2, minimum)


@pytest.mark.parametrize("method_cls", [Int8WeightOnlyMethod, Int4WeightOnlyMethod])
def test_quantized_methods_match_their_dequantized_weights(gen, method_cls):
    w, b, x = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen), torch.randn(3, 2, 64, generator=gen)
    layer = ColumnParallelLinear(64, 48, bias=True, method=method_cls(F32))
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.qweight.dtype in (torch.int8, torch.uint8)
    if method_cls is Int8WeightOnlyMethod:
        q, scale = quantize_int8(w)
        deq = q.float() * scale.float()[:, None]
    else:
        q, scale, minimum = quantize_int4(w, quant.INT4_GROUP_SIZE)
        deq = (q.view(48, 2, 32) * scale[..., None] + minimum[..., None]).view(48, 64)
    y = layer(x)
    assert y.dtype == F32 and y.shape == (3, 2, 48)
    ref = F.linear(x, deq, b)
    # the kernels take bf16 activations (and bf16 scales): ~3 significant digits
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 0.02
    assert ((y - F.linear(x, w, b)).abs().max() / ref.abs().max()).item() < (0.03 if method_cls is Int8WeightOnlyMethod
                                                                             else 0.2)


def test_weight_format_picks_methods_and_falls_back_where_int4_cannot_pack():
    fmt = WeightFormat("int4", F32)
    assert isinstance(fmt.method(64, 48), Int4WeightOnlyMethod)
    assert isinstance(fmt.method(64, 40), Int8WeightOnlyMethod)  # 40 output features: not a multiple of 16
    assert isinstance(fmt.method(48, 48), Int8WeightOnlyMethod)  # 48 inputs: not whole groups of 32
    bf16 = WeightFormat("bfloat16", F32).method(4, 4)
    assert isinstance(bf16, DenseLinearMethod) and bf16.weight_dtype == torch.bfloat16


def test_auto_is_exact_for_hf_folders_and_nearest_for_quantized_gguf(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(quant, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: True)
    # every tensor in a format the Rust GEMV reads: the file's own blocks (with or without fast bf16)
    assert resolve_weight_format("auto", F32, gguf_types=["Q4_1"] * 7 + ["Q8_0"], device=cpu).name == "gguf"
    assert resolve_weight_format("auto", F32, gguf_types=["Q4_0", "Q8_0"], device=cpu).name == "gguf"
    assert resolve_weight_format("auto", torch.bfloat16, gguf_types=["Q4_1"], device=cpu).name == "float32"
    # ranks that would split a row-parallel product inside a block: the aten format
    assert resolve_weight_format("auto", F32, gguf_types=["Q4_1"], device=cpu, whole_block_shards=False).name == "int4"
    monkeypatch.setattr(quant, "cpu_runs_gguf_kernel", lambda: False)  # no SIMD kernel: the aten formats
    assert resolve_weight_format("auto", F32, gguf_types=None, device=cpu).name == "float32"
    assert resolve_weight_format("auto", F32, gguf_types=["Q4_1"] * 7 + ["Q8_0"], device=cpu).name == "int4"
    assert resolve_weight_format("auto", F32, gguf_types=["Q8_0", "Q6_K"], device=cpu).name == "int8"
    assert resolve_weight_format("auto", F32, gguf_types=["F16", "F16", "Q8_0"], device=cpu).name == "float32"
    assert resolve_weight_format("float32", F32, gguf_types=["Q4_1"], device=cpu).name == "float32"
    assert resolve_weight_format("bfloat16", F32, gguf_types=None, device=cpu).name == "bfloat16"
    monkeypatch.setattr(quant, "cpu_has_fast_bf16", lambda: False)  # emulated bf16: the exact path is faster
    assert resolve_weight_format("auto", F32, gguf_types=["Q4_1"], device=cpu).name == "float32"
    assert resolve_weight_format("bfloat16", F32, gguf_types=None, device=cpu).name == "float32"
    assert resolve_weight_format("int8", F32, gguf_types=None, device=cpu).name == "int8"  # asked for: honoured
    assert nearest_format([]) == "float32"
    with pytest.raises(ValueError, match="weight_dtype 'int3' is not supported; allowed: auto, float32, bfloat16, int8"):
        resolve_weight_format("int3", F32, gguf_types=None, device=cpu)
    with pytest.raises(ValueError, match="weight_dtype 'int8' runs on the CPU only"):
        resolve_weight_format("int8", F32, gguf_types=None, device=torch.device("cuda"))
    assert resolve_weight_format("gguf", F32, gguf_types=["Q4_1"], device=cpu).name == "gguf"
    with pytest.raises(ValueError, match="weight_dtype 'gguf' runs on the CPU only"):
        resolve_weight_format("gguf", F32, gguf_types=None, device=torch.device("cuda"))


@pytest.mark.parametrize("method_cls", [DenseLinearMethod, Int8WeightOnlyMethod, Int4WeightOnlyMethod])
@pytest.mark.parametrize("bias", [False, True])
def test_bound_closures_compute_what_the_module_computes(gen, method_cls, bias):
    """The forward pass runs over ``bind()`` closures: they must give the module's output, bias and all."""
    w, b, x = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen), torch.randn(5, 64, generator=gen)
    layer = ColumnParallelLinear(64, 48, bias=bias, method=method_cls(F32))
    layer.weight_loader(layer.weight, w)
    if bias:
        layer.weight_loader(layer.bias, b)
    layer.process_weights_after_loading()
    assert torch.equal(layer.bind()(x), layer(x))
    rows = _ranks(RowParallelLinear, 64, 48, bias=True)
    for r in rows:
        r.weight_loader(r.weight, w)
        r.weight_loader(r.bias, b)
    # the bias is rank 0's to add: the partial sums of the other ranks must not carry it again
    assert torch.equal(rows[1].bind()(x[:, 32:]), F.linear(x[:, 32:], w[:, 32:]))
    assert torch.equal(rows[0].bind()(x[:, :32]), F.linear(x[:, :32], w[:, :32], b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_formula_bit_for_bit(gen, dtype):
    """float32 goes through torch.rms_norm (one call): it must be the same bits as transformers' explicit ops."""
    for t, size in ((1, 576), (7, 64), (33, 100)):
        x = (torch.randn(t, size, generator=gen) * 3).to(dtype)
        w = torch.randn(size, generator=gen).to(dtype)
        h = x.float()
        expected = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(rms_norm(x, w, 1e-5), expected)


def test_rotary_in_place_over_query_and_key_heads_is_transformers_rotate_half(gen):
    t, heads, d = 4, 5, 16
    x = torch.randn(t, heads, d, generator=gen)
    angle = torch.randn(t, 1, d // 2, generator=gen)
    cos, sin = angle.cos(), angle.sin()
    cos_full, sin_full = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotate_half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    expected = x * cos_full + rotate_half * sin_full
    fused = torch.randn(t, heads * d + 8, generator=gen)  # heads side by side, then other columns (V)
    fused[:, : heads * d] = x.reshape(t, -1)
    tail = fused[:, heads * d :].clone()
    apply_rotary_(fused[:, : heads * d].view(t, heads, d), cos, sin)
    assert torch.equal(fused[:, : heads * d].view(t, heads, d), expected)
    assert torch.equal(fused[:, heads * d :], tail)  # the view's neighbours are untouched


@pytest.mark.parametrize("head_dim", [64, 24])
def test_rotary_table_gives_the_direct_formulas_bits_inside_and_past_it(head_dim):
    """A step's cos/sin come from the table made on first use; positions past it (here past a
    100-position model) take the direct formula; both are the formula's bits, in any order."""
    config = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 2 * head_dim, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": head_dim, "max_position_embeddings": 100,
        "rope_theta": 500000.0,
    })
    rotary = Rotary(config)
    positions = torch.tensor([99, 0, 37, 5, 6, 98, 1, 64])  # several sequences' tokens, as a step mixes them
    for batch in (positions, positions[:1], positions[3:6], torch.tensor([100, 7, 4000])):
        freqs = batch[:, None].float() * rotary.inv_freq[None, :]
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = rotary(batch, dtype)
            assert cos.shape == sin.shape == (len(batch), 1, head_dim // 2) and cos.dtype == sin.dtype == dtype
            assert torch.equal(cos[:, 0], freqs.cos().to(dtype)) and torch.equal(sin[:, 0], freqs.sin().to(dtype))
    assert rotary._table is not None and rotary._table.shape == (100, 2, head_dim // 2)



@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_float32_cpu_weight_is_column_major_after_loading_and_computes_the_same(gen, rows):
    """MKL's sgemm is slow for 1-3 rows with the checkpoint's row-major weight, so float32 CPU
    weights are stored transposed; ``layer.weight`` keeps its [out, in] shape and values."""
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    layer = ReplicatedLinear(40, 48, bias=True, method=_dense())
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.process_weights_after_loading()
    expect_column_major = torch.backends.mkl.is_available()
    assert (layer.weight.stride() == (1, 48)) == expect_column_major
    assert torch.equal(layer.weight, w) and tuple(layer.weight.shape) == (48, 40)
    torch.testing.assert_close(layer.bind()(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # idempotent, and a reload lands in the stored layout whatever it is
    layer.process_weights_after_loading()
    assert (layer.weight.stride() == (1, 48)) == expect_column_major
    w2 = torch.randn(48, 40, generator=gen)
    layer.weight_loader(layer.weight, w2)
    assert torch.equal(layer.weight, w2)


def test_bfloat16_and_mixed_weights_keep_the_checkpoint_layout(gen):
    """oneDNN's bfloat16 GEMM is slower column-major: only float32 is transposed."""
    for method in (DenseLinearMethod(torch.bfloat16), DenseLinearMethod(F32, torch.bfloat16)):
        layer = ReplicatedLinear(40, 48, method=method)
        layer.weight_loader(layer.weight, torch.randn(48, 40, generator=gen))
        layer.process_weights_after_loading()
        assert layer.weight.is_contiguous()
