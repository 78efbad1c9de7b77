"""A prefix-cache hit only for K/V that was written (issue 23, item 1), and cache salts.

Each failure test makes the executor raise at one point of a request's life, then sends a
prompt whose prefix that failed step would have cached. Before the fix the failed step's
blocks stayed cached over K/V that was never written, and the second request answered
wrong with no error; now its greedy output equals transformers on the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_runs import drain
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.errors import EngineDeadError

BS = 4


def make_engine(model_dir, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=BS, num_gpu_blocks=64, swap_space_gb=0.001, max_model_len=96,
                enable_prefix_caching=True)
    args.update(kw)
    return Engine(EngineArgs(**args))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt_ids):]


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=g).tolist()


def run(engine: Engine) -> dict:
    return drain(engine, max_steps=1000)


def fail_call(engine: Engine, monkeypatch, which: int) -> dict:
    """The executor raises on its `which`-th execute (1-based), once."""
    real = engine.executor.execute
    calls = {"n": 0}

    def execute(step):
        calls["n"] += 1
        if calls["n"] == which:
            raise RuntimeError("injected: the forward failed")
        return real(step)

    monkeypatch.setattr(engine.executor, "execute", execute)
    return calls


def assert_free(engine: Engine) -> None:
    s = engine.stats()
    assert s["num_free_gpu_blocks"] == s["num_gpu_blocks"], s
    assert s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0, s
    engine.check_invariants()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_a_failed_prefill_caches_none_of_its_blocks(tiny_llama_dir, hf_model, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    p = prompt(33)
    fail_call(engine, monkeypatch, 1)
    engine.add_request("a", p, greedy(6))
    done = run(engine)
    assert "injected" in done["a"].error
    hits = engine.stats()["prefix_hits"]
    engine.add_request("b", p, greedy(6))
    done = run(engine)
    assert done["b"].error is None
    assert done["b"].outputs[0].token_ids == hf_greedy(hf_model, p, 6)
    assert engine.stats()["prefix_hits"] == hits, "a block of the failed step was a hit"
    assert done["b"].num_cached_tokens == 0
    assert engine.stats()["num_failed_steps"] == 1
    assert_free(engine)


def test_a_chunked_prefill_that_fails_on_its_second_chunk_keeps_only_the_first(tiny_llama_dir, hf_model, monkeypatch):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    p = prompt(33, seed=1)
    fail_call(engine, monkeypatch, 2)
    engine.add_request("a", p, greedy(5))
    assert "injected" in run(engine)["a"].error
    engine.add_request("b", p, greedy(5))
    done = run(engine)
    assert done["b"].outputs[0].token_ids == hf_greedy(hf_model, p, 5)
    # The first chunk (16 tokens, 4 blocks) was written and stays a hit; nothing after it.
    assert done["b"].num_cached_tokens == 16
    assert_free(engine)


def test_a_failed_decode_that_completes_a_block_does_not_cache_it(tiny_llama_dir, hf_model, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    p = prompt(31, seed=2)  # 7 full blocks and 3 tokens: the first decode completes block 8
    first = hf_greedy(hf_model, p, 2)
    fail_call(engine, monkeypatch, 2)  # the prompt's step runs, the first decode step fails
    engine.add_request("a", p, greedy(4))
    assert "injected" in run(engine)["a"].error
    follow = p + first  # 33 tokens: 8 blocks may be hits, the 8th is the one the failed decode filled
    engine.add_request("b", follow, greedy(4))
    done = run(engine)
    assert done["b"].outputs[0].token_ids == hf_greedy(hf_model, follow, 4)
    assert done["b"].num_cached_tokens == 28, "the prompt's 7 written blocks are hits, the 8th is not"
    assert_free(engine)


def test_requests_outside_the_failed_step_go_on_and_later_ones_share_what_was_written(tiny_llama_dir, hf_model,
                                                                                     monkeypatch):
    engine = make_engine(tiny_llama_dir)
    p = prompt(20, seed=3)
    engine.add_request("warm", p, greedy(3))
    run(engine)
    calls = fail_call(engine, monkeypatch, 1)
    engine.add_request("x", prompt(9, seed=4), greedy(3))
    assert "injected" in run(engine)["x"].error
    assert calls["n"] >= 1
    engine.add_request("again", p + [7, 8, 9, 10], greedy(3))
    done = run(engine)
    assert done["again"].outputs[0].token_ids == hf_greedy(hf_model, p + [7, 8, 9, 10], 3)
    assert done["again"].num_cached_tokens == 20  # the warm request's 5 blocks, written before the failure
    assert_free(engine)


def test_a_scheduler_that_fails_while_planning_declares_the_engine_dead(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", prompt(9), greedy(3))
    engine.add_request("b", prompt(5, seed=5), greedy(3))

    class Broken:
        def __init__(self, inner):
            self._inner = inner

        def schedule(self):
            raise RuntimeError("step 1 failed while it was planned: injected")

        def __getattr__(self, name):
            return getattr(self._inner, name)

    engine.scheduler = Broken(engine.scheduler)
    with pytest.raises(EngineDeadError, match="failed while it planned"):
        engine.step()
    assert engine.num_unfinished() == 0, "every request ends when the engine is dead"


# ---- cache salts ------------------------------------------------------------------------


def test_differently_salted_requests_share_no_page_and_equally_salted_ones_do(tiny_llama_dir, hf_model):
    engine = make_engine(tiny_llama_dir)
    p = prompt(25, seed=6)
    want = hf_greedy(hf_model, p, 3)
    outs = {}
    for rid, salt in [("t1", "tenant-a"), ("t2", "tenant-b"), ("t3", None), ("t4", "tenant-a")]:
        engine.add_request(rid, p, greedy(3), cache_salt=salt)
        outs[rid] = run(engine)[rid]
        assert outs[rid].outputs[0].token_ids == want
    assert [outs[r].num_cached_tokens for r in ("t1", "t2", "t3", "t4")] == [0, 0, 0, 24]
    assert_free(engine)


@pytest.mark.parametrize("salt, why", [
    (5, "must be a string"), (b"x", "must be a string"), ("", "1 to 256"), ("é" * 129, "1 to 256"),
    ("\ud800", "not valid UTF-8"),
])
def test_a_bad_cache_salt_is_refused_naming_it_with_nothing_changed(tiny_llama_dir, salt, why):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="cache_salt") as info:
        engine.add_request("r", prompt(5), greedy(2), cache_salt=salt)
    assert why in str(info.value)
    assert engine.num_unfinished() == 0
    engine.add_request("r", prompt(5), greedy(2), cache_salt="x" * 256)  # the id is still free; 256 bytes is fine
    assert run(engine)["r"].error is None


def test_salts_stay_apart_on_the_disk_tier_across_a_restart(tiny_llama_dir, tmp_path):
    p = prompt(25, seed=7)
    kw = dict(kv_disk_path=str(tmp_path / "kv"), kv_disk_gb=0.01)
    first = make_engine(tiny_llama_dir, **kw)
    first.add_request("a", p, greedy(2), cache_salt="tenant-a")
    run(first)
    first.shutdown()  # flushes the cached pages to disk
    second = make_engine(tiny_llama_dir, **kw)
    second.add_request("b", p, greedy(2), cache_salt="tenant-b")
    assert run(second)["b"].num_cached_tokens == 0
    assert second.stats()["prefix_hits_disk"] == 0
    second.add_request("a", p, greedy(2), cache_salt="tenant-a")
    assert run(second)["a"].num_cached_tokens == 24
    assert second.stats()["prefix_hits_disk"] > 0
    second.shutdown()


def test_an_interrupt_mid_step_caches_nothing_and_the_requests_go_on(tiny_llama_dir, hf_model, monkeypatch):
    """Ctrl-C in the forward (a notebook): the step is reported failed, not done by the next
    schedule; stepping again recomputes the request and answers as transformers does."""
    engine = make_engine(tiny_llama_dir)
    p = prompt(33, seed=8)
    real = engine.executor.execute
    calls = {"n": 0}

    def interrupted(step):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(step)

    monkeypatch.setattr(engine.executor, "execute", interrupted)
    engine.add_request("a", p, greedy(5))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.stats()["num_failed_steps"] == 1
    done = run(engine)
    assert done["a"].error is None
    assert done["a"].outputs[0].token_ids == hf_greedy(hf_model, p, 5)
    engine.add_request("b", p, greedy(5))
    assert run(engine)["b"].outputs[0].token_ids == hf_greedy(hf_model, p, 5)
    assert_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_interrupt_while_tokens_are_drawn_recomputes_the_step(tiny_llama_dir, hf_model, monkeypatch,
                                                                 async_scheduling):
    """Ctrl-C after the forward, while the step's tokens are drawn: the step was not reported done,
    so it is reported failed (its rows computed again, nothing it wrote a prefix hit; with
    asynchronous scheduling the step launched after it too). Before, the step was already reported
    done and the engine waited forever for tokens it never took: every later step was empty."""
    from pagedrs.core import fast_rows

    engine = make_engine(tiny_llama_dir, async_scheduling=async_scheduling)
    p = prompt(33, seed=9)
    real = fast_rows.draw
    calls = {"n": 0}

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(fast_rows, "draw", interrupted)
    _interrupted_then_exact(engine, p, hf_model)
    assert calls["n"] > 3  # (it raised at the third draw, the helper saw it, and the draws went on)
    engine.add_request("b", p, greedy(8))  # its prefix comes from the cache: only what was written
    assert run(engine)["b"].outputs[0].token_ids == hf_greedy(hf_model, p, 8)
    assert_free(engine)


def test_an_interrupt_while_a_speculative_steps_first_round_is_drawn_recomputes_it(tiny_llama_dir, hf_model,
                                                                                    monkeypatch):
    """The same with prompt-lookup speculation: an interrupt while round 0 of a verify step is drawn
    leaves the step open, so it is reported failed, its drafts dropped and its rows computed again
    (before, the drafts stayed unverified and the next plan ended every request). A later round's
    interrupt is the next test's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": None}
    engine = make_engine(tiny_llama_dir, speculative_config=spec, enable_prefix_caching=False)
    unit = prompt(5, seed=10)
    p = unit * 5  # repetitive: the lookup proposes drafts from the first step on
    rounds = _interrupt_in_verify(monkeypatch, "draw", 1)  # round 0 of the first verify step
    _interrupted_then_exact(engine, p, hf_model)
    assert rounds["n"] >= 1  # (it raised at round 0 of the first verify step: the helper saw it)
    assert_free(engine)


