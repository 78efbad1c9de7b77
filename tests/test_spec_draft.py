"""Speculative decoding with a draft model (``{"method": "draft_model", "model": PATH, ...}``):
a draft equal to the target accepts every draft, a random draft of the same vocabulary almost
none, and both give greedy output equal to no speculation and to transformers, in every mode
(prefix caching, chunked prefill, swap and recompute preemption, n > 1). Since the draft equal
to the target proposes exactly the target's next tokens, any draft K/V left stale by a page the
core moved (a copy-on-write, a swap, a recompute) would show up as a rejection: acceptance 1.0
in every mode is the check that the draft's layers follow the target's pages. Bad drafts are
refused at startup naming the field; the leak fixture (conftest.py) holds for every engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.spec.config import SpeculativeConfig
from test_spec_decode import greedy, hf_greedy, run_all


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory) -> Path:
    """Another random llama of the same tokenizer, smaller and shaped differently (1 layer, hidden
    32, one KV head): its pages' layers have another geometry than the target's."""
    folder = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_model("llama", folder, seed=1, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=64)
    return folder


def draft(model_dir: Path, k: int = 3) -> dict:
    """Never off (on the CPU ``disable_by_batch_size`` defaults to 2: these batches hold 4)."""
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k, "disable_by_batch_size": None}


def make_engine(model_dir: Path, spec: dict | None, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=4, num_gpu_blocks=96, swap_space_gb=0.001, max_model_len=256,
                speculative_config=spec)
    args.update(kw)
    return Engine(EngineArgs(**args))


def batch(vocab: int, seed: int = 0) -> list[list[int]]:
    """Four random prompts, two of them sharing a 9-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (9,), generator=g).tolist()
    return [shared + [5, 6], shared + [7], torch.randint(3, vocab, (7,), generator=g).tolist(),
            torch.randint(3, vocab, (15,), generator=g).tolist()]


MODES = {
    "plain": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 8},
    # 12 pages of 4 tokens for 4 requests of up to 35 tokens: preemption all along
    "swap": {"num_gpu_blocks": 12, "preemption_mode": "swap", "swap_space_gb": 0.01, "watermark": 0.0,
             "enable_prefix_caching": False, "admission_policy": "prompt_only"},
    "recompute": {"num_gpu_blocks": 12, "preemption_mode": "recompute", "watermark": 0.0,
                  "admission_policy": "prompt_only"},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_draft_equal_to_the_target_accepts_every_draft_and_changes_no_token(tiny_llama_dir, hf_model, mode):
    kw = MODES[mode]
    spec = make_engine(tiny_llama_dir, draft(tiny_llama_dir), **kw)
    plain = make_engine(tiny_llama_dir, None, **kw)
    prompts = batch(spec.loaded.config.vocab_size)
    with_spec, without = run_all(spec, prompts, greedy()), run_all(plain, prompts, greedy())
    assert with_spec == without
    for i, p in enumerate(prompts):
        assert with_spec[f"r{i}"][0] == hf_greedy(hf_model, p, 20), f"r{i} ({mode})"
    stats = spec.stats()
    # max_tokens cuts a proposal before the plan (the core keeps fewer drafts), never by a rejection
    assert stats["spec_proposed"] > 20 and stats["spec_accepted"] == stats["spec_proposed"], stats
    assert stats["spec_mean_accepted_length"] > 2.0, stats
    if mode in ("swap", "recompute"):
        assert stats["num_preemptions"] > 0
    assert spec.stats()["num_steps"] < plain.stats()["num_steps"]


def test_prefix_cache_hits_are_fed_to_the_draft_from_position_zero(tiny_llama_dir, hf_model):
    """A second round of the same prompts hits the cached pages; the new sequences' draft feeds their
    whole context first (spec/draft.py's rule), so every draft is still accepted."""
    engine = make_engine(tiny_llama_dir, draft(tiny_llama_dir))
    prompts = batch(engine.loaded.config.vocab_size)
    first = run_all(engine, prompts, greedy())
    proposed = engine.stats()["spec_proposed"]
    cached = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"again{i}", p, greedy())
    again: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                again[out.request_id] = out.outputs[0].token_ids
    assert all(cached[f"again{i}"] >= 4 for i in range(len(prompts))), cached
    assert [again[f"again{i}"] for i in range(len(prompts))] == [first[f"r{i}"][0] for i in range(len(prompts))]
    stats = engine.stats()
    assert stats["spec_proposed"] > proposed and stats["spec_accepted"] == stats["spec_proposed"], stats


@pytest.mark.parametrize("mode", ["plain", "chunked", "recompute"])
def test_a_random_draft_accepts_almost_nothing_and_changes_no_token(tiny_llama_dir, random_draft_dir, hf_model, mode):
    engine = make_engine(tiny_llama_dir, draft(random_draft_dir, k=4), **MODES[mode])
    prompts = batch(engine.loaded.config.vocab_size, seed=1)
    done = run_all(engine, prompts, greedy(max_tokens=24))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"][0] == hf_greedy(hf_model, p, 24), f"r{i} ({mode})"
    stats = engine.stats()
    assert stats["spec_proposed"] > 0 and stats["spec_acceptance_rate"] < 0.2, stats


