"""Beam search on shared pages: exactly transformers' ``generate(num_beams=k)``, on the
core's fork / append / finish, with and without preemption, and nothing leaks.

The referee is transformers' own beam search on the same weights: the returned
sequences must be equal and the scores (``sequences_scores``) equal up to float noise.
"""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, BeamSearchParams, Engine, EngineArgs, SamplingParams
from test_engine_hardening import run_to_end

torch.set_num_threads(1)

PROMPTS = [[5, 9, 40, 41, 42], [100, 101, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3]]


def hf_beam_search(model, prompt: list[int], params: BeamSearchParams, eos: set[int], **kw):
    """(sequences as token lists, scores) from transformers, best first; ``kw`` goes to
    ``generate`` (e.g. min_new_tokens). ``params.n`` is HF's num_return_sequences."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=params.beam_width,
        num_return_sequences=params.num_returned,
        do_sample=False,
        max_new_tokens=params.max_tokens,
        early_stopping=params.early_stopping,
        length_penalty=params.length_penalty,
        eos_token_id=sorted(eos) if not params.ignore_eos else None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        temperature=None, top_p=None, top_k=None,
        **kw,
    )
    if params.beam_width == 1:  # transformers runs greedy search for num_beams=1; score it as beam search would
        generated = out.sequences[0, len(prompt):].tolist()
        logprob = sum(torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, generated))
        return [out.sequences[0].tolist()], [logprob / len(generated) ** params.length_penalty]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    sequences = [out.sequences[i, : len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return sequences, out.sequences_scores.tolist()


def assert_equal_to_hf(results, model, prompts, params, eos) -> None:
    for prompt, result in zip(prompts, results):
        sequences, scores = hf_beam_search(model, prompt, params, eos)
        assert [s.tokens for s in result.sequences] == sequences
        assert [s.score for s in result.sequences] == pytest.approx(scores, abs=1e-4, rel=1e-4)
        for s in result.sequences:
            assert s.tokens[: len(prompt)] == prompt and s.tokens[len(prompt):] == s.token_ids
            assert s.score == pytest.approx(s.cum_logprob / len(s.token_ids) ** params.length_penalty, rel=1e-5)


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def eos_heavy_model(folder, model, tmp_path_factory):
    """The tiny llama with more EOS ids: the third token of each prompt's best beam, so
    that hypotheses finish early and the stop rules, the length penalty and HF's
    ``(1 + #EOS) * k`` candidates get exercised."""
    import collections
    import json
    import shutil

    counts = collections.Counter()
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), num_beams=4,
                             num_return_sequences=4, do_sample=False, max_new_tokens=8, pad_token_id=0)
        counts.update([out[0, len(p) + 2].item()])
    out_dir = tmp_path_factory.mktemp("tiny-llama-eos")
    for f in folder.iterdir():
        shutil.copy(f, out_dir / f.name)
    config = json.loads((out_dir / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], *sorted(counts)]
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir, model


@pytest.fixture(scope="module")
def eos_llama(tiny_llama_dir, hf_llama, tmp_path_factory):
    return eos_heavy_model(tiny_llama_dir, hf_llama, tmp_path_factory)


def make_llm(folder, **kw) -> LLM:
    args = dict(block_size=4, num_gpu_blocks=256, max_model_len=128)
    args.update(kw)
    return LLM(model=str(folder), **args)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_beam_search_equals_transformers_on_the_tiny_llama(tiny_llama_dir, hf_llama, k):
    llm = make_llm(tiny_llama_dir)
    params = BeamSearchParams(beam_width=k, max_tokens=12)
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(r.sequences) == k for r in results)
    assert_equal_to_hf(results, hf_llama, PROMPTS, params, llm.engine.tokenizer.eos_token_ids)


