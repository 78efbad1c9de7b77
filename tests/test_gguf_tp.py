"""``weight_dtype="gguf"`` under tensor parallelism: each rank repacks its own shard of the file's blocks.

What must hold: a rank's column-parallel matrix gives, bit for bit, the rows of one rank's product that
the dense loader gives that rank (the row map is read off the dense shards, not recomputed here); the
row-parallel partial sums add up to one rank's product (only the order of the blocks' sums differs);
engines on 2 and 3 ranks decode the tokens one rank does, tiny models and the embedded SmolLM2; a split
inside a block of 32 columns is refused by name, and ``auto`` then keeps to the aten formats.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_runs import final_outputs, greedy_tokens
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.distributed.parallel_state import set_tensor_parallel
from pagedrs.models import load_model
from pagedrs.models.gguf_linear import GgufLinearMethod, shards_hold_whole_blocks
from pagedrs.models.layers import LinearBase, RowParallelLinear

pytest.importorskip("gguf")
psutil = pytest.importorskip("psutil")  # the engine tests spawn ranks (test_tensor_parallel.py's needs)

BASE = dict(block_size=4, num_gpu_blocks=64, max_model_len=128, swap_space_gb=0.001, cpu_threads=1)


@pytest.fixture(scope="module", params=["llama", "mistral", "llama-mixed"])
def kernel_gguf(request, tmp_path_factory) -> Path:
    """A 2-layer random model as a GGUF whose every product is in a kernel format: llama (2 KV heads,
    split over 2 ranks), mistral's shape (1 KV head, replicated on both), and llama with q, k and v in
    three types (one fused product of three parts, each rank holding its rows of each)."""
    import gguf

    from conftest import make_tiny_model
    from gguf_writer import KERNEL_QTYPES, write_gguf

    arch, _, mixed = request.param.partition("-")
    qtypes = dict(KERNEL_QTYPES)
    if mixed:
        T = gguf.GGMLQuantizationType
        qtypes.update(attn_q=T.Q4_0, attn_k=T.Q8_0, attn_v=T.Q4_1, ffn_gate=T.Q8_0, ffn_up=T.Q4_0)
    d = tmp_path_factory.mktemp(f"tp-gguf-{request.param}")
    write_gguf(make_tiny_model(arch, d / "hf"), d / "hf", d / "tiny.gguf", qtypes=qtypes)
    return d / "tiny.gguf"


def load_rank(path: Path, rank: int, size: int, weight_dtype: str):
    set_tensor_parallel(rank, size)
    try:
        return load_model(path, weight_dtype=weight_dtype)
    finally:
        set_tensor_parallel(0, 1)


def linears(loaded) -> dict[str, LinearBase]:
    return {n: m for n, m in loaded.model.named_modules() if isinstance(m, LinearBase)}


def matmul(layer: LinearBase, x: np.ndarray) -> np.ndarray:
    return layer.gguf_matrix.matmul(np.ascontiguousarray(x), 1)


def test_each_rank_multiplies_its_shard_of_the_files_blocks(kernel_gguf):
    one, one_dense = linears(load_rank(kernel_gguf, 0, 1, "gguf")), linears(load_rank(kernel_gguf, 0, 1, "float32"))
    ranks = [linears(load_rank(kernel_gguf, r, 2, "gguf")) for r in range(2)]
    dense = [linears(load_rank(kernel_gguf, r, 2, "float32")) for r in range(2)]
    g = np.random.default_rng(0)
    on_kernel = [n for n, m in one.items() if getattr(m, "gguf_matrix", None) is not None]
    assert {n.rsplit(".", 1)[-1] for n in on_kernel} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for name in on_kernel:
        full = one[name]
        x = g.standard_normal((3, full.in_features)).astype(np.float32)
        expected = matmul(full, x)
        if isinstance(full, RowParallelLinear):
            partials = []
            for r in range(2):
                w = dense[r][name].weight.detach()
                # the columns this rank holds, found in the dense shard (the loader's own slice)
                first = next(c for c in range(full.in_features - w.shape[1] + 1)
                             if torch.equal(one_dense[name].weight[:, c:c + w.shape[1]], w))
                assert ranks[r][name].gguf_matrix.cols == w.shape[1] == full.in_features // 2
                partials.append(matmul(ranks[r][name], x[:, first:first + w.shape[1]]))
            np.testing.assert_allclose(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
            assert np.abs(partials[0] - expected).max() > 1e-2 * np.abs(expected).max()  # a partial, not the whole
        else:
            for r in range(2):
                w = dense[r][name].weight.detach()
                # each of this rank's rows is a row of the whole weight: its index there
                rows = [int(torch.nonzero((one_dense[name].weight == row).all(dim=1))[0]) for row in w]
                assert ranks[r][name].gguf_matrix.rows == w.shape[0]
                np.testing.assert_array_equal(matmul(ranks[r][name], x), expected[:, rows])


def tokens_and_logprobs(outs) -> tuple[list[list[int]], list[list[float]]]:
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[float(step[t]) for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
           for o in outs]
    return toks, lps


def test_two_ranks_decode_what_one_rank_does(kernel_gguf):
    """Prefix caching and chunked prefill on: the same greedy tokens, each chosen token's logprob equal
    to float rounding (the partial sums are added in another order) at almost every position.

    Not at every one: the kernel quantizes each layer's input activations to int8 per block of 32, so
    a rounding-order difference of ~1e-7 flips an activation's code where its value sits on a rounding
    boundary, and that one code's step (1/127 of its block's largest value) moves the logprobs by up to
    ~1e-2. On an Intel Xeon 2 of these 50 positions moved by 0.0067 (the 48 others by < 1e-6), and the
    same comparison with float32 weights (no activation quantization) agreed within 4e-6 everywhere."""
    prefix = [7 + (3 * i) % 200 for i in range(9)]
    prompts = [prefix + [20 + (i * 13 + j * 7) % 250 for j in range(3 + (5 * i) % 17)] for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    kw = dict(BASE, model=str(kernel_gguf), weight_dtype="gguf", enable_prefix_caching=True,
              max_num_batched_tokens=16)
    one = Engine(EngineArgs(**kw))
    assert one.executor.loaded.weight_format.name == "gguf"
    expected_toks, expected_lps = tokens_and_logprobs(final_outputs(one, prompts, params))
    two = Engine(EngineArgs(tensor_parallel_size=2, **kw))
    try:
        toks, lps = tokens_and_logprobs(final_outputs(two, prompts, params))
        stats = two.stats()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    finally:
        two.shutdown()
    assert toks == expected_toks
    diff = np.abs(np.array(lps) - np.array(expected_lps))
    assert (diff > 1e-4).mean() <= 0.1, diff  # float rounding almost everywhere
    assert diff.max() < 2e-2, diff  # and at most an activation code's step elsewhere


def test_the_embedded_smollm2_on_three_ranks_picks_gguf_and_decodes_what_one_rank_does():
    """9 heads and 3 KV heads on 3 ranks: 192 and 512 columns a rank for o_proj and down_proj, whole
    blocks, so ``auto`` keeps the file's Q4_1 / Q8_0 blocks on every rank."""
    kw = dict(model="smollm2-135m", block_size=16, num_gpu_blocks=64, max_model_len=256, cpu_threads=1)
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = Engine(EngineArgs(**kw))
    assert one.executor.loaded.weight_format.name == "gguf"
    expected = greedy_tokens(one, prompts, params)
    del one
    engine = Engine(EngineArgs(tensor_parallel_size=3, **kw))
    try:
        assert engine.executor.loaded.weight_format.name == "gguf"
        got = greedy_tokens(engine, prompts, params)
    finally:
        engine.shutdown()
    assert got == expected