def test_n_greater_than_one_each_child_drafts_for_itself(tiny_llama_dir, hf_model):
    engine = make_engine(tiny_llama_dir, draft(tiny_llama_dir))
    prompts = batch(engine.loaded.config.vocab_size)[:2]
    done = run_all(engine, prompts, greedy(n=3))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == [hf_greedy(hf_model, p, 20)] * 3
    stats = engine.stats()
    assert stats["spec_accepted"] == stats["spec_proposed"] > 0, stats


def test_a_draft_that_fails_mid_run_costs_acceptance_never_a_token(tiny_llama_dir, hf_model, monkeypatch):
    """The draft's forward raises once: that step verifies the reserved tokens (rejected), every
    sequence re-feeds the draft from 0, and the output is what it would be without speculation."""
    from pagedrs.spec.draft_runner import DraftRunner

    original, calls = DraftRunner.propose, []

    def flaky(self, feeds, chunk):
        calls.append(len(feeds))
        if len(calls) == 3:
            raise RuntimeError("injected draft failure")
        return original(self, feeds, chunk)

    monkeypatch.setattr(DraftRunner, "propose", flaky)
    engine = make_engine(tiny_llama_dir, draft(tiny_llama_dir))
    prompts = batch(engine.loaded.config.vocab_size)
    done = run_all(engine, prompts, greedy())
    for i, p in enumerate(prompts):
        assert done[f"r{i}"][0] == hf_greedy(hf_model, p, 20)
    stats = engine.stats()
    assert len(calls) > 3 and 0 < stats["spec_accepted"] < stats["spec_proposed"], stats
    # only the failed step's reserved tokens were rejected: the re-fed draft accepts everything again
    assert stats["spec_proposed"] - stats["spec_accepted"] <= 3 * calls[2], stats


