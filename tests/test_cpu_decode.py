"""The fused CPU decode (``models/cpu_decode.py``, ``rust/src/cpu_decode``): every layer of a GGUF model
in one Rust call.

What must hold: it computes what the torch ops compute (to float rounding); every row is computed on
its own, so a sequence's logits are the same bits alone or in a batch, on 1 or 2 threads, prefilled
whole or in chunks, decoded plainly or verified speculatively, from a prefix-cache hit or not; fp8 pages
run fused too, by the torch backend's rule; steps it does not cover (a model not wholly on the kernel)
take the torch ops; a malformed step is a
ValueError naming the field, raised before the cache is touched. Quality against float32 is measured
in ``tests/test_quant.py`` (what runs there is this path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_driver import BlockPool, PagedSeq, build_step, greedy_generate
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.model_runner import ModelRunner
from pagedrs.models import load_model
from pagedrs.models.gguf_linear import GgufLinearMethod
from pagedrs.models.layers import LinearBase

pytestmark = pytest.mark.skipif(
    len(__import__("pagedrs._core", fromlist=["gemv_kernels"]).gemv_kernels()) < 2,
    reason="gguf needs a SIMD GEMV kernel on this CPU",
)

BLOCK = 16


@pytest.fixture(scope="module")
def gguf():
    return load_model("smollm2-135m", weight_dtype="gguf")


@pytest.fixture(scope="module")
def token_prompts(gguf):
    tok = gguf.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
             "To make a cup of tea, first boil the water, then",
             "red green blue yellow red green blue yellow red green blue yellow red green blue yellow red green"]  # prompt lookup finds this one
    return [tok.encode(t) for t in texts]


def runner(loaded, blocks: int = 48, **kw) -> ModelRunner:
    return ModelRunner(loaded, num_gpu_blocks=blocks, num_cpu_blocks=0, block_size=BLOCK, **kw)


def set_fused(loaded, on: bool) -> None:
    loaded.model.fused_cpu_decode.enabled = on


def mixed_steps(prompts: list[list[int]], seed: int):
    """A prefill step of every prompt, then a mixed step: one sequence's prompt chunk, the others' decode."""
    pool = BlockPool(48, seed)
    seqs = [PagedSeq(list(p)) for p in prompts]
    first = build_step(seqs[:-1], [len(p) for p in prompts[:-1]], BLOCK, pool)
    for s, p in zip(seqs[:-1], prompts[:-1], strict=True):
        s.num_computed = len(p)
        s.token_ids.append(7)  # any next token
    second = build_step(seqs, [1] * (len(seqs) - 1) + [len(prompts[-1])], BLOCK, pool)
    return first, second


def test_the_model_is_wholly_on_the_kernel_and_runs_fused(gguf):
    fused = gguf.model.fused_cpu_decode
    assert fused is not None and fused.enabled
    assert fused.stack.num_layers == gguf.config.num_hidden_layers
    r = runner(gguf)
    assert not gguf.model.uses_attention_backend(r.kv_views, r.backend)  # the runner skips the torch plan


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer random llama written as a GGUF whose every product is in a kernel format (Q8_0, Q4_0, Q4_1):
    two layers leave the int8 activation rounding no room to compound, so both paths must agree to float
    rounding."""
    from conftest import make_tiny_model
    from gguf_writer import KERNEL_QTYPES, write_gguf

    d = tmp_path_factory.mktemp("tiny-kernel-gguf")
    write_gguf(make_tiny_model("llama", d / "hf"), d / "hf", d / "tiny.gguf", qtypes=KERNEL_QTYPES)
    return load_model(d / "tiny.gguf", weight_dtype="gguf")