def test_a_split_inside_a_block_is_refused_by_name_and_auto_keeps_to_aten(kernel_gguf, monkeypatch):
    """4 ranks give o_proj 16 of its 64 input columns each: half a block of 32."""
    config = dict(num_attention_heads=4, head_dim=16, hidden_size=64, intermediate_size=128)
    assert shards_hold_whole_blocks(config, 2) and not shards_hold_whole_blocks(config, 4)
    assert not shards_hold_whole_blocks(config, 3)  # 64 columns do not split in 3
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: GGUF tensor 'model\.layers\.0\.self_attn\.o_proj\.weight' "
                                         r"\(Q4_0, 64 columns\) would be split at column 0 into 16 columns a rank"):
        load_rank(kernel_gguf, 0, 4, "gguf")
    from pagedrs.models import quant

    monkeypatch.setattr(quant, "cpu_has_fast_bf16", lambda: True)
    from pagedrs.models.gguf_loader import linear_tensor_types

    loaded = load_rank(kernel_gguf, 1, 4, "auto")
    # the file's most common type: Q8_0 -> int8; Q4_0 (the mixed file) -> int4, whose o_proj shard of 16
    # columns (half a group of 32) runs int8 (it failed in the quantizer)
    assert loaded.weight_format.name == quant.nearest_format(linear_tensor_types(kernel_gguf))
    methods = {n.rsplit(".", 1)[-1]: m.method.name for n, m in linears(loaded).items()}
    assert methods["o_proj"] == "int8" and methods["down_proj"] == loaded.weight_format.name
    assert not any(isinstance(m.method, GgufLinearMethod) for m in linears(loaded).values())
    x = torch.randn(2, 64)
    layer = linears(loaded)["model.layers.0.self_attn.o_proj"]
    assert torch.isfinite(layer(x[:, :layer.in_per_rank])).all()
    assert load_rank(kernel_gguf, 1, 2, "auto").weight_format.name == "gguf"