@pytest.mark.parametrize("where, at, spoil", [
    ("draw", 2, None),  # round 1 drawn: d1 was accepted (in the output), d2 d3 still held as drafts
    ("draw", 4, None),  # round 3 (the bonus): d1 d2 d3 accepted, none verified in the scheduler yet
    ("record", 2, 1),  # round 1 rejected d2 (the rest cut), interrupted before its token was recorded
])
def test_an_interrupt_in_a_later_verify_round_rewinds_the_sequence_and_stays_exact(
        tiny_llama_dir, hf_model, monkeypatch, where, at, spoil):
    """An interrupt after a verify step was reported done (round 0 drawn): nothing failed, so
    the step is not recomputed; each speculating sequence is rewound to the tokens the engine
    recorded, its last one computed again (``Scheduler.rewind``). Before, the drafts stayed
    unverified (or the sequence waited for a token that never came): the next plan ended every
    request. The proposer knows transformers' continuation, so rounds past 0 happen; ``spoil``
    changes one draft so that round rejects."""
    from pagedrs.core import spec_step

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": None}
    engine = make_engine(tiny_llama_dir, speculative_config=spec)
    vocab = engine.loaded.config.vocab_size
    p = prompt(9, seed=11)
    ref = hf_greedy(hf_model, p, 8)

    def propose_(tokens, k, lo, hi):
        n = len(tokens) - len(p)
        drafts = list(ref[n : n + k])
        if spoil is not None and spoil < len(drafts):
            drafts[spoil] = (drafts[spoil] + 1) % vocab
        return np.asarray(drafts, dtype=np.uint32)

    monkeypatch.setattr(spec_step, "propose", propose_)
    _interrupt_in_verify(monkeypatch, where, at)
    engine.add_request("a", p, greedy(8))
    with pytest.raises(KeyboardInterrupt):
        for _ in range(20):
            engine.step()
    assert engine.stats()["num_failed_steps"] == 0  # reported done before the interrupt: rewound, not failed
    done = run(engine)
    assert done["a"].error is None
    assert done["a"].outputs[0].token_ids == ref
    engine.add_request("b", p + ref[:5], greedy(3))  # its prefix comes from the cache: only verified tokens
    assert run(engine)["b"].outputs[0].token_ids == ref[5:8]
    assert_free(engine)