@pytest.mark.parametrize("variant", ["plain", "sliding_window", "qkv_bias"])
def test_fused_computes_what_the_torch_ops_compute(tiny_gguf, variant):
    """Same steps (prefills, then decode rows beside a prompt) through both paths from empty caches:
    logits and every written K/V agree to float rounding (measured 3e-7 of the scale); a window
    (Mistral's) and a QKV bias (Qwen2's) change the result and both paths agree on the change."""
    model = tiny_gguf.model
    layers = list(model.model.layers)
    if variant == "sliding_window":
        for layer in layers:
            layer.self_attn.sliding_window = 8
    if variant == "qkv_bias":
        g = torch.Generator().manual_seed(0)
        for layer in layers:
            qkv = layer.self_attn.qkv_proj
            qkv.bias = torch.nn.Parameter(torch.randn(qkv.out_per_rank, generator=g) * 0.3, requires_grad=False)
    model.bind()
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 9, 30)]
    logits, caches = {}, {}
    try:
        for on in (True, False):
            set_fused(tiny_gguf, on)
            r = runner(tiny_gguf)
            first, second = mixed_steps(prompts, seed=3)
            logits[on] = torch.cat([r.execute(first), r.execute(second)])
            caches[on] = r.kv_cache.clone()
    finally:
        for layer in layers:
            layer.self_attn.sliding_window, layer.self_attn.qkv_proj.bias = None, None
        model.bind()
    a, b = logits[True], logits[False]
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert (caches[True] - caches[False]).abs().max() <= 1e-5 * caches[False].abs().max()
    assert (caches[False] != 0).any()
    if variant != "plain":  # the variant took effect: not the plain model's logits
        set_fused(tiny_gguf, True)
        r = runner(tiny_gguf)
        first, second = mixed_steps(prompts, seed=3)
        plain = torch.cat([r.execute(first), r.execute(second)])
        assert (plain - a).abs().max() > 1e-2 * b.abs().max()


def set_threads(loaded, threads: int | None) -> None:
    """The GEMV team size of every layer (what ``hand_cpu_threads_to_gemv`` sets, without touching torch's)."""
    for m in loaded.model.modules():
        if isinstance(m, LinearBase) and isinstance(m.method, GgufLinearMethod):
            m.method.threads = threads


def test_a_row_is_the_same_bits_alone_in_a_batch_and_on_two_threads(gguf, token_prompts):
    batched = {}
    try:
        for threads in (1, 2):
            set_threads(gguf, threads)
            r = runner(gguf)
            first, second = mixed_steps(token_prompts, seed=5)
            r.execute(first)
            batched[threads] = r.execute(second)
    finally:
        set_threads(gguf, None)
    assert torch.equal(batched[1], batched[2])
    p = token_prompts[4]
    alone = runner(gguf).execute(build_step([PagedSeq(list(p))], [len(p)], BLOCK, BlockPool(48)))
    # row 4 of the mixed step is the last prompt's prefill, in a batch with three decode rows
    assert torch.equal(batched[1][4], alone[0])


def test_chunked_prefill_and_shuffled_pages_give_the_same_tokens(gguf, token_prompts):
    whole = greedy_generate(runner(gguf), token_prompts, 8)
    assert greedy_generate(runner(gguf), token_prompts, 8, shuffle_seed=2, chunk_size=5) == whole
    assert [greedy_generate(runner(gguf), [p], 8)[0] for p in token_prompts] == whole