def test_beam_search_equals_transformers_on_every_tiny_model(tiny_model_dir):
    """llama (GQA, tied, Llama 3 RoPE), mistral (MQA) and qwen2 (q/k/v bias, linear RoPE)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    llm = make_llm(tiny_model_dir)
    params = BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.8)
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert_equal_to_hf(results, model, PROMPTS, params, llm.engine.tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    "k, length_penalty, early_stopping",
    [(2, 1.0, False), (4, 1.0, True), (4, 2.0, "never"), (8, 0.5, False), (4, -1.0, True)],
)
def test_eos_hypotheses_length_penalty_and_stop_rules_equal_transformers(eos_llama, k, length_penalty, early_stopping):
    folder, model = eos_llama
    llm = make_llm(folder)
    params = BeamSearchParams(beam_width=k, max_tokens=16, length_penalty=length_penalty, early_stopping=early_stopping)
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    eos = llm.engine.tokenizer.eos_token_ids
    if length_penalty <= 1.0:  # a large penalty favours the long hypotheses
        assert any(s.finish_reason == "stop" for r in results for s in r.sequences), "some hypotheses must end in EOS"
    assert_equal_to_hf(results, model, PROMPTS, params, eos)


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_llama):
    folder, model = eos_llama
    llm = make_llm(folder)
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for r in results for s in r.sequences)
    assert_equal_to_hf(results, model, PROMPTS, params, set())


@pytest.mark.parametrize("mode, ignore_eos", [("recompute", False), ("swap", False), ("swap", True)])
def test_beam_search_under_preemption_on_a_tiny_pool_equals_transformers(eos_llama, mode, ignore_eos):
    """Several beam requests and a sampling request on a pool that cannot hold them all:
    beams of one request are preempted apart (rows kept until the rest arrive; forks of
    waiting or swapped parents), and the results still equal transformers'."""
    folder, model = eos_llama
    prompts = PROMPTS + [list(range(20, 44))]
    llm = make_llm(folder, num_gpu_blocks=48, preemption_mode=mode, swap_space_gb=0.01, max_num_batched_tokens=64)
    params = BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=ignore_eos)
    engine = llm.engine
    policy = engine.policies[BeamSearchParams]
    waits = []
    on_step = policy.on_step

    def counting_on_step(request, rows, new_sample):
        decision = on_step(request, rows, new_sample)
        waits.append(decision is None)
        return decision

    policy.on_step = counting_on_step
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    engine.add_request("s", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(n=3, max_tokens=40, temperature=0.0))
    done = run_to_end(engine)  # checks the invariants after every step
    assert engine.stats()["num_preemptions"] > 0, "the pool must be too small for every beam at once"
    assert any(waits), "some beams must have waited for their siblings' rows"
    eos = set() if ignore_eos else engine.tokenizer.eos_token_ids
    assert not any(out.error for out in done.values())
    for i, p in enumerate(prompts):
        sequences, scores = hf_beam_search(model, p, params, eos)
        out = done[f"b{i}"]
        assert [p + c.token_ids for c in out.outputs] == sequences
        assert [c.score for c in out.outputs] == pytest.approx(scores, abs=1e-4, rel=1e-4)


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_equals_transformers_on_the_embedded_smollm2(hf_smollm2, k):
    llm = LLM(model="smollm2-135m", block_size=16, num_gpu_blocks=64, max_model_len=256, weight_dtype="float32")
    tok = llm.engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    params = BeamSearchParams(beam_width=k, max_tokens=6)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert_equal_to_hf(results, hf_smollm2, prompts, params, tok.eos_token_ids)
    assert results[0].sequences[0].text == tok.decode(results[0].sequences[0].token_ids)


def test_abort_mid_search_frees_every_beam(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=128, max_model_len=128))
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, BeamSearchParams(beam_width=4, max_tokens=30))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.num_running == 4, "four live beams"
    assert engine.abort("b")
    out = engine.step()[0]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert engine.stats()["num_free_gpu_blocks"] == engine.stats()["num_gpu_blocks"]
    assert not engine.scheduler.has_unfinished()


def test_beams_share_pages(tiny_llama_dir):
    """k beams over a 40-token prompt hold the prompt's pages once: far fewer pages than
    k private copies."""
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=128, max_model_len=128))
    prompt = list(range(10, 50))
    engine.add_request("b", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.stats()
        peak = max(peak, s["num_gpu_blocks"] - s["num_free_gpu_blocks"])
    private = 4 * ((len(prompt) + 8 + 3) // 4)
    assert peak <= 10 + 4 * 3, (peak, private)


class FailingFork:
    """The engine's scheduler, with its ``fail_at``-th fork raising (as a full contiguous pool would)."""

    def __init__(self, scheduler, fail_at: int) -> None:
        self._scheduler, self._left = scheduler, fail_at

    def fork(self, parent: int, child: int) -> None:
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("no room for the child")
        self._scheduler.fork(parent, child)

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def test_a_failing_fork_ends_that_beam_request_only_and_frees_every_beam(tiny_llama_dir, hf_llama):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=128, max_model_len=128))
    engine.scheduler = FailingFork(engine.scheduler, fail_at=5)
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    engine.add_request("bad", {"prompt_token_ids": PROMPTS[1]}, params)
    done = run_to_end(engine)
    engine.scheduler = engine.scheduler._scheduler
    assert done["bad"].error and "no room" in done["bad"].error
    assert [c.finish_reason for c in done["bad"].outputs] == ["error"] * 4
    engine.add_request("good", {"prompt_token_ids": PROMPTS[0]}, params)
    done = run_to_end(engine)
    sequences, _ = hf_beam_search(hf_llama, PROMPTS[0], params, engine.tokenizer.eos_token_ids)
    assert [PROMPTS[0] + c.token_ids for c in done["good"].outputs] == sequences


def test_bad_beam_params_name_the_field():
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))


def test_bench_beam_reports_fewer_pages_with_sharing(tiny_llama_dir, tmp_path):
    import json

    import pagedrs.bench as bench

    path = tmp_path / "beam.json"
    assert bench.main(["beam", "--quick", "--model", str(tiny_llama_dir), "--block-size", "4", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["beam_width"] for r in rows] == [2, 4, 8]
    for r in rows:
        assert r["peak_pages_shared"] < r["peak_pages_private"] <= r["peak_pages_contiguous"]
    assert next(r for r in rows if r["beam_width"] == 4)["saving_vs_private_pct"] >= 40.0


def test_a_beam_request_is_checked_before_it_is_queued(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, max_model_len=128, max_n=4))
    with pytest.raises(ValueError, match=r"BeamSearchParams.beam_width=8 .*EngineArgs.max_n"):
        engine.add_request("wide", [1, 2, 3], BeamSearchParams(beam_width=8, max_tokens=4))
    with pytest.raises(ValueError, match="blocks"):  # 4 beams of up to 100 tokens can never fit 32 blocks
        engine.add_request("long", [1, 2, 3], BeamSearchParams(beam_width=4, max_tokens=97))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        LLM.beam_search(type("FakeLLM", (), {})(), [[1, 2]], SamplingParams())
    assert engine.num_unfinished() == 0 and not engine.scheduler.has_unfinished()
