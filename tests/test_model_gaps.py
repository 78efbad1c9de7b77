"""The model gaps a new user hits (issue 16): tokenizer-less folders, Llama 3 GGUF, sliding window."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from conftest import TINY_CONFIGS, make_tiny_model
from pagedrs import LLM, SamplingParams
from pagedrs.tokenizer import TOKENIZER_FILES

ENGINE_KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256, max_num_batched_tokens=64)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(folder: Path | str, prompts: list[list[int]], max_new_tokens: int, **load_kw) -> list[list[int]]:
    """transformers ``generate``, one prompt at a time, EOS disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32, **load_kw)
    model.eval().generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


# ---- a folder without tokenizer files ----------------------------------------------------


@pytest.fixture(scope="module")
def bare_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny Llama with config + safetensors only."""
    folder = tmp_path_factory.mktemp("bare-llama")
    for f in tiny_llama_dir.iterdir():
        if f.name not in TOKENIZER_FILES and f.name != "special_tokens_map.json" and f.name != "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    assert not any((folder / n).exists() for n in TOKENIZER_FILES)
    return folder


def test_folder_without_tokenizer_names_the_option(bare_dir: Path) -> None:
    with pytest.raises(ValueError, match="has no tokenizer files.*skip_tokenizer_init=True"):
        LLM(model=str(bare_dir), **ENGINE_KW)


def test_skip_tokenizer_init_generates_the_same_token_ids(bare_dir: Path, tiny_llama_dir: Path) -> None:
    full = LLM(model=str(tiny_llama_dir), **ENGINE_KW)
    bare = LLM(model=str(bare_dir), skip_tokenizer_init=True, **ENGINE_KW)
    prompts = [{"prompt_token_ids": p} for p in _prompts(full.engine.loaded.config.vocab_size, [5, 11, 3])]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = full.generate(prompts, params, use_tqdm=False)
    got = bare.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) > 0 and o.outputs[0].text == "" for o in got)
    assert all(o.outputs[0].text != "" for o in want)  # the comparison's texts are not trivially empty
    # EOS comes from the config: a sample that hits it stops as with a tokenizer
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]


def test_skip_tokenizer_init_never_steps_a_detokenizer(bare_dir: Path, tiny_llama_dir: Path, monkeypatch) -> None:
    """Without a tokenizer every text is "": the front end makes none (vLLM's detokenize=False), in every
    output kind, and the token ids, logprobs and finishes are the ones the full tokenizer's engine gives."""
    import dataclasses

    from pagedrs import Engine, EngineArgs, RequestOutputKind
    from pagedrs.tokenizer import IncrementalDetokenizer

    prompts = _prompts(32, [5, 11, 3])
    base = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)

    def run(folder: Path, **kw: object) -> list[list]:
        engine = Engine(EngineArgs(model=str(folder), **ENGINE_KW, **kw))
        got = []
        for kind in RequestOutputKind:
            for i, p in enumerate(prompts):
                engine.add_request(f"{kind.name}{i}", {"prompt_token_ids": p}, dataclasses.replace(base, output_kind=kind))
            while engine.has_unfinished():
                got += [(o.request_id, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.text)
                        for o in engine.step() for c in o.outputs]
        engine.shutdown()
        return got

    want = run(tiny_llama_dir)
    monkeypatch.setattr(IncrementalDetokenizer, "step", lambda self, ids: 1 / 0)
    monkeypatch.setattr(IncrementalDetokenizer, "finish_at_once", lambda self, ids: 1 / 0)
    got = run(bare_dir, skip_tokenizer_init=True)
    assert [g[:5] for g in got] == [w[:5] for w in want] and all(g[5] == "" for g in got)
    assert any(w[5] for w in want)


