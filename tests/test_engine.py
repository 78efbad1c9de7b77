"""The engine end to end against the outside referee: greedy tokens equal to
Hugging Face transformers in every mode (prefix caching, preemption by swap /
recompute / auto, chunked prefill, n > 1 with copy-on-write, the contiguous
baseline), pages all free afterwards, and bad input rejected with nothing lost.
"""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, Engine, EngineArgs, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The referee: full recompute each step, argmax, no early stop."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


def make_prompts(engine: Engine, count: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of varied lengths, optionally sharing a `shared`-token prefix."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    prompts = []
    for i in range(count):
        length = 3 + (7 * i + 5) % 23
        prompts.append(prefix + torch.randint(3, vocab, (length,), generator=g).tolist())
    return prompts


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(engine: Engine, prompts, params) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished()
    return done


def assert_all_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
    engine.scheduler.check_invariants()


def make_engine(model_dir, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=4, num_gpu_blocks=64, swap_space_gb=0.001, max_model_len=256)
    args.update(kw)
    return Engine(EngineArgs(**args))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers_with_and_without_prefix_caching(tiny_llama_dir, hf_model, prefix_caching):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=prefix_caching)
    prompts = make_prompts(engine, 6, shared=13)
    done = run_all(engine, prompts, greedy())
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, MAX_TOKENS), f"request r{i}"
    stats = engine.stats()
    if prefix_caching:
        # 13 shared tokens = 3 full blocks of 4; requests admitted in the same step share them too.
        assert stats["prefix_hits"] >= 3 * (len(prompts) - 1)
        assert stats["num_cached_prompt_tokens"] >= 12 * (len(prompts) - 1)
    else:
        assert stats["prefix_hits"] == 0
    assert_all_free(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_keeps_greedy_output_and_frees_every_page(tiny_llama_dir, hf_model, mode):
    # 12 blocks of 4 tokens for 8 requests of up to ~40 tokens each: constant preemption.
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=12, preemption_mode=mode, swap_space_gb=0.01,
                         enable_prefix_caching=False, watermark=0.0)
    prompts = make_prompts(engine, 8, seed=1)
    done = run_all(engine, prompts, greedy(max_tokens=16))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 16), f"request r{i} ({mode})"
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_preemptions"] > 0 and stats["swap_out_blocks"] > 0
        assert stats["swap_in_blocks"] == stats["swap_out_blocks"]
    if mode == "recompute":
        assert stats["num_swap_preemptions"] == 0 and stats["num_recompute_preemptions"] > 0
    assert_all_free(engine)
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def test_expected_growth_admission_keeps_greedy_output_and_preempts_less(tiny_llama_dir, hf_model):
    """Admission changes when a request starts, never what it generates; leaving room for
    the running set's growth avoids most of the preemptions prompt-only admission causes."""
    done, preemptions = {}, {}
    for policy in ("prompt_only", "expected_growth"):
        engine = make_engine(tiny_llama_dir, num_gpu_blocks=12, preemption_mode="recompute",
                             enable_prefix_caching=False, watermark=0.0, admission_policy=policy)
        prompts = make_prompts(engine, 8, seed=1)
        done[policy] = run_all(engine, prompts, greedy(max_tokens=16))
        preemptions[policy] = engine.stats()["num_preemptions"]
        assert_all_free(engine)
    for i, p in enumerate(prompts):
        assert done["expected_growth"][f"r{i}"] == hf_greedy(hf_model, p, 16), f"request r{i}"
    assert done["expected_growth"] == done["prompt_only"]
    assert preemptions["expected_growth"] < preemptions["prompt_only"], preemptions


@pytest.mark.parametrize(("field", "value", "message"), [
    ("admission_policy", "bogus", 'admission_policy is "bogus"'),
    ("admission_init_ratio", float("nan"), "admission_init_ratio is NaN"),
    ("admission_min_ratio", -0.5, "admission_min_ratio is -0.5"),
    ("admission_init_ratio", float("inf"), "admission_init_ratio is inf"),
])
def test_bad_admission_settings_are_refused_naming_the_field(field, value, message):
    from pagedrs._core import SchedulerConfig

    with pytest.raises(ValueError, match=message):
        SchedulerConfig(num_gpu_blocks=8, block_size=4, **{field: value})
    if field == "admission_policy":
        with pytest.raises(ValueError, match="admission_policy"):
            EngineArgs(admission_policy=value)


