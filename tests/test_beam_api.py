"""Beam search and best_of through SamplingParams, ``llm.generate`` and the server.

``SamplingParams(use_beam_search=True, beam_width=k, n=n)`` must be the very search
``llm.beam_search`` runs and equal transformers' ``generate(num_beams=k,
num_return_sequences=n, do_sample=False)``: sequences token for token, ``score`` equal to
HF's ``sequences_scores``. ``best_of > n`` must return the n samples of the highest
cumulative log-probability among the same seeded samples ``n=best_of`` draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pagedrs import LLM, BeamSearchParams, Engine, EngineArgs, SamplingParams
from test_beam_search import PROMPTS, eos_heavy_model, hf_beam_search
from test_engine_hardening import run_to_end

torch.set_num_threads(1)

ENGINE_KW: dict[str, Any] = dict(block_size=4, num_gpu_blocks=256, max_model_len=128)


def hf_beams(model, prompt: list[int], k: int, n: int, max_tokens: int, eos: set[int], **kw):
    """(generated token lists, scores) of transformers' beam search, best first."""
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, n=n)
    sequences, scores = hf_beam_search(model, prompt, params, eos, **kw)
    return [s[len(prompt):] for s in sequences], scores


def assert_outputs_equal_hf(out, model, prompt, k, n, max_tokens, eos, **kw) -> None:
    sequences, scores = hf_beams(model, prompt, k, n, max_tokens, eos, **kw)
    assert [c.token_ids for c in out.outputs] == sequences
    assert [c.index for c in out.outputs] == list(range(n))
    assert [c.score for c in out.outputs] == pytest.approx(scores, abs=1e-4, rel=1e-4)
    for c in out.outputs:  # cumulative_logprob is the plain sum; score is HF's length-penalized one
        assert c.score == pytest.approx(c.cumulative_logprob / len(c.token_ids), rel=1e-5)


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), **ENGINE_KW)


def prompts_of(token_lists):
    return [{"prompt_token_ids": p} for p in token_lists]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_generate_with_use_beam_search_equals_beam_search_and_transformers(llm, hf_llama, k):
    params = SamplingParams(use_beam_search=True, beam_width=k, n=k, max_tokens=10, temperature=0.0)
    outs = llm.generate(prompts_of(PROMPTS), params, use_tqdm=False)
    reference = llm.beam_search(prompts_of(PROMPTS), BeamSearchParams(beam_width=k, max_tokens=10))
    eos = llm.engine.tokenizer.eos_token_ids
    for prompt, out, ref in zip(PROMPTS, outs, reference):
        assert out.finished and len(out.outputs) == k
        assert [c.token_ids for c in out.outputs] == [s.token_ids for s in ref.sequences]
        # the second run reads the prompts' pages from the prefix cache: float noise only
        assert [c.score for c in out.outputs] == pytest.approx([s.score for s in ref.sequences], abs=1e-5)
        assert_outputs_equal_hf(out, hf_llama, prompt, k, k, 10, eos)


def test_n_best_of_a_wider_beam_with_stop_token_ids_and_min_tokens_equal_transformers(llm, hf_llama):
    """n=2 of k=4 (HF's num_return_sequences); stop_token_ids join HF's eos_token_id list;
    min_tokens is HF's min_new_tokens. The default temperature (1.0) is accepted: it
    leaves the log-probabilities as they are."""
    eos = set(llm.engine.tokenizer.eos_token_ids)
    plain = llm.generate(prompts_of(PROMPTS), SamplingParams(use_beam_search=True, beam_width=4, max_tokens=12),
                         use_tqdm=False)
    assert all(len(out.outputs) == 1 for out in plain), "n defaults to 1: the best hypothesis only"
    # stop tokens the unconstrained searches generate: the 2nd token of each best beam (which
    # min_tokens must hold back) and the 4th to 6th (which may then end hypotheses)
    stop = sorted({t for out in plain for t in [out.outputs[0].token_ids[1], *out.outputs[0].token_ids[3:6]]})
    params = SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=12, stop_token_ids=stop, min_tokens=3)
    outs = llm.generate(prompts_of(PROMPTS), params, use_tqdm=False)
    stopped = 0
    for prompt, out in zip(PROMPTS, outs):
        assert_outputs_equal_hf(out, hf_llama, prompt, 4, 2, 12, eos | set(stop), min_new_tokens=3)
        for c in out.outputs:
            assert len(c.token_ids) >= 3
            assert not set(c.token_ids[:2]) & set(stop), "min_tokens keeps stop tokens out of the first tokens"
            if c.finish_reason == "stop" and c.token_ids[-1] in stop:
                stopped += 1
                assert c.stop_reason == c.token_ids[-1]
                assert c.text == llm.engine.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
    assert stopped, "some hypotheses must end at a stop token id"