def _interrupt_in_verify(monkeypatch, name: str, at: int) -> dict:
    """``fast_rows.<name>`` raises KeyboardInterrupt at its ``at``-th call (1-based) inside a
    speculative verify (one call per round); returns the count (``n``)."""
    from pagedrs.core import fast_rows, spec_step

    calls = {"in_verify": False, "n": 0}
    real_verify, real = spec_step.verify, getattr(fast_rows, name)

    def verify(*args, **kw):
        calls["in_verify"] = True
        try:
            return real_verify(*args, **kw)
        finally:
            calls["in_verify"] = False

    def interrupted(*args, **kw):
        if calls["in_verify"]:
            calls["n"] += 1
            if calls["n"] == at:
                raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(spec_step, "verify", verify)
    monkeypatch.setattr(fast_rows, name, interrupted)
    return calls


def _interrupted_then_exact(engine: Engine, p: list[int], hf_model) -> None:
    """Request "a" (8 greedy tokens of ``p``) is interrupted once while stepping (the caller's patch
    raises), leaves a failed step behind, and then runs to transformers' tokens."""
    engine.add_request("a", p, greedy(8))
    with pytest.raises(KeyboardInterrupt):
        for _ in range(20):
            engine.step()
    assert engine.stats()["num_failed_steps"] >= 1
    done = run(engine)
    assert done["a"].error is None
    assert done["a"].outputs[0].token_ids == hf_greedy(hf_model, p, 8)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("nth", [1, 2])