def test_auto_preemption_uses_both_modes_by_cost(tiny_llama_dir, hf_model):
    """With swapping priced between a short and a long sequence's recompute, both happen."""
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=12, preemption_mode="auto", swap_space_gb=0.01,
                         enable_prefix_caching=False, watermark=0.0)
    # Rebuild the scheduler's cost model: recompute of ~20 tokens costs the same as swapping 5 blocks.
    from pagedrs._core import Scheduler, SchedulerConfig

    plan = engine.kv_plan
    engine.scheduler = Scheduler(SchedulerConfig(
        num_gpu_blocks=plan.num_gpu_blocks, block_size=4, num_cpu_blocks=plan.num_cpu_blocks,
        enable_prefix_caching=False, max_model_len=256, preemption_mode="auto", swap_cost_per_block=1.0,
        recompute_cost_per_token=0.5, admission_policy="prompt_only"))  # prompt-only: it must preempt
    prompts = make_prompts(engine, 8, seed=1)
    done = run_all(engine, prompts, greedy(max_tokens=16))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 16)
    stats = engine.stats()
    assert stats["num_swap_preemptions"] > 0 and stats["num_recompute_preemptions"] > 0
    assert_all_free(engine)


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_chunked_prefill_with_tiny_budgets(tiny_llama_dir, hf_model, budget):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    prompts = make_prompts(engine, 4, shared=9, seed=2)
    done = run_all(engine, prompts, greedy(max_tokens=6))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 6)
    assert_all_free(engine)


def test_contiguous_layout_matches_and_wastes_more(tiny_llama_dir, hf_model):
    engine = make_engine(tiny_llama_dir, kv_layout="contiguous", num_gpu_blocks=64, max_model_len=64)
    prompts = make_prompts(engine, 4, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy())
    engine.step()
    stats = engine.stats()
    # Each running sequence reserved max_model_len = 64 slots = 16 blocks; 4 sequences fill the pool.
    assert stats["num_running"] == 4 and stats["num_used_gpu_blocks"] == 64
    assert stats["kv_utilization"] < 0.5
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, MAX_TOKENS)
    assert_all_free(engine)


def test_n_samples_fork_with_copy_on_write(tiny_llama_dir):
    """n = 3 seeded samples equal three separate requests seeded seed, seed+1, seed+2:
    the children share the prompt pages and copy the partly filled last one on write."""
    engine = make_engine(tiny_llama_dir)
    prompt = make_prompts(engine, 2, seed=4)[1]
    assert len(prompt) % 4 != 0  # the last prompt block is partly filled: forking must copy it
    params = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    engine.add_request("n3", prompt, SamplingParams(n=3, seed=123, **params))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and [o.index for o in final.outputs] == [0, 1, 2]
    assert engine.stats()["cow_copies"] >= 2
    assert_all_free(engine)
    for k in range(3):
        engine.add_request(f"s{k}", prompt, SamplingParams(n=1, seed=123 + k, **params))
    singles = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                singles[out.request_id] = out.outputs[0].token_ids
    for k in range(3):
        assert final.outputs[k].token_ids == singles[f"s{k}"]
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1  # the samples really differ