def test_skip_tokenizer_init_refuses_text_chat_and_stop_strings(bare_dir: Path) -> None:
    llm = LLM(model=str(bare_dir), skip_tokenizer_init=True, **ENGINE_KW)
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer.*skip_tokenizer_init"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="a chat conversation needs a tokenizer.*skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_server_without_tokenizer_takes_token_ids_and_refuses_text(bare_dir: Path) -> None:
    pytest.importorskip("fastapi")
    from server_fakes import live_server

    kw = dict(ENGINE_KW, skip_tokenizer_init=True)
    with live_server(bare_dir, kw, "bare") as live:
        base = live.url.rstrip("/") + "/v1"
        ok = httpx.post(f"{base}/completions", json={"model": "bare", "prompt": [5, 6, 7], "max_tokens": 4,
                                                     "temperature": 0.0}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == ""
        assert ok.json()["usage"]["completion_tokens"] == 4
        text = httpx.post(f"{base}/completions", json={"model": "bare", "prompt": "hello", "max_tokens": 4}, timeout=60)
        assert text.status_code == 400, text.text
        assert "skip_tokenizer_init" in text.json()["error"]["message"]
        chat = httpx.post(f"{base}/chat/completions", json={"model": "bare", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert chat.status_code == 400, chat.text
        assert "skip_tokenizer_init" in chat.json()["error"]["message"]


def test_engine_core_process_without_tokenizer(bare_dir: Path, tiny_llama_dir: Path) -> None:
    """`pagedrs serve` runs the engine in its own process; the API side then has no tokenizer either."""
    pytest.importorskip("fastapi")
    from pagedrs import EngineArgs
    from pagedrs.server.engine_core import RemoteEngine
    from pagedrs.tokenizer import TokenIdsOnly

    remote = RemoteEngine(EngineArgs(model=str(bare_dir), skip_tokenizer_init=True, **ENGINE_KW))
    try:
        assert isinstance(remote.tokenizer, TokenIdsOnly)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        remote.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
        got: list[int] = []
        while remote.has_unfinished():
            for out in remote.step():
                got.extend(out.outputs[0].delta_token_ids)
                assert out.outputs[0].delta_text == ""
    finally:
        remote.shutdown()
    want = LLM(model=str(tiny_llama_dir), **ENGINE_KW).generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert got == want[0].outputs[0].token_ids


# ---- Llama 3 GGUF (rope_freqs) ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama with Llama 3 RoPE scaling: its HF folder, and the same weights (F32) as a GGUF
    carrying rope_freqs the way llama.cpp's converter writes it."""
    from gguf_writer import llama3_rope_freqs, write_gguf

    d = tmp_path_factory.mktemp("llama3-gguf")
    # original length 64: the 8 rotary frequencies (wavelengths 6.3 ... 2e4) fall in all three
    # bands (kept, smoothed, divided by the factor), not only the last two as in TINY_CONFIGS
    llama = TINY_CONFIGS["llama"]
    scaling = dict(llama["rope_scaling"], original_max_position_embeddings=64)
    TINY_CONFIGS["llama"] = dict(llama, rope_scaling=scaling)
    try:
        model = make_tiny_model("llama", d / "hf")
    finally:
        TINY_CONFIGS["llama"] = llama
    cfg = model.config
    scaling = dict(cfg.rope_parameters)
    assert scaling["rope_type"] == "llama3"
    freqs = llama3_rope_freqs(cfg.head_dim, scaling["rope_theta"], scaling)
    assert freqs[0] == 1.0 and freqs[-1] == 8.0 and 1.0 < freqs[1] < 8.0  # all three bands
    write_gguf(model, d / "hf", d / "llama3.gguf", rope_freqs=freqs, quantized=False)
    return d / "hf", d / "llama3.gguf"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_llama3_gguf_greedy_equals_transformers(llama3_gguf, cache_dir) -> None:
    hf_dir, gguf_path = llama3_gguf
    llm = LLM(model=str(gguf_path), weight_dtype="float32", **ENGINE_KW)
    assert llm.engine.loaded.config.rope_type == "freq_factors"
    prompts = _prompts(llm.engine.loaded.config.vocab_size, [7, 30, 90], seed=1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == _hf_greedy(hf_dir, prompts, 40)


def test_llama3_gguf_rope_matches_the_hf_formula_and_not_plain_rope(llama3_gguf, cache_dir) -> None:
    """The factors reproduce transformers' llama3 inverse frequencies (to float32 rounding); plain
    RoPE would be far off, so the greedy test above cannot pass by ignoring them."""
    from pagedrs.models import load_model
    from pagedrs.models.config import ModelConfig
    from pagedrs.models.rotary import rope_inv_freq

    hf_dir, gguf_path = llama3_gguf
    loaded = load_model(gguf_path, weight_dtype="float32")
    hf_cfg = ModelConfig.from_hf_dict(__import__("json").loads((hf_dir / "config.json").read_text()))
    got, want = rope_inv_freq(loaded.config), rope_inv_freq(hf_cfg)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    plain = rope_inv_freq(ModelConfig(**{**hf_cfg.__dict__, "rope_scaling": None}))
    assert (plain / want).max() > 7.9  # the lowest frequencies are divided by factor 8


def test_gguf_rope_freqs_of_the_wrong_length_is_refused(tmp_path, cache_dir) -> None:
    from gguf_writer import write_gguf

    model = make_tiny_model("llama", tmp_path / "hf")
    write_gguf(model, tmp_path / "hf", tmp_path / "bad.gguf", rope_freqs=[1.0, 2.0, 3.0], quantized=False)
    with pytest.raises(ValueError, match="rope_freqs has 3 entries; head_dim 16 needs 8"):
        LLM(model=str(tmp_path / "bad.gguf"), **ENGINE_KW)


# ---- sliding window (Mistral) -----------------------------------------------------------

WINDOW = 16


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory) -> Path:
    """A tiny Mistral whose window (16) is much shorter than its contexts (~120 tokens)."""
    folder = tmp_path_factory.mktemp("mistral-window")
    mistral = TINY_CONFIGS["mistral"]
    TINY_CONFIGS["mistral"] = dict(mistral, sliding_window=WINDOW)
    try:
        make_tiny_model("mistral", folder)
    finally:
        TINY_CONFIGS["mistral"] = mistral
    return folder


@pytest.mark.parametrize("chunk", [2048, 12], ids=["whole-prefill", "chunked-prefill"])
def test_sliding_window_greedy_equals_transformers(mistral_window_dir: Path, chunk: int) -> None:
    """Prompts of 5..60 tokens and 100 new ones (contexts up to 160, ten windows), block size 4
    (windows start mid-page), chunked or whole prefill; a shared 40-token prefix run twice
    so the second request reads its first pages from the prefix cache."""
    llm = LLM(model=str(mistral_window_dir), **dict(ENGINE_KW, max_num_batched_tokens=chunk))
    assert llm.engine.loaded.config.sliding_window == WINDOW
    vocab = llm.engine.loaded.config.vocab_size
    prefix = _prompts(vocab, [40], seed=5)[0]
    prompts = _prompts(vocab, [5, 17, 60], seed=3) + [prefix + [7, 8, 9], prefix + [10, 11]]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                                                         use_tqdm=False)]
    got += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)]
    assert llm.engine.stats()["prefix_hits"] >= 40 // ENGINE_KW["block_size"] - 1
    want = _hf_greedy(mistral_window_dir, prompts, 100)
    assert got == want


