"""SamplingParams.prompt_logprobs: every prompt token's log-probability (and the top-k alternatives)
equals transformers' ``log_softmax(model(prompt).logits)`` to 1e-4 — in one chunk or many, beside
other requests, under prefix caching (the same prompt again still gets all of them), through the
in-process and the multiprocess client and with asynchronous scheduling; bad values are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedrs import LLM, Engine, EngineArgs, SamplingParams
from pagedrs.sampling_params import MAX_PROMPT_LOGPROBS
from pagedrs.server.engine_core import RemoteEngine
from test_engine import greedy, hf_greedy

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def make(tiny_llama_dir, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, swap_space_gb=0,
                                max_model_len=256)
    args.update(kw)
    return Engine(EngineArgs(**args))


def prompt(n: int, seed: int = 0, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(eng: Any, requests: dict[str, tuple[list[int], SamplingParams]], salt: str | None = None) -> dict[str, Any]:
    for rid, (p, params) in requests.items():
        eng.add_request(rid, {"prompt_token_ids": p}, params, cache_salt=salt)
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def check(hf_model, ids: list[int], got: Any, k: int) -> None:
    """got is vLLM's list: None, then per token {its id: logprob, top-k...}, against the referee."""
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry = got[p]
        assert entry is not None and ids[p] in entry, (p, entry)
        assert abs(entry[ids[p]] - float(ref[p - 1, ids[p]])) < TOL, (p, entry[ids[p]], float(ref[p - 1, ids[p]]))
        vals, top = ref[p - 1].topk(k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        assert set(entry) == {ids[p], *top.tolist()}, (p, entry, top.tolist())
        for t, v in zip(top.tolist(), vals.tolist()):
            assert abs(entry[t] - v) < TOL


@pytest.mark.parametrize("budget", [None, 7], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, hf_model, budget):
    kw = {} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}
    eng = make(tiny_llama_dir, **kw)
    ids, other = prompt(23), prompt(9, seed=1)
    done = run(eng, {"p": (ids, greedy(3, prompt_logprobs=5)), "o": (other, greedy(6))})
    check(hf_model, ids, done["p"].prompt_logprobs, 5)
    assert done["o"].prompt_logprobs is None, "not asked: not computed"
    assert list(done["p"].outputs[0].token_ids) == hf_greedy(hf_model, ids, 3)
    assert list(done["o"].outputs[0].token_ids) == hf_greedy(hf_model, other, 6)


def test_k_zero_gives_the_prompt_tokens_only_and_a_one_token_prompt_gives_none(tiny_llama_dir, hf_model):
    eng = make(tiny_llama_dir)
    ids = prompt(10, seed=2)
    done = run(eng, {"a": (ids, greedy(2, prompt_logprobs=0)), "b": ([7], greedy(2, prompt_logprobs=3))})
    check(hf_model, ids, done["a"].prompt_logprobs, 0)
    assert done["b"].prompt_logprobs == [None]


def test_a_cached_prompt_still_gets_every_prompt_logprob(tiny_llama_dir, hf_model):
    """The request with prompt_logprobs reuses no prefix (its rows must be computed); the others
    still share theirs."""
    eng = make(tiny_llama_dir)
    ids = prompt(21, seed=3)
    first = run(eng, {"warm": (ids, greedy(2))})["warm"]
    assert first.num_cached_tokens == 0
    done = run(eng, {"again": (ids, greedy(2, prompt_logprobs=2))})
    assert done["again"].num_cached_tokens == 0, "a cached prefix computes no logits"
    check(hf_model, ids, done["again"].prompt_logprobs, 2)
    assert list(done["again"].outputs[0].token_ids) == hf_greedy(hf_model, ids, 2)
    later = run(eng, {"later": (ids, greedy(2))})["later"]
    assert later.num_cached_tokens == 20, "the plain request still hits the first one's pages"
    salted = run(eng, {"s1": (ids, greedy(2, prompt_logprobs=1))}, salt="tenant")
    check(hf_model, ids, salted["s1"].prompt_logprobs, 1)


def test_n_samples_and_several_prompt_requests_in_one_step(tiny_llama_dir, hf_model):
    eng = make(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=8)
    a, b = prompt(13, seed=4), prompt(30, seed=5)
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True, prompt_logprobs=4)
    done = run(eng, {"a": (a, params), "b": (b, greedy(2, prompt_logprobs=4)), "c": (a, greedy(2, prompt_logprobs=4))})
    check(hf_model, a, done["a"].prompt_logprobs, 4)
    check(hf_model, b, done["b"].prompt_logprobs, 4)
    check(hf_model, a, done["c"].prompt_logprobs, 4)
    assert len(done["a"].outputs) == 2


def test_async_scheduling_and_the_multiprocess_client(tiny_llama_dir, hf_model):
    ids = prompt(18, seed=6)
    args = EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, swap_space_gb=0, max_model_len=256,
                      max_num_batched_tokens=5, async_scheduling=True)
    done = run(Engine(args), {"x": (ids, greedy(4, prompt_logprobs=3))})
    check(hf_model, ids, done["x"].prompt_logprobs, 3)
    remote = RemoteEngine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, swap_space_gb=0,
                                     max_model_len=256, max_num_batched_tokens=6))
    try:
        done = run(remote, {"y": (ids, greedy(2, prompt_logprobs=3))})
        check(hf_model, ids, done["y"].prompt_logprobs, 3)
        stats = remote.stats()  # the leak check cannot see into a core process
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] and stats["num_running"] == 0
    finally:
        remote.shutdown()


def test_llm_generate_carries_prompt_logprobs(tiny_llama_dir, hf_model):
    ids = prompt(12, seed=7)
    with LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, swap_space_gb=0, max_model_len=256) as llm:
        (out,) = llm.generate([{"prompt_token_ids": ids}], greedy(2, prompt_logprobs=2))
    check(hf_model, ids, out.prompt_logprobs, 2)


@pytest.mark.parametrize("value", [-1, MAX_PROMPT_LOGPROBS + 1, True, 1.5, "3"])
def test_bad_prompt_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_beam_search_with_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs.*beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, prompt_logprobs=1)


def test_a_recompute_preemption_keeps_them_exact(tiny_llama_dir, hf_model):
    """A pool too small for all three: one is preempted and recomputed; every entry still matches."""
    eng = make(tiny_llama_dir, num_gpu_blocks=14, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = {f"r{i}": prompt(18, seed=10 + i) for i in range(3)}
    done = run(eng, {rid: (p, greedy(14, prompt_logprobs=2)) for rid, p in prompts.items()})
    assert eng.stats()["num_recompute_preemptions"] >= 1
    for rid, p in prompts.items():
        check(hf_model, p, done[rid].prompt_logprobs, 2)
        assert list(done[rid].outputs[0].token_ids) == hf_greedy(hf_model, p, 14)


def test_two_tensor_parallel_ranks_give_them_too(tiny_llama_dir, hf_model):
    """Rank 0 returns the extra rows; the workers get logit_rows through the step codec and ignore them."""
    pytest.importorskip("psutil")
    eng = Engine(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, block_size=4, num_gpu_blocks=64,
                            max_model_len=128, swap_space_gb=0.001, cpu_threads=1, max_num_batched_tokens=8))
    try:
        ids = prompt(15, seed=8)
        done = run(eng, {"t": (ids, greedy(3, prompt_logprobs=2))})
        check(hf_model, ids, done["t"].prompt_logprobs, 2)
        assert list(done["t"].outputs[0].token_ids) == hf_greedy(hf_model, ids, 3)
    finally:
        eng.shutdown()