def test_abort_mid_generation_frees_every_page(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 3, shared=8, seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.stats()["num_used_gpu_blocks"] > 0
    assert engine.abort("r1") is True
    assert engine.abort("r1") is False
    assert engine.abort("nope") is False
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r1"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    engine.abort("r0")
    engine.abort("r2")
    engine.step()
    assert_all_free(engine)


def test_priority_order_is_respected(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1)
    prompts = make_prompts(engine, 3, seed=6)
    engine.add_request("low", prompts[0], greedy(max_tokens=3), priority=5)
    engine.add_request("high", prompts[1], greedy(max_tokens=3), priority=-1)
    engine.add_request("mid", prompts[2], greedy(max_tokens=3), priority=0)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_bad_input_is_rejected_and_other_requests_continue(tiny_llama_dir, hf_model):
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=8, max_model_len=40)
    prompt = make_prompts(engine, 1, seed=7)[0]
    engine.add_request("good", prompt, greedy(max_tokens=8))
    engine.step()
    cases = [
        (lambda: engine.add_request("e1", "", greedy()), "empty"),
        (lambda: engine.add_request("e2", [5] * 41, greedy()), "max_model_len is 40"),
        (lambda: engine.add_request("good", prompt, greedy()), "already exists"),
        (lambda: engine.add_request("e4", [5] * 39, greedy(max_tokens=100)), "pool holds"),
        (lambda: engine.add_request("e5", [10**9], greedy()), "outside the vocabulary"),
        (lambda: engine.add_request("e6", {"text": "x"}, greedy()), "prompt_token_ids"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: EngineArgs(kv_layout="ring"), "kv_layout"),
    ]
    small = make_engine(tiny_llama_dir, num_gpu_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="pool holds 4 blocks") as refused:
        small.add_request("huge", [5] * 20, greedy(max_tokens=8))
    assert refused.value.param == "prompt"  # the prompt alone cannot fit: a server's 400 names it
    with pytest.raises(ValueError, match="pool holds 4 blocks") as refused:
        small.add_request("long", [5] * 3, greedy(max_tokens=40))
    assert refused.value.param == "max_tokens"  # the prompt fits; its room to grow does not
    assert_all_free(small)
    for call, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            call()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert list(done) == ["good"]
    assert done["good"] == hf_greedy(hf_model, prompt, 8)
    assert_all_free(engine)


def test_stop_strings_and_streaming_deltas(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, max_model_len=256)
    prompt = "The quick brown fox"
    full = llm.generate(prompt, greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    streamed = "".join(llm.stream(prompt, greedy(max_tokens=16)))
    assert streamed == full.text
    # Stop at a piece of the greedy text: the output ends right before it.
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate(prompt, greedy(max_tokens=16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.find(stop)]
    assert_all_free(llm.engine)


def test_generate_keeps_input_order_and_chat_template(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, max_model_len=256)
    prompts = ["fox", "The quick brown fox jumps", "café"]
    outs = llm.generate(prompts, greedy(max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in outs)
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy(max_tokens=3))[0]
    expected = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.prompt_token_ids == expected


def test_embedded_smollm2_engine_matches_transformers_with_sharing_chunking_and_preemption(hf_smollm2):
    """The demo's situation on the real model: chats sharing a system prompt, prefix
    caching on, prompts chunked under a small budget and a pool small enough to preempt."""
    from pagedrs.demo import QUESTIONS, SYSTEM_PROMPT

    engine = Engine(EngineArgs(model="smollm2-135m", weight_dtype="float32", num_gpu_blocks=10, block_size=16, max_num_batched_tokens=48,
                               preemption_mode="auto", swap_space_gb=0.05, watermark=0.0))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
               for q in QUESTIONS[:3]]
    done = run_all(engine, prompts, greedy(max_tokens=8))
    hf_smollm2.generation_config.eos_token_id = None
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert done[f"r{i}"] == ref[0, len(p):].tolist(), f"chat {i}"
    stats = engine.stats()
    assert stats["prefix_hits"] > 0 and stats["num_preemptions"] > 0
    assert_all_free(engine)


def test_a_failing_request_ends_with_an_error_and_the_others_continue(tiny_llama_dir, hf_model, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 2, seed=8)
    engine.add_request("ok", prompts[0], greedy(max_tokens=6))
    engine.add_request("bad", prompts[1], greedy(max_tokens=6))
    bad_detok = engine.output_processor.requests["bad"].samples[0].detokenizer

    def explode(_ids):
        raise RuntimeError("detokenizer failed")

    monkeypatch.setattr(bad_detok, "step", explode)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert "detokenizer failed" in finished["bad"].error
    assert finished["ok"].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], 6)
    assert_all_free(engine)