def test_engine_modes_decode_what_a_sequence_decodes_alone(gguf, token_prompts):
    """Prefix caching, chunked prefill and speculative verification rows, in one engine: each request's
    tokens are those of the runner decoding it alone."""
    alone = [greedy_generate(runner(gguf), [p], 12)[0] for p in token_prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "disable_by_batch_size": None}
    engine = Engine(EngineArgs(model="smollm2-135m", weight_dtype="gguf", block_size=BLOCK, num_gpu_blocks=64,
                               swap_space_gb=0.001, max_model_len=256, enable_prefix_caching=True,
                               max_num_batched_tokens=24, speculative_config=spec, cpu_threads=2))
    assert engine.loaded.model.fused_cpu_decode is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for rnd in range(2):  # the second round's prompts hit the prefix cache
        for i, p in enumerate(token_prompts):
            engine.add_request(f"{rnd}-{i}", p, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert [done[f"{rnd}-{i}"] for i in range(len(token_prompts))] == alone, rnd
    stats = engine.stats()
    assert (stats["prefix_hits"], stats["num_failed_steps"]) == (2, 0)  # two prompts fill a block
    assert stats["spec_accepted"] > 0


def test_steps_it_does_not_cover_take_the_torch_ops(gguf):
    r = runner(gguf, kv_cache_dtype=torch.float8_e4m3fn)
    assert not gguf.model.uses_attention_backend(r.kv_views, r.backend)  # fp8 pages run fused (below)
    step = build_step([PagedSeq([1, 2, 3])], [3], BLOCK, BlockPool(48))
    assert torch.isfinite(r.execute(step)).all()
    set_fused(gguf, False)
    try:
        r = runner(gguf)
        assert gguf.model.uses_attention_backend(r.kv_views, r.backend)
    finally:
        set_fused(gguf, True)
    assert load_model("smollm2-135m", weight_dtype="int4").model.fused_cpu_decode is None


@pytest.mark.parametrize(("field", "corrupt", "message"), [
    ("slot_mapping", lambda s: s.slot_mapping.__setitem__(0, s.slot_mapping[0] + 1),
     "slot_mapping: row 0 (sequence 0, position 0) has slot"),
    ("block_tables", lambda s: s.block_tables.__setitem__((0, 0), 10**6), "block_tables: sequence 0, entry 0 is block"),
    ("seq_lens", lambda s: s.seq_lens.__setitem__(0, 10**6), "seq_lens: sequence 0 has length 1000000"),
])
def test_a_malformed_step_is_refused_before_the_cache_is_written(gguf, field, corrupt, message):
    r = runner(gguf)
    step = build_step([PagedSeq([1, 2, 3, 4])], [4], BLOCK, BlockPool(48))
    corrupt(step)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        r.execute(step)
    assert not r.kv_cache.any()  # nothing written


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"kv_dtype": "fp8_e3m4"}, ValueError,
     'kv_dtype: "fp8_e3m4" is unknown; allowed: "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"'),
    ({"kv_dtype": "bfloat16", "cache": np.float32}, TypeError, 'kv_cache: must be a uint16 NumPy array .* "bfloat16"'),
    ({"kv_dtype": "fp8_e4m3", "k_scale": float("nan")}, ValueError, "k_scale is NaN; an fp8 cache's scales must be finite and > 0"),
    ({"kv_dtype": "fp8_e5m2", "v_scale": 0.0}, ValueError, "v_scale is 0; an fp8 cache's scales must be finite and > 0"),
    ({"kv_dtype": "fp8_e4m3", "v_scale": -1.0}, ValueError, "v_scale is -1"),
    ({"kv_dtype": "fp8_e4m3", "cache": np.float32}, TypeError, 'kv_cache: must be a uint8 NumPy array .* "fp8_e4m3"'),
    ({"cache": np.uint8}, TypeError, 'kv_cache: must be a float32 NumPy array for kv_dtype "float32"'),
])
def test_a_bad_cache_format_is_refused_naming_the_field_before_a_write(tiny_gguf, change, error, message):
    """The stack's cache arguments, called directly: each bad one is an error naming it, and the cache
    is untouched."""
    fused = tiny_gguf.model.fused_cpu_decode
    config = tiny_gguf.config
    layers, kv_heads, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    cache = np.zeros((layers, 2, 4, BLOCK, kv_heads, d), dtype=change.get("cache", np.uint8
                                                                          if "kv_dtype" in change else np.float32))
    kw = {k: v for k, v in change.items() if k != "cache"}
    h = np.ones((1, config.hidden_size), dtype=np.float32)
    cos_sin = np.ones((1, 2, d // 2), dtype=np.float32)
    with pytest.raises(error, match=message):
        fused.stack.forward(h, cos_sin, cache, np.zeros(1, np.int64), np.array([0, 1], np.int32),
                            np.ones(1, np.int32), np.zeros((1, 1), np.int32), **kw)
    assert not cache.any()


def test_a_non_finite_activation_names_the_tensor(gguf):
    r = runner(gguf)
    step = build_step([PagedSeq([1, 2])], [2], BLOCK, BlockPool(48))
    table = gguf.model.model.embed_tokens  # the tied head's Q8_0 rows (a head's matrix refuses a NaN scale at
    head = table.head  # load, so the NaN is put into the rows it gives): token 2's first value NaN
    assert head is not None

    class NanRow:
        def dequantize_rows(self, ids: np.ndarray) -> np.ndarray:
            rows = head.dequantize_rows(ids)
            rows[ids == 2, 0] = np.nan
            return rows

    table.head = NanRow()
    try:
        with pytest.raises(ValueError, match=r"tensor .*q_proj.* is NaN or infinite"):
            r.execute(step)
    finally:
        table.head = head


def test_a_stack_whose_weights_do_not_fit_its_geometry_is_refused_naming_the_layer(tiny_gguf):
    from pagedrs._core import DecodeStack

    model = tiny_gguf.model
    layer = model.model.layers[0]
    c = model.config
    norm = layer.input_layernorm.weight.numpy()
    kw = dict(input_norms=[norm], post_norms=[norm], qkv=[layer.self_attn.qkv_proj.gguf_matrix], qkv_bias=[None],
              o=[layer.self_attn.o_proj.gguf_matrix], gate_up=[layer.mlp.gate_up_proj.gguf_matrix],
              down=[layer.mlp.down_proj.gguf_matrix], sliding_windows=[None], hidden=c.hidden_size,
              heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
              intermediate=c.intermediate_size, eps=c.rms_norm_eps, scale=0.25)
    assert DecodeStack(**kw).num_layers == 1
    bad = {
        "o": ([layer.mlp.down_proj.gguf_matrix], r"layers\[0\]\.o: tensor .* is \[64, 128\]; the geometry needs \[64, 64\]"),
        "post_norms": ([norm[:3].copy()], r"layers\[0\]\.post_norm: has 3 values; the geometry needs 64"),
        "sliding_windows": ([0], r"layers\[0\]\.sliding_window: is 0"),
        "down": ([], r"down: has 0 entries; qkv has 1"),
        "kv_heads": (3, "heads: 4 query heads, 3 kv heads"),
        "eps": (float("nan"), "eps: eps NaN"),
        "final_norm": (norm[:5].copy(), r"final_norm: has 5 values; the geometry needs 64"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            DecodeStack(**{**kw, field: value})
    with pytest.raises(ValueError, match=r"layers\[0\]\.input_norm: value 1 is NaN"):
        nan = norm.copy()
        nan[1] = float("nan")
        DecodeStack(**{**kw, "input_norms": [nan]})
    with pytest.raises(ValueError, match=r"final_norm: value 2 is inf"):
        inf = norm.copy()
        inf[2] = float("inf")
        DecodeStack(**{**kw, "final_norm": inf})
    assert not DecodeStack(**kw).has_final_norm and DecodeStack(**{**kw, "final_norm": norm}).has_final_norm


def test_the_stack_applies_the_final_norm_it_holds(tiny_gguf):
    """A model's stack holds its final norm: the stack's rows are the torch norm of what a stack
    without it returns (to float rounding: the Rust norm sums in its own order)."""
    from pagedrs._core import DecodeStack

    model = tiny_gguf.model
    fused = model.fused_cpu_decode
    assert fused is not None and fused.stack.has_final_norm
    layers = list(model.model.layers)
    c = model.config

    def f32(t):
        return np.ascontiguousarray(t.detach().float().numpy())

    kw = dict(input_norms=[f32(x.input_layernorm.weight) for x in layers],
              post_norms=[f32(x.post_attention_layernorm.weight) for x in layers],
              qkv=[x.self_attn.qkv_proj.gguf_matrix for x in layers], qkv_bias=[None] * len(layers),
              o=[x.self_attn.o_proj.gguf_matrix for x in layers], gate_up=[x.mlp.gate_up_proj.gguf_matrix for x in layers],
              down=[x.mlp.down_proj.gguf_matrix for x in layers], sliding_windows=[None] * len(layers),
              hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
              intermediate=c.intermediate_size, eps=c.rms_norm_eps, scale=c.head_dim**-0.5)
    norm = model.model.norm
    outs = {}
    for with_norm in (False, True):
        stack = DecodeStack(**kw, **({"final_norm": f32(norm.weight)} if with_norm else {}))
        kv = np.zeros((len(layers), 2, 4, 16, c.num_key_value_heads, c.head_dim), dtype=np.float32)
        rng = np.random.default_rng(0)
        h = rng.standard_normal((3, c.hidden_size)).astype(np.float32)
        cs = model.rotary.cos_sin_rows(torch.arange(3)).numpy()
        outs[with_norm] = stack.forward(h, cs, kv, np.arange(3, dtype=np.int64), np.array([0, 3], dtype=np.int32),
                                        np.array([3], dtype=np.int32), np.zeros((1, 1), dtype=np.int32))
    want = torch.rms_norm(torch.from_numpy(outs[False]), (c.hidden_size,), norm.weight.float(), norm.eps)
    got = torch.from_numpy(outs[True])
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got - torch.from_numpy(outs[False])).abs().max() > 1e-2  # the norm took effect


def test_a_step_that_fails_after_the_stack_wrote_its_pages_caches_none_of_them(gguf, token_prompts, monkeypatch):
    """The stack writes every layer's K/V, then the step fails (what a later raise in the step does): the
    engine's never-wrong rule still holds for pages the fused path wrote, so the same prompt again is no
    prefix hit and decodes what the runner decodes alone."""
    p = token_prompts[2] + token_prompts[4]  # 3 blocks of 16
    alone = greedy_generate(runner(gguf), [p], 6)[0]
    engine = Engine(EngineArgs(model="smollm2-135m", weight_dtype="gguf", block_size=BLOCK, num_gpu_blocks=32,
                               swap_space_gb=0.001, max_model_len=128, enable_prefix_caching=True))
    fused = engine.loaded.model.fused_cpu_decode
    real, calls = fused.run_stack, {"n": 0}

    def run_stack(*args):
        out = real(*args)  # the pages are written
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: failed after the fused layers")
        return out

    monkeypatch.setattr(fused, "run_stack", run_stack)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    done = {}
    for rid in ("a", "b"):
        engine.add_request(rid, p, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[rid] = out
    assert "injected" in done["a"].error
    assert done["b"].error is None and done["b"].outputs[0].token_ids == alone
    stats = engine.stats()
    assert (stats["prefix_hits"], stats["num_failed_steps"]) == (0, 1)
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def test_the_runner_hands_the_stack_the_step_arrays_with_the_model_paths_bits(tiny_gguf, monkeypatch):
    """The runner's direct path (``step_hidden``: embeddings and rotary rows by NumPy ``take``, no
    metadata) gives the bits of the model's path (``F.embedding``, torch rotary rows, metadata),
    logits and pages, on a prefill and on a mixed step with prompt rows."""
    model = tiny_gguf.model
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 9, 30)]
    calls = {"direct": 0}
    real = model.step_hidden

    def counted(*args):
        out = real(*args)
        calls["direct"] += out is not None
        return out

    logits, caches = {}, {}
    for direct in (True, False):
        monkeypatch.setattr(model, "step_hidden", counted if direct else (lambda *args: None))
        r = runner(tiny_gguf)
        first, second = mixed_steps(prompts, seed=5)
        logits[direct] = torch.cat([r.execute(first), r.execute(second)])
        caches[direct] = r.kv_cache.clone()
    assert calls["direct"] == 2
    assert torch.equal(logits[True], logits[False])
    assert torch.equal(caches[True], caches[False]) and (caches[True] != 0).any()


def test_a_token_outside_the_vocabulary_is_refused_before_a_page_is_written(tiny_gguf):
    from pagedrs.step_input import StepInput

    r = runner(tiny_gguf)
    vocab = tiny_gguf.model.config.vocab_size
    pool = BlockPool(48, 2)
    step = build_step([PagedSeq([3, 4, 5])], [3], BLOCK, pool)
    for bad in (vocab, -1, 2**40):
        ids = step.input_ids.copy()
        ids[1] = bad
        with pytest.raises(ValueError, match=rf"input_ids: token {bad} is outside the vocabulary; allowed 0 to {vocab - 1}"):
            r.execute(StepInput(**{**step.__dict__, "input_ids": ids}))
        assert not (r.kv_cache != 0).any()


def test_numpy_rotary_rows_equal_the_torch_rows_inside_and_past_the_table(tiny_gguf):
    rotary = tiny_gguf.model.rotary
    for positions in ([0, 5, 17], [rotary.table_positions - 1, rotary.table_positions + 3], [2], [-1, 4]):
        p = np.array(positions, dtype=np.int64)
        want = rotary.cos_sin_rows(torch.from_numpy(p)).numpy()
        for _ in range(2):  # the first call may build the table
            got = rotary.cos_sin_rows_np(p)
            assert got.dtype == np.float32 and got.flags.c_contiguous and np.array_equal(got, want)


def test_each_runner_s_steps_write_its_own_cache(tiny_gguf):
    """The stack finds the runner's whole cache once per views list (``FusedCpuDecode._memo``): two
    runners of one model, stepped in turn, each write their own pages, never the other's."""
    first_step, _ = mixed_steps([list(range(3, 3 + n)) for n in (5, 20)], seed=3)
    a, b = runner(tiny_gguf), runner(tiny_gguf)
    want = a.execute(first_step)
    assert (a.kv_cache != 0).any() and not (b.kv_cache != 0).any(), "a's step wrote b's pages"
    assert torch.equal(b.execute(first_step), want)
    assert torch.equal(b.kv_cache, a.kv_cache), "b's step wrote somewhere else"
    c = runner(tiny_gguf)  # a third, after the memo holds b's views
    a.kv_cache.zero_()
    assert torch.equal(a.execute(first_step), want) and torch.equal(a.kv_cache, b.kv_cache)
    assert not (c.kv_cache != 0).any()


def test_value_bounds_of_step_arrays():
    from pagedrs.step_input import value_bounds

    assert value_bounds(np.array([], dtype=np.int64)) == (0, 0)
    assert value_bounds(np.array([7], dtype=np.int32)) == (7, 7)
    assert value_bounds(np.array([5, -3, 2**40], dtype=np.int64)) == (-3, 2**40)
    big = np.arange(1000, dtype=np.int64)[::-1].copy()
    big[500] = -9
    lo, hi = value_bounds(big)
    assert (lo, hi) == (-9, 999) and type(lo) is int and type(hi) is int


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_fp8_pages_run_fused_and_compute_what_the_torch_ops_compute(tiny_gguf, kv_dtype):
    """An fp8 or bfloat16 cache runs fused too (before, every step took the torch ops): the same steps
    through both paths from empty caches write the same codes (where the two paths' K/V, equal to float
    rounding, could straddle a rounding boundary, a neighbouring code) and their logits agree to
    float rounding. Each path reads the other's pages: the rule is one (``attention.kv_quant``; for
    bfloat16, torch's rounding to nearest even, ``cpu_decode/kv_bf16.rs``)."""
    from pagedrs.attention.kv_quant import KV_CACHE_DTYPES

    dtype = KV_CACHE_DTYPES[kv_dtype]
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 9, 30)]
    logits, caches = {}, {}
    try:
        for on in (True, False):
            set_fused(tiny_gguf, on)
            r = runner(tiny_gguf, kv_cache_dtype=dtype)
            assert tiny_gguf.model.uses_attention_backend(r.kv_views, r.backend) is not on
            first, second = mixed_steps(prompts, seed=3)
            logits[on] = torch.cat([r.execute(first), r.execute(second)])
            caches[on] = r.kv_cache.view(torch.int16 if dtype == torch.bfloat16 else torch.uint8).clone()
    finally:
        set_fused(tiny_gguf, True)
    a, b = caches[True], caches[False]
    assert (b != 0).any()
    differ = a != b
    assert differ.float().mean() < 0.01, f"{differ.float().mean():.4f} of the codes differ"
    # a differing code is a neighbour (same sign, magnitude one step away)
    assert ((a[differ].int() - b[differ].int()).abs() == 1).all()
    # measured: no code differs and the logits agree to 2.7e-7 of the scale, as with float32 pages
    bound = 1e-5 if not differ.any() else 0.05
    assert (logits[True] - logits[False]).abs().max() <= bound * logits[False].abs().max()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_fp8_pages_written_by_one_path_read_the_same_in_the_other(tiny_gguf, dtype):
    """A prefill through the torch ops, then a decode step fused over its pages, equals the same
    decode step through the torch ops over the same pages (to the two paths' float rounding, far
    below one fp8 or bfloat16 step): the fused path reads the torch path's codes as the torch path does."""
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 9, 30)]
    out = {}
    try:
        for fused_decode in (True, False):
            set_fused(tiny_gguf, False)
            r = runner(tiny_gguf, kv_cache_dtype=dtype)
            first, second = mixed_steps(prompts, seed=4)
            r.execute(first)
            set_fused(tiny_gguf, fused_decode)
            out[fused_decode] = r.execute(second)
    finally:
        set_fused(tiny_gguf, True)
    assert (out[True] - out[False]).abs().max() <= 1e-5 * out[False].abs().max()  # measured 3.0e-7