def test_a_page_copy_that_fails_moves_nothing_the_core_then_reads(tiny_llama_dir, hf_model, monkeypatch, nth,
                                                                    async_scheduling):
    """A device fault inside a step's page copies (the ``nth`` device<->host copy raises): the executor
    reported every transfer of the step complete, copies that never ran included, so a sequence swapped
    out in that step (not in its forward, so not ended) resumed later from host pages nobody wrote and
    finished with wrong tokens and no error (a black-box probe's find). Now only the copies that ran are
    reported, the core fails the rest and recomputes their sequences: every request either ends with the
    fault's error or equals transformers."""
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=12, swap_space_gb=0.001, preemption_mode="swap",
                         enable_prefix_caching=False, async_scheduling=async_scheduling)
    backend = engine.core.executor.runner.backend  # (the asynchronous execution forwards to the local executor)
    real = backend.swap_blocks
    calls = {"n": 0}

    def swap_blocks(src, dst, pairs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise RuntimeError("injected: a device fault during a page copy")
        return real(src, dst, pairs)

    monkeypatch.setattr(backend, "swap_blocks", swap_blocks)
    prompts = {f"r{i}": prompt(6, seed=40 + i) for i in range(4)}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    done = run(engine)
    assert calls["n"] >= nth, "the workload must swap"
    failed = [rid for rid, out in done.items() if out.error is not None]
    assert failed and all("device fault during a page copy" in done[rid].error for rid in failed)
    for rid, ids in prompts.items():
        if rid not in failed:
            assert done[rid].outputs[0].token_ids == hf_greedy(hf_model, ids, 14), rid
    assert_free(engine)