@pytest.mark.parametrize("qtype, intermediate, per_rank_format", [
    ("Q6_K", 512, "q6_k"), ("Q6_K", 768, "q8_0"), ("Q4_K", 512, "q4_k"), ("Q4_K", 768, "q4_1"),
    ("Q5_K", 512, "q5_k"), ("Q5_K", 768, "q5_1"), ("IQ4_XS", 512, "iq4_xs"), ("IQ4_XS", 768, "iq4_nl")])
def test_a_k_quant_row_shard_that_would_cut_a_super_block_runs_per_block_of_32(tmp_path, qtype, intermediate,
                                                                               per_rank_format):
    """K-quant scales span 256 columns: down_proj's 256 columns a rank stay in the file's type; 384 a rank
    (whole blocks of 32, not of 256) run that layer in Q8_0 (Q6_K, requantized), Q4_1 (Q4_K), Q5_1 (Q5_K) or
    IQ4_NL (IQ4_XS: their scales rounded to f16) rather than being refused; the partial sums still add up to one rank's product within
    that conversion's error."""
    import gguf

    from conftest import make_tiny_model
    from gguf_writer import KERNEL_QTYPES, write_gguf

    model = make_tiny_model("llama", tmp_path / "hf", hidden_size=256, intermediate_size=intermediate,
                            num_attention_heads=4, head_dim=64)
    path = tmp_path / "q6k.gguf"
    write_gguf(model, tmp_path / "hf", path, qtypes={**KERNEL_QTYPES, "ffn_down": gguf.GGMLQuantizationType[qtype]})
    name = "model.layers.0.mlp.down_proj"
    one = linears(load_rank(path, 0, 1, "gguf"))[name]
    ranks = [linears(load_rank(path, r, 2, "gguf"))[name] for r in range(2)]
    assert one.gguf_matrix.format == qtype.lower()
    assert [r.gguf_matrix.format for r in ranks] == [per_rank_format] * 2
    x = np.random.default_rng(1).standard_normal((2, intermediate)).astype(np.float32)
    half = intermediate // 2
    total = matmul(ranks[0], x[:, :half]) + matmul(ranks[1], x[:, half:])
    expected = matmul(one, x)
    tolerance = 1e-5 if per_rank_format == qtype.lower() else 2e-2
    np.testing.assert_allclose(total, expected, rtol=0, atol=tolerance * np.abs(expected).max())