@pytest.fixture(scope="module")
def eos_llm(tiny_llama_dir, hf_llama, tmp_path_factory) -> LLM:
    folder, _ = eos_heavy_model(tiny_llama_dir, hf_llama, tmp_path_factory)
    return LLM(model=str(folder), **ENGINE_KW)


@pytest.mark.parametrize("ignore_eos, early_stopping, length_penalty",
                         [(False, True, 1.0), (False, "never", 0.5), (True, "never", 2.0)])
def test_every_search_setting_reaches_the_search(eos_llm, ignore_eos, early_stopping, length_penalty):
    """ignore_eos, early_stopping, length_penalty and max_tokens mean what they mean in
    BeamSearchParams (whose search equals transformers', tests/test_beam_search.py), on a
    model whose beams often end in EOS."""
    common = dict(max_tokens=16, ignore_eos=ignore_eos, early_stopping=early_stopping, length_penalty=length_penalty)
    outs = eos_llm.generate(prompts_of(PROMPTS), SamplingParams(use_beam_search=True, beam_width=4, n=4, **common),
                            use_tqdm=False)
    refs = eos_llm.beam_search(prompts_of(PROMPTS), BeamSearchParams(beam_width=4, **common))
    reasons = set()
    for out, ref in zip(outs, refs):
        assert [c.token_ids for c in out.outputs] == [s.token_ids for s in ref.sequences]
        assert [c.score for c in out.outputs] == pytest.approx([s.score for s in ref.sequences], abs=1e-5)
        assert [c.finish_reason for c in out.outputs] == [s.finish_reason for s in ref.sequences]
        reasons |= {c.finish_reason for c in out.outputs}
    assert reasons == ({"length"} if ignore_eos else {"stop", "length"})


@pytest.fixture(scope="module")
def smollm2_llm() -> LLM:
    return LLM(model="smollm2-135m", block_size=16, num_gpu_blocks=64, max_model_len=256, weight_dtype="float32")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_generate_with_use_beam_search_equals_transformers_on_the_embedded_smollm2(smollm2_llm, hf_smollm2, k):
    tok = smollm2_llm.engine.tokenizer
    prompt = tok.encode("The capital of France is")
    n = min(k, 2)
    out = smollm2_llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(use_beam_search=True, beam_width=k, n=n, max_tokens=5), use_tqdm=False)[0]
    assert_outputs_equal_hf(out, hf_smollm2, prompt, k, n, 5, tok.eos_token_ids)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_beam_and_ordinary_requests_share_steps_and_the_ordinary_ones_are_unchanged(llm, hf_llama):
    engine = llm.engine
    ordinary = {
        "greedy": ({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=12)),
        "seeded": ({"prompt_token_ids": PROMPTS[1]}, SamplingParams(n=2, seed=11, max_tokens=12, logprobs=1)),
    }
    alone = {}
    for rid, (prompt, params) in ordinary.items():
        engine.add_request(rid, prompt, params)
        alone.update(run_to_end(engine))
    beam = SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=12)
    engine.add_request("beam", {"prompt_token_ids": PROMPTS[2]}, beam)
    for rid, (prompt, params) in ordinary.items():
        engine.add_request(rid, prompt, params)
    beam_outputs, shared_steps, done = 0, 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        beam_outputs += sum(o.request_id == "beam" for o in outs)
        if engine.num_unfinished() == 3 and engine.scheduler.num_running >= 4 + 3:
            shared_steps += 1  # four beams and three ordinary sequences in one step
        done.update({o.request_id: o for o in outs if o.finished})
        engine.check_invariants()
    assert shared_steps > 0
    assert beam_outputs == 1, "a beam search reports only its final output"
    for rid in ordinary:
        assert [(c.token_ids, c.text, c.finish_reason) for c in done[rid].outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in alone[rid].outputs]
    assert_outputs_equal_hf(done["beam"], hf_llama, PROMPTS[2], 4, 2, 12, engine.tokenizer.eos_token_ids)


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(llm):
    """Sample i of a seeded request draws from seed + i whatever the batch: ``n=4`` draws the
    very samples ``best_of=4`` ranks."""
    prompt = prompts_of(PROMPTS[:1])
    every = llm.generate(prompt, SamplingParams(n=4, seed=5, max_tokens=8, logprobs=0), use_tqdm=False)[0].outputs
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, seed=5, max_tokens=8), use_tqdm=False)[0].outputs
    for c in every:
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids)))
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in every}) > 2, "the samples must differ for the ranking to mean anything"
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])