def test_seeded_sampling_with_a_draft_draws_the_same_tokens(tiny_llama_dir, random_draft_dir):
    """The greedy draft is a deterministic proposal: verification draws from P_j as a plain decode
    would (one generator draw per output token), so a seed gives the same tokens with or without it."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    outs = []
    for spec in (None, draft(tiny_llama_dir), draft(random_draft_dir)):
        engine = make_engine(tiny_llama_dir, spec)
        outs.append(run_all(engine, batch(engine.loaded.config.vocab_size), params))
        if spec is not None and spec["model"] == str(tiny_llama_dir):
            assert engine.stats()["spec_accepted"] > 0
    assert outs[0] == outs[1] == outs[2]


def test_the_pool_counts_the_drafts_layers_in_every_page(tiny_llama_dir, random_draft_dir):
    """A page holds the target's layers and the draft's: the same bytes give fewer pages."""
    memory = 64 * 2**10
    alone = make_engine(tiny_llama_dir, None, num_gpu_blocks=None, kv_cache_memory=memory)
    both = make_engine(tiny_llama_dir, draft(random_draft_dir), num_gpu_blocks=None, kv_cache_memory=memory)
    # target: 2 layers x 2 KV heads x 16, draft: 1 layer x 1 KV head x 16; K and V, float32
    target_bytes, draft_bytes = 2 * 2 * 2 * 16 * 4, 2 * 1 * 1 * 16 * 4
    assert alone.kv_plan.bytes_per_token == target_bytes
    assert both.kv_plan.bytes_per_token == target_bytes + draft_bytes
    assert both.kv_plan.num_gpu_blocks == memory // ((target_bytes + draft_bytes) * 4)
    held = both.executor.memory_bytes()
    assert held["kv_pool"] == both.kv_plan.num_gpu_blocks * 4 * (target_bytes + draft_bytes)


def test_the_disk_tier_holds_the_targets_layers_only_so_its_store_serves_any_draft(tiny_llama_dir, random_draft_dir,
                                                                                    tmp_path, caplog):
    """Why the disk store's fingerprint (kv_tiers/fingerprint.py) leaves the draft model out: the store never
    holds the draft's layers (its pages are the target's bytes; the draft mirrors no disk transfer and has
    no disk tier), and a page read back from it, like a prefix-cache hit, never serves draft K/V (a new
    sequence's draft feeds its whole context from position 0: spec/draft.py). So a store written beside one
    draft is read, and read right, beside another. Pinned: a change that stored the draft's layers (a
    bigger slot) or skipped the draft's feed of disk hits (written by another draft: rejections) fails here,
    and would have to put the draft in the fingerprint."""
    import logging

    disk = dict(kv_disk_path=str(tmp_path / "disk"), kv_disk_gb=0.01, kv_host_cache_gb=0, num_gpu_blocks=24,
                max_num_seqs=2)
    writer = make_engine(tiny_llama_dir, draft(random_draft_dir), **disk)
    plain = make_engine(tiny_llama_dir, None, **{**disk, "kv_disk_path": str(tmp_path / "plain-disk")})
    assert writer.executor.draft.runner.disk is None
    assert writer.executor._disk_store.slot_bytes == plain.executor._disk_store.slot_bytes  # the target's layers only
    plain.shutdown()
    prompts = batch(writer.loaded.config.vocab_size) + batch(writer.loaded.config.vocab_size, seed=1)
    written = run_all(writer, prompts, greedy(8))
    writer.shutdown()  # its cached pages go to disk

    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        reader = make_engine(tiny_llama_dir, draft(tiny_llama_dir), **disk)  # another draft: the target itself
    assert "ignoring the KV disk store" not in caplog.text  # the store is the target's: read
    assert run_all(reader, prompts, greedy(8)) == written
    stats = reader.stats()
    assert stats["prefix_hits_disk"] > 0, stats
    # an exact draft accepts every token: none of its K/V came from the pages the other draft ran beside
    assert stats["spec_proposed"] > 20 and stats["spec_accepted"] == stats["spec_proposed"], stats
    reader.shutdown()


def test_kv_size_counts_the_drafts_layers(capsys):
    from pagedrs.cli import main

    assert main(["kv-size", "--model", "llama-3.1-8b", "--draft-model", "smollm2-135m", "--tokens", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # 2 x 32 x 8 x 128 x 2 (the target, float16) + 2 x 30 x 3 x 64 x 2 (SmolLM2 as its draft)
    assert (result["bytes_per_token"], result["draft_bytes_per_token"]) == (131072 + 23040, 23040)
    assert result["bytes_per_sequence"] == 10 * (131072 + 23040)
    assert main(["kv-size", "--model", "llama-3.1-8b", "--draft-model", "smollm2-135m", "--tokens", "10",
                 "--tensor-parallel-size", "2"]) == 2
    assert "--draft-model with --tensor-parallel-size: not supported" in capsys.readouterr().err


# ---- refused at startup -----------------------------------------------------------------------


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is missing"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, "speculative_config.model is ''"),
    ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, "speculative_config.model is 3"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 0}, "num_speculative_tokens is 0"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 17}, "num_speculative_tokens is 17"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "field(s) ['prompt_lookup_max'], which method 'draft_model' does not take"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "field(s) ['model'], which method 'ngram'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "draft_tp": 1}, "unknown field(s) ['draft_tp']"),
])
def test_bad_draft_configs_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineArgs(model=None, speculative_config=config)
    assert message in str(info.value)


def test_config_keeps_the_drafts_path():
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 5})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/m", 5)


def test_tensor_parallel_with_a_draft_is_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative_config with tensor_parallel_size=2: not supported yet"):
        EngineArgs(model=str(tiny_llama_dir), speculative_config=draft(tiny_llama_dir), tensor_parallel_size=2)


def test_a_draft_that_does_not_load_is_refused_naming_the_field(tiny_llama_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(ValueError, match=r"speculative_config.model is .*: it does not load as a draft model"):
            make_engine(tiny_llama_dir, draft(path))


@pytest.mark.parametrize(("change", "trait"), [
    ({"vocab_size": 320}, "config vocab_size is 320"),
    ({"eos_token_id": 1}, "eos token ids is [1, 2], the target's is [2]"),
])
def test_a_draft_of_another_vocabulary_is_refused(tiny_llama_dir, tmp_path, change, trait):
    folder = tmp_path / "other"
    make_tiny_model("llama", folder, seed=2, **change)
    with pytest.raises(ValueError, match="speculative_config.model is") as info:
        make_engine(tiny_llama_dir, draft(folder))
    assert trait in str(info.value) and "the target's vocabulary" in str(info.value)


def test_smollm2_as_its_own_draft_accepts_everything_and_changes_no_token():
    """SmolLM2-135M (float32 weights: a self-draft then accepts every draft) drafting for itself: the
    bench's smoke, exact. (The default quantized weights' bf16 ties: tests/test_spec_exact.py.)"""
    kw = dict(model="smollm2-135m", weight_dtype="float32", num_gpu_blocks=64, block_size=16, max_model_len=512)
    spec = Engine(EngineArgs(**kw, speculative_config={"method": "draft_model", "model": "smollm2-135m",
                                                       "num_speculative_tokens": 4}))
    plain = Engine(EngineArgs(**kw))
    prompt = spec.tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to ten."}])
    with_spec, without = run_all(spec, [prompt], greedy(max_tokens=24)), run_all(plain, [prompt], greedy(max_tokens=24))
    assert with_spec == without
    stats = spec.stats()
    assert stats["spec_proposed"] > 10 and stats["spec_accepted"] == stats["spec_proposed"], stats