def test_sliding_window_changes_the_output(mistral_window_dir: Path) -> None:
    """The window matters for this model: full attention would generate other tokens, so the
    test above cannot pass by ignoring it."""
    want = _hf_greedy(mistral_window_dir, _prompts(300, [60], seed=3), 100)
    full = _hf_greedy(mistral_window_dir, _prompts(300, [60], seed=3), 100, sliding_window=None)
    assert want != full


def test_torch_backend_window_mask_matches_a_dense_reference() -> None:
    """Random pages and mixed decode/prefill rows against a dense per-sequence softmax with
    transformers' window rule (q - W < k <= q)."""
    from pagedrs.attention import AttentionMetadata, TorchAttentionBackend

    g = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, d, window = 4, 4, 2, 8, 5
    seq_lens, q_lens = [23, 9, 2, 40], [1, 9, 2, 3]
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in seq_lens:
        k = -(-n // bs)
        tables.append(perm[at:at + k] + [0] * (10 - k))
        at += k
    kc = torch.randn(num_blocks, bs, kv_heads, d, generator=g, dtype=torch.float64)
    vc = torch.randn(num_blocks, bs, kv_heads, d, generator=g, dtype=torch.float64)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], heads, d, generator=g, dtype=torch.float64)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    got = TorchAttentionBackend().forward(query, kc, vc, meta, 0.5, sliding_window=window)
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        keys = torch.cat([kc[b] for b in tables[i][: -(-n // bs)]])[:n].repeat_interleave(heads // kv_heads, 1)
        vals = torch.cat([vc[b] for b in tables[i][: -(-n // bs)]])[:n].repeat_interleave(heads // kv_heads, 1)
        for j in range(q):
            pos = n - q + j
            lo = max(pos - window + 1, 0)
            scores = torch.einsum("hd,khd->hk", query[starts[i] + j], keys[lo:pos + 1]) * 0.5
            want = torch.einsum("hk,khd->hd", scores.softmax(-1), vals[lo:pos + 1])
            torch.testing.assert_close(got[starts[i] + j], want)


def test_qwen2_sliding_layers_equal_transformers(tmp_path: Path) -> None:
    """Qwen2 slides only on the layers from max_window_layers on (here: layer 1 of 0..1)."""
    qwen2 = TINY_CONFIGS["qwen2"]
    TINY_CONFIGS["qwen2"] = dict(qwen2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    try:
        make_tiny_model("qwen2", tmp_path)
    finally:
        TINY_CONFIGS["qwen2"] = qwen2
    llm = LLM(model=str(tmp_path), **ENGINE_KW)
    config = llm.engine.loaded.config
    assert [config.layer_sliding_window(i) for i in range(2)] == [None, 8]
    prompts = _prompts(config.vocab_size, [30, 4], seed=2)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), use_tqdm=False)
    want = _hf_greedy(tmp_path, prompts, 60)
    assert [o.outputs[0].token_ids for o in got] == want
    assert want != _hf_greedy(tmp_path, prompts, 60, layer_types=["full_attention"] * 2)


def test_gguf_rope_scaling_it_cannot_apply_is_refused(tmp_path, cache_dir, monkeypatch) -> None:
    """A YaRN file must not load as plain RoPE (it would run, with wrong results)."""
    import gguf

    from gguf_writer import write_gguf

    model = make_tiny_model("llama", tmp_path / "hf")
    add_head_count = gguf.GGUFWriter.add_head_count

    def with_yarn(self, count):  # the header gets the scaling keys next to the head count
        add_head_count(self, count)
        self.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        self.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", with_yarn)
    write_gguf(model, tmp_path / "hf", tmp_path / "yarn.gguf", quantized=False)
    with pytest.raises(ValueError, match="uses RoPE scaling 'yarn'; supported: 'none', 'linear'"):
        LLM(model=str(tmp_path / "yarn.gguf"), **ENGINE_KW)