def test_best_of_reports_only_the_final_output(llm):
    engine = llm.engine
    engine.add_request("b", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(n=1, best_of=3, seed=1, max_tokens=6))
    outs = [o for _ in range(50) if engine.has_unfinished() for o in engine.step()]
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs) == 1
    assert len(outs[0].outputs[0].delta_token_ids) == len(outs[0].outputs[0].token_ids) == 6


def test_abort_mid_search_reports_n_outputs_and_leaves_no_pages(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), **ENGINE_KW))
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        assert engine.step() == [], "nothing is reported before the search ends"
    assert engine.scheduler.num_running == 4
    assert engine.abort("b")
    out = engine.step()[0]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 2
    s = engine.stats()
    assert s["num_free_gpu_blocks"] == s["num_gpu_blocks"] and not engine.scheduler.has_unfinished()


def test_chat_takes_beam_search_params(llm):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    out = llm.chat(messages, SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6))[0]
    ids = llm.engine.tokenizer.apply_chat_template(messages)
    ref = llm.beam_search(prompts_of([ids]), BeamSearchParams(beam_width=3, max_tokens=6))[0]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in ref.sequences[:2]]


INVALID = [
    (dict(use_beam_search=True, beam_width=2, n=3), r"SamplingParams.n=3 .*n <= beam_width=2"),
    (dict(use_beam_search=True, beam_width=0), r"SamplingParams.beam_width=0 .*\[1, 256\]"),
    (dict(use_beam_search=True, beam_width=True), r"SamplingParams.beam_width=True"),
    (dict(use_beam_search=True, temperature=0.7), r"SamplingParams.temperature=0.7 is not allowed with use_beam_search"),
    (dict(use_beam_search=True, top_p=0.9), r"SamplingParams.top_p=0.9 is not allowed"),
    (dict(use_beam_search=True, top_k=5), r"SamplingParams.top_k=5 is not allowed"),
    (dict(use_beam_search=True, min_p=0.1), r"SamplingParams.min_p=0.1 is not allowed"),
    (dict(use_beam_search=True, seed=3), r"SamplingParams.seed=3 is not allowed"),
    (dict(use_beam_search=True, repetition_penalty=1.2), r"SamplingParams.repetition_penalty=1.2 is not allowed"),
    (dict(use_beam_search=True, logprobs=2), r"SamplingParams.logprobs=2 is not allowed"),
    (dict(use_beam_search=True, stop=["\n"]), r"SamplingParams.stop=\['\\n'\] is not allowed.*stop_token_ids"),
    (dict(use_beam_search=True, length_penalty=float("nan")), r"SamplingParams.length_penalty=nan .*finite"),
    (dict(use_beam_search=True, early_stopping="sometimes"), r"SamplingParams.early_stopping='sometimes'"),
    (dict(use_beam_search=True, best_of=3, beam_width=4), r"SamplingParams.best_of=3 .*beam_width=4 differs"),
    (dict(use_beam_search=True, best_of=300), r"SamplingParams.best_of=300 .*at most 256"),
    (dict(use_beam_search="yes"), r"SamplingParams.use_beam_search='yes'"),
    (dict(beam_width=4), r"SamplingParams.beam_width=4 is only used with use_beam_search=True"),
    (dict(length_penalty=0.5), r"SamplingParams.length_penalty=0.5 is only used with use_beam_search=True"),
    (dict(early_stopping=True), r"SamplingParams.early_stopping=True is only used"),
    (dict(n=3, best_of=2), r"SamplingParams.best_of=2 .*\[n=3, 1024\]"),
]