@pytest.fixture(scope="module")
def head64_llama_dir(tmp_path_factory):
    """The tiny llama with 4 heads of 64 (hidden 256): a geometry the CUDA kernels are built for."""
    from conftest import make_tiny_model

    folder = tmp_path_factory.mktemp("head64-llama-gpu")
    make_tiny_model("llama", folder, hidden_size=256, intermediate_size=256, head_dim=64)
    return folder


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_greedy_on_the_gpu_equals_the_cpu_reference(head64_llama_dir, monkeypatch, backend):
    """End to end on CUDA (the kernels, insisted on, or the torch reference path) against the CPU engine,
    with swapping to the host tier."""
    monkeypatch.delenv("PAGEDRS_ATTENTION_BACKEND", raising=False)
    kw = dict(block_size=8, num_gpu_blocks=64, max_model_len=256)
    cpu = make_engine(head64_llama_dir, **kw)
    prompts = make_prompts(cpu, 6, shared=9, seed=9)
    expected = run_all(cpu, prompts, greedy())
    monkeypatch.setenv("PAGEDRS_ATTENTION_BACKEND", backend)
    gpu = make_engine(
        head64_llama_dir,
        device="cuda",
        **{**kw, "num_gpu_blocks": 6},
        preemption_mode="swap",
        swap_space_gb=0.01,
        admission_policy="prompt_only",
    )
    assert type(gpu.executor.runner.backend).__name__ == (
        "CudaAttentionBackend" if backend == "cuda" else "TorchAttentionBackend"
    )
    assert run_all(gpu, prompts, greedy()) == expected
    assert gpu.stats()["num_preemptions"] > 0  # the small pool made it swap
    assert_all_free(gpu)


def test_contiguous_fork_without_room_waits_for_its_region(tiny_llama_dir):
    """The contiguous baseline copies the parent's region for each extra sample. When another
    request holds the room a sample needs, that sample waits for a region and is prefilled
    when it gets one, as a recompute preemption would be: nothing fails (the request was
    admitted as able to run alone), and every sample ends with the tokens it gets on a pool
    with room to spare (seeded draws do not depend on the batch)."""

    def run(num_gpu_blocks: int) -> tuple[dict, dict]:
        engine = make_engine(tiny_llama_dir, kv_layout="contiguous", num_gpu_blocks=num_gpu_blocks, max_model_len=32)
        prompt = make_prompts(engine, 2, seed=10)[1]
        engine.add_request("other", prompt, greedy(max_tokens=6))
        engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1))
        finished = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
            engine.check_invariants()
        assert_all_free(engine)
        return finished, engine.stats()

    tight, tight_stats = run(24)
    roomy, roomy_stats = run(256)
    assert tight_stats["num_deferred_forks"] > 0 and roomy_stats["num_deferred_forks"] == 0
    for rid in ("other", "n3"):
        assert tight[rid].error is None
        assert [o.finish_reason for o in tight[rid].outputs] == ["length"] * len(roomy[rid].outputs)
        assert [o.token_ids for o in tight[rid].outputs] == [o.token_ids for o in roomy[rid].outputs], rid


def test_a_request_whose_samples_can_never_fit_is_refused_up_front(tiny_llama_dir):
    """n samples each need their own pages at worst: the core refuses what can never fit."""
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=16, max_model_len=64)
    prompt = make_prompts(engine, 2, seed=10)[1]
    with pytest.raises(ValueError, match="n = 8 samples"):
        engine.add_request("n8", prompt, SamplingParams(n=8, max_tokens=30, temperature=1.0))
    assert engine.num_unfinished() == 0
    assert_all_free(engine)


def test_generate_with_one_bad_prompt_queues_nothing(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate(["fox", [5] * 65, "café"], greedy(max_tokens=4), use_tqdm=False)
    assert llm.engine.num_unfinished() == 0
    assert_all_free(llm.engine)
    outs = llm.generate(["fox", "café"], greedy(max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == ["fox", "café"] and all(o.finished for o in outs)
