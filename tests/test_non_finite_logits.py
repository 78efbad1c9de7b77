"""Beam search under NaN logits: the request ends with NonFiniteLogitsError, never with hypotheses.

Before, ``BeamSearch.on_step`` ranked the log-softmax of NaN logits as it was: a search whose rows
were all NaN "finished" with empty hypotheses and finish_reason "length", and ``LLM.beam_search``
reported them as its result. Sampling's rule (``record_token``, ``fast_rows.record``) now holds for
beams too: finish_reason "error", the pages freed, the other requests unchanged.

The model is a tiny untied Mistral whose embedding row of one token is NaN: a prompt holding that
token has NaN logits from its first row, a search whose beam picks it has NaN logits one step later,
and every other prompt computes exactly what the clean model computes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import make_tiny_model
from pagedrs import LLM, BeamSearchParams, Engine, EngineArgs, SamplingParams
from test_engine_hardening import run_to_end

torch.set_num_threads(1)

NAN_TOKEN = 81  # the clean model's first pick after MID_SEARCH (checked in ``models``)
AT_ONCE = [5, NAN_TOKEN, 7]  # NaN logits at output token 0
MID_SEARCH = [5, 6, 7]  # a beam takes NAN_TOKEN first: NaN logits at output token 1
HEALTHY = [[10, 11, 12], [20, 21, 22], [30, 31]]
PARAMS = BeamSearchParams(beam_width=2, max_tokens=4)
ENGINE_KW: dict[str, Any] = dict(block_size=4, num_gpu_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the clean model's folder, the same model with NAN_TOKEN's embedding row NaN)."""
    from safetensors.torch import load_file, save_file

    clean = tmp_path_factory.mktemp("tiny-mistral-clean")
    make_tiny_model("mistral", clean)  # untied: the NaN row is not also the head's row of that token
    broken = tmp_path_factory.mktemp("tiny-mistral-nan")
    shutil.rmtree(broken)
    shutil.copytree(clean, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file(weights, str(broken / "model.safetensors"))
    first = LLM(model=str(clean), **ENGINE_KW).beam_search([{"prompt_token_ids": MID_SEARCH}], PARAMS)[0]
    assert NAN_TOKEN in {s.token_ids[0] for s in first.sequences}, first  # the premise of MID_SEARCH
    return clean, broken


def prompts_of(token_lists: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in token_lists]


def hypotheses(out) -> list[tuple[list[int], str]]:
    return [(list(c.token_ids), c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_logits_end_a_beam_search_with_an_error_and_the_others_go_on(models, async_scheduling):
    clean, broken = models
    expected = LLM(model=str(clean), **ENGINE_KW).generate(prompts_of(HEALTHY), PARAMS, use_tqdm=False)
    engine = Engine(EngineArgs(model=str(broken), skip_tokenizer_init=True, async_scheduling=async_scheduling,
                               **ENGINE_KW))
    engine.add_request("at-once", AT_ONCE, PARAMS)
    engine.add_request("mid-search", MID_SEARCH, PARAMS)
    engine.add_request("sampled", HEALTHY[0], SamplingParams(max_tokens=4, temperature=0.0))
    for i, prompt in enumerate(HEALTHY):
        engine.add_request(f"healthy-{i}", prompt, PARAMS)
    outputs = run_to_end(engine)
    for request_id, at in [("at-once", 0), ("mid-search", 1)]:
        out = outputs[request_id]
        assert out.finished and out.error is not None and "NonFiniteLogitsError" in out.error, out
        assert f"logits were NaN at output token {at}" in out.error
        assert [c.finish_reason for c in out.outputs] == ["error", "error"], out
        assert all(c.score is None for c in out.outputs), out  # no hypothesis was ranked
    for i, want in enumerate(expected):
        assert outputs[f"healthy-{i}"].error is None
        assert hypotheses(outputs[f"healthy-{i}"]) == hypotheses(want)
        got = [c.score for c in outputs[f"healthy-{i}"].outputs]
        assert got == pytest.approx([c.score for c in want.outputs], abs=1e-5)
    assert outputs["sampled"].error is None and len(outputs["sampled"].outputs[0].token_ids) == 4
    assert engine.stats()["num_free_gpu_blocks"] == ENGINE_KW["num_gpu_blocks"]  # nothing held
    engine.check_invariants()


def test_llm_beam_search_returns_the_error_and_no_sequences(models):
    """``LLM.beam_search`` (vLLM's shape) and ``generate(use_beam_search=True)``: a failed search has no
    sequences to mistake for its answer, and says why; the other prompts' results are whole."""
    clean, broken = models
    expected = LLM(model=str(clean), **ENGINE_KW).beam_search(prompts_of(HEALTHY[:1]), PARAMS)[0]
    llm = LLM(model=str(broken), **ENGINE_KW)
    failed_at_once, failed_mid, healthy = llm.beam_search(prompts_of([AT_ONCE, MID_SEARCH, HEALTHY[0]]), PARAMS)
    for failed in (failed_at_once, failed_mid):
        assert failed.sequences == [] and failed.error is not None and "NonFiniteLogitsError" in failed.error
    assert healthy.error is None  # the same search (a batch of 3 rounds differently from a batch of 1)
    assert [s.tokens for s in healthy.sequences] == [s.tokens for s in expected.sequences]
    assert [s.score for s in healthy.sequences] == pytest.approx([s.score for s in expected.sequences], abs=1e-5)
    out = llm.generate(prompts_of([MID_SEARCH]), SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4),
                       use_tqdm=False)[0]
    assert out.error is not None and "NonFiniteLogitsError" in out.error
    assert [c.finish_reason for c in out.outputs] == ["error"]  # n=1
    assert llm.engine.stats()["num_free_gpu_blocks"] == ENGINE_KW["num_gpu_blocks"]


@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core-process"])
def test_server_beam_search_with_nan_logits_answers_500_and_serves_on(models, core_process):
    pytest.importorskip("fastapi")
    import httpx

    from server_fakes import assert_nothing_left, live_server

    _, broken = models
    body = {"model": "m", "max_tokens": 4, "use_beam_search": True, "n": 2, "temperature": 0}
    with live_server(broken, ENGINE_KW, "m", core_process=core_process) as served:
        response = httpx.post(served.url + "/v1/completions", json={**body, "prompt": MID_SEARCH}, timeout=120)
        assert response.status_code == 500, response.text
        assert "NonFiniteLogitsError" in response.json()["error"]["message"]
        assert "logits were NaN at output token 1" in response.json()["error"]["message"]
        response = httpx.post(served.url + "/v1/completions", json={**body, "prompt": HEALTHY[0]}, timeout=120)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
        assert_nothing_left(served.loop)


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int = 4) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    outputs = run_to_end(engine)
    return {rid: (out.error, out.outputs[0].token_ids) for rid, out in outputs.items()}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_pages_a_nan_request_leaves_poison_no_later_request(models, prefix_caching):
    """A request whose K/V went NaN fails; its pages go back to the pool holding NaN. Attention gathers a
    page whole and masks the slots past a sequence's length (a reused page's unwritten tail, the padding
    of a bucket), and a NaN there times its zero weight was NaN: 4 of the next 6 requests failed with
    NonFiniteLogitsError, none of them with a NaN of its own. The torch backend now zeroes those slots
    after the gather, as the CUDA kernel loads zeros there. With prefix caching, two prompts share pages
    (the cascade path of decode)."""
    clean, broken = models
    shared = list(range(100, 124))
    prompts = [list(range(20 + i, 23 + 9 * i)) for i in range(5)] + [shared + [7, 8], shared + [9]]
    kw = dict(ENGINE_KW, enable_prefix_caching=prefix_caching)
    want = greedy_tokens(Engine(EngineArgs(model=str(clean), skip_tokenizer_init=True, **kw)), prompts)
    assert all(error is None and NAN_TOKEN not in tokens for error, tokens in want.values())  # the premise
    engine = Engine(EngineArgs(model=str(broken), skip_tokenizer_init=True, **kw))
    bad = greedy_tokens(engine, [[5, NAN_TOKEN, *range(10, 60)]])
    assert "NonFiniteLogitsError" in (bad["p0"][0] or "")
    assert greedy_tokens(engine, prompts) == want
    engine.check_invariants()