@pytest.mark.parametrize("kwargs, message", INVALID)
def test_invalid_combinations_name_field_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_widths_above_max_n_are_refused_before_anything_is_queued(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, max_model_len=128, max_n=4))
    cases = [
        (SamplingParams(use_beam_search=True, beam_width=8), r"SamplingParams.beam_width=8 .*EngineArgs.max_n"),
        (SamplingParams(use_beam_search=True, best_of=6), r"SamplingParams.best_of=6 .*EngineArgs.max_n"),
        (SamplingParams(use_beam_search=True, n=5), r"SamplingParams.n=5 .*EngineArgs.max_n"),
        (SamplingParams(n=2, best_of=5), r"SamplingParams.best_of=5 .*EngineArgs.max_n"),
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", [1, 2, 3], params)
    assert engine.num_unfinished() == 0 and not engine.scheduler.has_unfinished()


# ---- the server ------------------------------------------------------------------------

pytest.importorskip("fastapi")
from server_fakes import assert_nothing_left, live_server  # noqa: E402

MODEL = "tiny-llama"


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def served(request: pytest.FixtureRequest, tiny_llama_dir: Path):
    """Both placements of the engine: the params and the final-only outputs cross the core's pipe."""
    with live_server(tiny_llama_dir, ENGINE_KW, MODEL, core_process=request.param == "core-process") as live:
        yield live


def post(served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + path, json={"model": MODEL, **body}, timeout=120)


def test_server_use_beam_search_returns_the_n_best_hypotheses(served, llm):
    prompt = PROMPTS[1]
    for body, width in [({"n": 2, "best_of": 4}, 4), ({"n": 3}, 3)]:
        response = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "use_beam_search": True,
                                                    "temperature": 0, "length_penalty": 0.5, **body})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        expected = llm.generate(prompts_of([prompt]), SamplingParams(
            use_beam_search=True, beam_width=width, n=body["n"], max_tokens=8, length_penalty=0.5), use_tqdm=False)[0]
        assert [c["index"] for c in choices] == list(range(body["n"]))
        assert [c["text"] for c in choices] == [c.text for c in expected.outputs]
        assert [c["finish_reason"] for c in choices] == [c.finish_reason for c in expected.outputs]
    response = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "fox"}], "n": 2,
                                                     "max_tokens": 5, "use_beam_search": True})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    assert_nothing_left(served.loop)


def test_server_best_of_returns_the_top_n_by_cumulative_logprob(served, llm):
    prompt = PROMPTS[0]
    response = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "n": 2, "best_of": 5, "seed": 9})
    assert response.status_code == 200, response.text
    every = llm.generate(prompts_of([prompt]), SamplingParams(n=5, seed=9, max_tokens=8), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert len({c.text for c in every}) > 2
    assert [c["text"] for c in response.json()["choices"]] == [c.text for c in ranked[:2]]
    assert response.json()["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in ranked[:2])
    assert_nothing_left(served.loop)


BAD = [
    # (endpoint, body, param, text)
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of", "SamplingParams.best_of=2"),
    ("/v1/completions", {"n": 1, "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "stream": True}, "use_beam_search", "cannot be streamed"),
    ("/v1/completions", {"best_of": 129}, "best_of", "128"),
    ("/v1/completions", {"use_beam_search": True, "temperature": 0.5}, "temperature", "use_beam_search"),
    ("/v1/completions", {"use_beam_search": True, "stop": ["x"]}, "stop", "stop_token_ids"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty", "only used with use_beam_search"),
    ("/v1/completions", {"use_beam_search": True, "early_stopping": "later"}, "early_stopping", None),
    ("/v1/chat/completions", {"use_beam_search": True, "stream": True}, "use_beam_search", "cannot be streamed"),
]


@pytest.mark.parametrize("path, body, param, text", BAD)
def test_server_refuses_what_it_cannot_honour_with_a_400_naming_the_field(served, path, body, param, text):
    prompt = {"prompt": "fox"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "fox"}]}
    response = post(served, path, {**prompt, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "")
    if text:
        assert text in error["message"]
