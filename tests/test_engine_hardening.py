"""Hostile input against the engine: nothing leaks, nothing half-applies, one request's
failure ends that request only. Each test here failed before the hardening change.

The structural leak check in conftest.py (every engine idle with all pages free at
teardown) runs on top of the explicit checks.
"""

from __future__ import annotations

import logging
import os
import pickle
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.errors import FieldError
from pagedrs.kv_tiers.errors import CorruptPageError


def make_engine(model_dir, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=4, num_gpu_blocks=32, swap_space_gb=0.001, max_model_len=64)
    args.update(kw)
    return Engine(EngineArgs(**args))


def run_to_end(engine: Engine) -> dict:
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    return done


def assert_idle_and_free(engine: Engine) -> None:
    s = engine.stats()
    assert s["num_free_gpu_blocks"] == s["num_gpu_blocks"], s
    assert s["num_running"] == s["num_waiting"] == s["num_swapped"] == s["num_pinned_host_blocks"] == 0, s
    assert not engine.scheduler.has_unfinished()
    engine.check_invariants()


class _FailingDict(dict):
    """A registry whose next insert fails: an error after the core accepted the sequence."""

    def __setitem__(self, key, value):
        raise RuntimeError("injected failure after the core call")


def test_a_failure_after_the_core_call_rolls_the_core_back(tiny_llama_dir):
    """Defect 1: add_request touched the core first and nothing undid it on a later error."""
    engine = make_engine(tiny_llama_dir)
    registry = engine.core._by_seq
    engine.core._by_seq = _FailingDict()
    with pytest.raises(RuntimeError, match="injected"):
        engine.add_request("orphan", list(range(3, 40)), SamplingParams(max_tokens=8))
    engine.core._by_seq = registry
    assert engine.num_unfinished() == 0
    assert not engine.scheduler.has_unfinished(), "the core kept the orphan sequence"
    # The orphan would have been prefilled and kept its pages forever: step and look.
    engine.step()
    assert_idle_and_free(engine)
    engine.add_request("after", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    assert run_to_end(engine)["after"].outputs[0].finish_reason == "length"
    assert_idle_and_free(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 18446744073709551616}, "seed"),  # the exact input: one past 2**64 - 1
        ({"n": 100_000}, "n"),
        ({"top_k": 2**63, "temperature": 1.0}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"max_tokens": 2**64}, "max_tokens"),
    ],
)
def test_hostile_sampling_values_are_refused_before_anything_runs(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)


def test_the_largest_valid_values_run_and_leave_nothing(tiny_llama_dir):
    """At the edge of every range the engine runs: seed 2**64 - 1 with n > 1 wraps, top_k
    beyond the vocabulary keeps all tokens, a huge max_tokens stops at the context."""
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=64, max_model_len=24)
    params = SamplingParams(n=2, seed=2**64 - 1, top_k=2**31 - 1, max_tokens=2**31 - 1, temperature=1.0,
                            ignore_eos=True)
    engine.add_request("edge", [5, 6, 7, 8], params)
    out = run_to_end(engine)["edge"]
    assert out.error is None
    assert [len(o.token_ids) for o in out.outputs] == [20, 20]  # 4 prompt + 20 = max_model_len
    assert [o.finish_reason for o in out.outputs] == ["length", "length"]
    assert_idle_and_free(engine)


def test_n_is_bounded_by_engine_args(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_n=4)
    with pytest.raises(ValueError, match=r"SamplingParams.n=5 is out of range: allowed 1 <= n <= 4 \(EngineArgs.max_n\)"):
        engine.add_request("many", [5, 6], SamplingParams(n=5))
    assert_idle_and_free(engine)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([True, False], "token id True is not an int"),
        ([5, 1.5], "token id 1.5 is not an int"),
        (np.array([1.0, 2.0]), "must be 1-D of integers"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids is a string"),
        ([-1], "outside the vocabulary"),
        ([2**40], "outside the vocabulary"),
        ([], "the prompt is empty"),
        (b"bytes", "prompt must be a str"),
        (None, "prompt must be a str"),
        (np.array([2**64 - 1], dtype=np.uint64), "token id 18446744073709551615 is outside"),  # not "-1"
        ({"prompt": "x", "multi_modal_data": {"image": 1}}, r"key\(s\) \['multi_modal_data'\] this engine does not"),
        ({"prompt_token_ids": [5], "prompt": 7}, "must be the ids' text"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"prompt_token_ids": None}, "prompt must be a str, a list"),
    ],
)
def test_malformed_prompts_are_refused_with_nothing_changed(tiny_llama_dir, prompt, message):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(FieldError, match=message) as refused:
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2))
    assert refused.value.param == "prompt" and isinstance(refused.value, ValueError)
    # it crosses a process boundary whole (pickled by multiprocessing or Ray)
    again = pickle.loads(pickle.dumps(refused.value))
    assert (type(again), again.param, str(again)) == (FieldError, "prompt", str(refused.value))
    assert engine.num_unfinished() == 0
    assert_idle_and_free(engine)


def test_a_token_prompt_with_its_text_and_salt_keeps_both(tiny_llama_dir):
    """vLLM's TokensPrompt: ``prompt`` beside ``prompt_token_ids`` is the ids' text, shown as the output's
    prompt (it was dropped without a word), and ``cache_salt`` in the dict salts the request like the
    argument does (a different one given both ways is refused)."""
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9], "prompt": "five to nine", "cache_salt": "s1"},
                       SamplingParams(max_tokens=2))
    out = run_to_end(engine)["a"]
    assert out.prompt == "five to nine" and out.prompt_token_ids == [5, 6, 7, 8, 9]
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=2), cache_salt="s1")
    assert run_to_end(engine)["b"].num_cached_tokens == 4  # the same salt: the first page is shared
    engine.add_request("c", {"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=2))
    assert run_to_end(engine)["c"].num_cached_tokens == 0  # unsalted: nothing shared
    with pytest.raises(FieldError, match="differs from the cache_salt argument") as refused:
        engine.add_request("d", {"prompt_token_ids": [5], "cache_salt": "s1"}, SamplingParams(max_tokens=2),
                           cache_salt="s2")
    assert refused.value.param == "cache_salt"
    assert_idle_and_free(engine)


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, True, 1.5, "1"])
def test_priority_must_be_a_bounded_int(tiny_llama_dir, priority):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="priority is"):
        engine.add_request("p", [5, 6], SamplingParams(max_tokens=2), priority=priority)
    assert_idle_and_free(engine)


def test_a_huge_text_prompt_is_refused_without_tokenizing_it(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: pytest.fail("tokenized a hopeless prompt"))
    with pytest.raises(ValueError, match="cannot fit max_model_len = 64"):
        engine.add_request("big", "x" * (64 * 64 + 1), SamplingParams(max_tokens=2))
    assert_idle_and_free(engine)


def test_a_lone_surrogate_in_a_prompt_is_a_value_error(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"not valid Unicode text: surrogates not allowed \(character '\\ud800' at index 3\)"):
        engine.add_request("s", "abc\ud800def", SamplingParams(max_tokens=2))
    assert_idle_and_free(engine)


def test_a_sampling_failure_ends_only_the_request_that_caused_it(tiny_llama_dir, monkeypatch):
    """Defect 3: one bad row in the batched sampler ended every request in flight."""
    import pagedrs.core.step as engine_module

    real_sample = engine_module.sample

    def fragile_sample(logits, rows):
        if any(r.params.seed == 13 for r in rows):
            raise OverflowError("injected: this row's parameters overflow a tensor")
        return real_sample(logits, rows)

    monkeypatch.setattr(engine_module, "sample", fragile_sample)
    engine = make_engine(tiny_llama_dir)
    engine.add_request("good-1", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("bad", [8, 9], SamplingParams(max_tokens=4, temperature=1.0, seed=13))
    engine.add_request("good-2", [10, 11, 12, 13], SamplingParams(max_tokens=4, temperature=0, n=2))
    done = run_to_end(engine)
    assert done["bad"].error is not None and "injected" in done["bad"].error
    assert [o.finish_reason for o in done["bad"].outputs] == ["error"]
    for rid in ("good-1", "good-2"):
        assert done[rid].error is None
        assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in done[rid].outputs)
    assert_idle_and_free(engine)


def test_a_failed_forward_ends_the_requests_in_it_and_the_engine_goes_on(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    real_execute = engine.executor.execute
    calls = {"n": 0}

    def failing_once(step):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: device fault")
        return real_execute(step)

    monkeypatch.setattr(engine.executor, "execute", failing_once)
    engine.step()
    done = {o.request_id: o for o in engine.step() if o.finished}
    assert "device fault" in done["a"].error
    engine.add_request("b", [9, 10], SamplingParams(max_tokens=3, temperature=0))
    done.update(run_to_end(engine))
    assert done["b"].error is None and len(done["b"].outputs[0].token_ids) == 3
    assert_idle_and_free(engine)


def test_core_calls_are_all_or_nothing_from_python(tiny_llama_dir):
    """Defect 8: append_tokens with a bad id in the middle of the list changed the first ones."""
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=4))
    core = engine.scheduler
    (seq_a,), (seq_b,) = ([s.seq_id for s in engine.requests[r].samples] for r in ("a", "b"))
    with pytest.raises(KeyError):
        core.append_tokens(np.array([seq_a, 999, seq_b], dtype=np.uint64), np.array([1, 2, 3], dtype=np.uint32))
    with pytest.raises(ValueError, match="listed twice"):
        core.append_tokens(np.array([seq_a, seq_b, seq_a], dtype=np.uint64), np.array([1, 2, 3], dtype=np.uint32))
    assert (core.num_tokens(seq_a), core.num_tokens(seq_b)) == (3, 2)
    with pytest.raises(ValueError, match="not in flight"):
        core.complete_transfers([12345])
    engine.abort("a")
    engine.abort("b")
    engine.step()
    assert_idle_and_free(engine)


# ---- the engine-level fuzzer ------------------------------------------------------------

_PARAMS = st.builds(
    dict,
    max_tokens=st.integers(1, 12),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    n=st.integers(1, 3),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    top_k=st.sampled_from([0, 1, 5, 2**31 - 1]),
    ignore_eos=st.booleans(),
    stop=st.sampled_from([None, ["a"], ["zz", "q"]]),
)
_BAD_PARAMS = st.sampled_from([
    {"seed": 2**64}, {"n": 10_000}, {"top_k": 2**63}, {"temperature": float("nan")}, {"max_tokens": 0},
    {"priority": 2**63}, {"prompt": [True]}, {"prompt": []}, {"prompt": [10**9]}, {"n": 3, "max_tokens": 200},
])


class EngineFuzzer(RuleBasedStateMachine):
    """Random interleavings of valid and invalid requests, aborts and steps on tiny pools
    that force preemption. After every operation the core's and the engine's invariants
    hold; at the end every request has finished and every page is free."""

    @initialize(mode=st.sampled_from(["swap", "recompute", "auto"]), blocks=st.integers(12, 24),
                caching=st.booleans(), budget=st.sampled_from([3, 16, 64]))
    def build(self, mode, blocks, caching, budget):
        self._start(make_engine(
            self.model_dir, num_gpu_blocks=blocks, preemption_mode=mode, enable_prefix_caching=caching,
            max_num_batched_tokens=budget, max_model_len=40, swap_space_gb=0.0005,
        ))

    def _start(self, engine: Engine) -> None:
        self.engine = engine
        self.next_id = 0
        self.live: set[str] = set()
        self.errors = 0

    def _id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(params=_PARAMS, length=st.integers(1, 20), shared=st.booleans(), priority=st.integers(-3, 3))
    def add_valid(self, params, length, shared, priority):
        prompt = ([7, 8, 9, 10, 11, 12, 13, 14] if shared else []) + [20 + (i * 7) % 200 for i in range(length)]
        rid = self._id()
        try:
            self.engine.add_request(rid, prompt, SamplingParams(**params), priority=priority)
        except ValueError:  # n samples that can never fit this tiny pool: refused up front
            return
        self.live.add(rid)

    @rule(bad=_BAD_PARAMS)
    def add_invalid(self, bad):
        bad = dict(bad)
        prompt = bad.pop("prompt", [5, 6, 7])
        priority = bad.pop("priority", 0)
        before = self.engine.stats()
        with pytest.raises(ValueError):
            self.engine.add_request(self._id(), prompt, SamplingParams(**bad) if bad else SamplingParams(), priority)
        after = self.engine.stats()
        assert (after["num_waiting"], after["num_free_gpu_blocks"]) == (before["num_waiting"], before["num_free_gpu_blocks"])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort(rid)
        self.live.discard(rid)

    @rule()
    def step(self):
        for out in self.engine.step():
            if out.finished:
                self.live.discard(out.request_id)
                self.errors += out.error is not None and "injected" not in out.error

    @precondition(lambda self: self.live)
    @rule(lost_page=st.booleans())
    def failing_step(self, lost_page):
        """A step whose executor raises: a lost disk page (its sequences are recomputed, no
        request fails) or a forward that fails (the requests in it end, "injected")."""
        executor = self.engine.executor
        real = executor.execute

        def fail(step):
            executor.execute = real
            if lost_page:
                raise CorruptPageError("injected: a page failed its checksum", slots=[])
            raise RuntimeError("injected: the forward failed")

        executor.execute = fail
        try:
            self.step()
        finally:
            executor.execute = real

    @invariant()
    def consistent(self):
        if hasattr(self, "engine"):
            self.engine.check_invariants()
            assert self.engine.num_unfinished() == len(self.live)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        run_to_end(self.engine)
        assert self.errors == 0, "a valid request ended with an error"
        assert_idle_and_free(self.engine)


class PagePreemptionFuzzer(EngineFuzzer):
    """The same machine on pools of 10-14 blocks with swap preemption: sequences are paused
    with their pages split between device and host (page-granular preemption), or, when
    ``whole`` is drawn, swapped out whole (the baseline), and a tiny host tier makes some
    paused victims fall back to recompute."""

    @initialize(blocks=st.integers(10, 14), caching=st.booleans(), budget=st.sampled_from([3, 16, 64]),
                whole=st.booleans(), host_gb=st.sampled_from([0.00005, 0.0005]), preload=st.integers(3, 6))
    def build(self, blocks, caching, budget, whole, host_gb, preload):
        engine = make_engine(
            self.model_dir, num_gpu_blocks=blocks, preemption_mode="swap", enable_prefix_caching=caching,
            max_num_batched_tokens=budget, max_model_len=40, swap_space_gb=host_gb,
            admission_policy="prompt_only",  # optimistic admission: the pool must preempt
        )
        engine.scheduler.set_whole_sequence_swap(whole)
        self._start(engine)
        # Long greedy requests from the start: together they outgrow the pool, so every
        # example preempts (the random rules alone rarely build that much pressure).
        for i in range(preload):
            rid = self._id()
            engine.add_request(rid, [30 + i] * (4 + 2 * i), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            self.live.add(rid)


def run_machine(machine: type[EngineFuzzer], model_dir, examples: int) -> None:
    """``make fuzz`` runs it longer (PAGEDRS_FUZZ_EXAMPLES) and randomized (PAGEDRS_FUZZ_RANDOM=1)."""
    machine.model_dir = model_dir
    examples = int(os.environ.get("PAGEDRS_FUZZ_EXAMPLES", str(examples)))
    random = os.environ.get("PAGEDRS_FUZZ_RANDOM") == "1"  # else fixed examples: CI fails on the code alone
    run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=30, deadline=None,
                                                         derandomize=not random, database=None,
                                                         suppress_health_check=list(HealthCheck)))


def test_engine_fuzzer(tiny_llama_dir):
    run_machine(EngineFuzzer, tiny_llama_dir, 30)


def test_page_preemption_fuzzer(tiny_llama_dir):
    run_machine(PagePreemptionFuzzer, tiny_llama_dir, 15)


@pytest.mark.parametrize("field", ["swap_space_gb", "kv_host_cache_gb", "kv_disk_gb", "kv_cache_memory"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_memory_sizes_must_be_finite(field, value):
    """An infinite size used to reach int(size * 2**30) and raise OverflowError deep in start-up."""
    from pagedrs import EngineArgs

    with pytest.raises(ValueError, match=f"{field} is"):
        EngineArgs(**{field: value})


@pytest.mark.parametrize("field", ["swap_space_gb", "kv_host_cache_gb"])
def test_a_host_tier_larger_than_the_host_is_refused_naming_the_fields(field):
    """1e6 GiB of swap space reached the core as 262144000000 host blocks and was refused as
    "num_cpu_blocks must be in 0..=4294967293", a field the user never set."""
    from pagedrs import EngineArgs

    with pytest.raises(ValueError, match=r"swap_space_gb \(.*\) \+ kv_host_cache_gb \(.*\) is 1e\+06 GiB of host memory"):
        EngineArgs(**{field: 1e6})
    EngineArgs(swap_space_gb=0.5, kv_host_cache_gb=0.5)  # a size the host holds is fine


# 4e9 blocks of 1024 tokens (~16 TiB of bookkeeping) and one block of 2**40 tokens (4 TiB): past any host
# this runs on (the probe's 400_000_000 blocks of 16, ~39 GiB, would fit a large one and be allocated)
@pytest.mark.parametrize("call", ["BlockManager(4_000_000_000, 1024, 0, True)", "BlockManager(1, 2**40)"])
def test_block_tables_larger_than_the_host_raise_not_abort(call):
    """Sizes inside the per-field ranges whose bookkeeping is larger than the host's memory: the core's
    allocation failed and Rust aborted the interpreter (SIGABRT, rc 134). Now a ValueError naming the
    fields. In a child process, so that a regression fails this test rather than killing the run."""
    import subprocess
    import sys

    code = (f"from pagedrs import BlockManager\ntry:\n    {call}\nexcept ValueError as e:\n    print('refused:', e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: the block tables' bookkeeping would need at least" in done.stdout, done.stdout
    assert "block_size" in done.stdout and "num_gpu_blocks" in done.stdout


@pytest.mark.parametrize("value", [0, -3, 1.5, True, 1025, float("nan"), "2"])
def test_cpu_threads_is_a_whole_count_up_to_the_kernels_limit(value, monkeypatch):
    """1.5 was taken (and rounded), 10**6 reached the GGUF kernel and spawned threads at the first step:
    now each is refused at startup, naming the field, the value and what is allowed."""
    from pagedrs import EngineArgs
    from pagedrs.engine_args import CPU_THREADS_ENV

    with pytest.raises(ValueError, match=rf"cpu_threads is {re.escape(repr(value))}; allowed: an integer from 1 "
                                         "to 1024"):
        EngineArgs(cpu_threads=value)
    assert EngineArgs(cpu_threads=1024).resolved_cpu_threads() == 1024
    monkeypatch.setenv(CPU_THREADS_ENV, "5000")
    with pytest.raises(ValueError, match=r"\$PAGEDRS_CPU_THREADS is '5000'; allowed: an integer from 1 to 1024"):
        EngineArgs().resolved_cpu_threads()


def test_more_cpu_threads_than_cores_is_said_at_startup(tiny_llama_dir, caplog):
    """cpu_threads past the cores this process may use is allowed but slows every step (32 threads on
    2 cores decoded at 0.54x of one thread): the engine says so once at startup, naming the field, the
    value and the cores; at or under the cores it says nothing."""
    from pagedrs import Engine, EngineArgs
    from pagedrs.engine_args import usable_cores
    from pagedrs.executor.local import oversubscription_warning

    assert oversubscription_warning(2, cores=2) is None
    said = oversubscription_warning(3, cores=2)
    assert said is not None and "cpu_threads is 3, more than the 2 core(s)" in said and "at most 2" in said
    cores = usable_cores()
    for threads, warned in [(cores, False), (cores + 1, True)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedrs.engine"):
            engine = Engine(EngineArgs(model=str(tiny_llama_dir), cpu_threads=threads, num_gpu_blocks=16))
        engine.shutdown()
        messages = [r.getMessage() for r in caplog.records if "more than the" in r.getMessage()]
        assert messages == ([oversubscription_warning(threads)] if warned else []), messages


@pytest.mark.parametrize("field, value", [
    ("block_size", 16.5), ("block_size", True), ("max_num_seqs", 3.7), ("max_num_batched_tokens", 2.5),
    ("tensor_parallel_size", 1.0), ("num_gpu_blocks", 10.5), ("max_model_len", 512.0), ("kv_cache_memory", 1e9),
    ("max_n", 0), ("aging_steps", 0.5), ("num_gpu_blocks", 0),
])
def test_a_count_that_is_not_a_whole_number_is_refused_by_name(field, value):
    """num_gpu_blocks=10.5 built an engine of 10 pages (the core truncated it); 16.5 reached the core as a
    TypeError; each is now refused by EngineArgs, naming the field and the value."""
    with pytest.raises(ValueError, match=rf"{field} is {value!r}; it must be an integer >= \d"):
        EngineArgs(model="x", **{field: value})


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, True, "7"])
def test_a_seed_outside_torchs_range_is_refused_by_name(seed):
    """2**70 failed deep in torch with 'Overflow when unpacking long long'."""
    with pytest.raises(ValueError, match=r"seed is .*; it must be an integer from -2\*\*63 to 2\*\*64 - 1"):
        EngineArgs(model="x", seed=seed)
    EngineArgs(model="x", seed=2**64 - 1)
    EngineArgs(model="x", seed=-(2**63))


def test_a_max_model_len_past_the_models_positions_is_refused_by_name(tiny_llama_dir, monkeypatch):
    """vLLM's rule: the model never trained on positions past its context length, so outputs there may
    be wrong with nothing to show it; such a length is refused, naming the field, the value and the
    allowed range, and the executor built so far is released."""
    monkeypatch.delenv("PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    base = dict(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"max_model_len is 257; the model's context length is 256 "
                                         r"\(config max_position_embeddings=256\), so allowed: 1 to 256\..*"
                                         r"allow_long_max_model_len=True"):
        Engine(EngineArgs(**base, max_model_len=257))
    assert Engine(EngineArgs(**base, max_model_len=256)).core.max_model_len == 256
    assert Engine(EngineArgs(**base)).core.max_model_len == 256  # unset: the context length


@pytest.mark.parametrize("how", ["field", "env"])
def test_a_long_max_model_len_runs_when_asked_and_is_said_once(tiny_llama_dir, caplog, monkeypatch, how):
    """Asked for (the field, or PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN=1 as vLLM's env), the length is used and
    the log says once that those positions were not trained; a length within them says nothing."""
    monkeypatch.delenv("PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    base = dict(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=256, skip_tokenizer_init=True)
    extra = {"allow_long_max_model_len": True} if how == "field" else {}
    if how == "env":
        monkeypatch.setenv("PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        Engine(EngineArgs(**base, **extra, max_model_len=256))
        assert "max_position_embeddings" not in caplog.text
        engine = Engine(EngineArgs(**base, **extra, max_model_len=512))
    assert engine.core.max_model_len == 512
    assert caplog.text.count("max_model_len=512 is past the model's context length 256") == 1
    # a prompt past the trained positions runs (transformers computes them the same way)
    engine.add_request("long", {"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_allow_long_max_model_len_is_a_bool(value):
    with pytest.raises(ValueError, match=r"allow_long_max_model_len is .*; it must be True or False"):
        EngineArgs(model="x", allow_long_max_model_len=value)


@pytest.mark.parametrize("field", ["model", "kv_disk_path", "speculative_config.model"])
def test_a_path_with_a_nul_byte_is_refused_naming_the_field(field):
    """os calls refuse a NUL with a bare "ValueError: embedded null byte" that named neither field nor path."""
    path = "/tmp/\x00bad"
    kw = ({"speculative_config": {"method": "draft_model", "model": path, "num_speculative_tokens": 2}}
          if field == "speculative_config.model" else {field: path})
    with pytest.raises(ValueError, match=re.escape(f"{field} is {path!r}; a path cannot hold a NUL byte")):
        EngineArgs(**kw)


def test_a_linear_rope_scaling_multiplies_the_context_length():
    """vLLM's rule for "linear" scaling: the config gives the unscaled length; Llama 3 scaling gives the
    scaled one already."""
    from pagedrs.models.config import ModelConfig

    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, head_dim=8, max_position_embeddings=100)
    assert ModelConfig(**base).context_length == 100
    assert ModelConfig(**base, rope_scaling={"type": "linear", "factor": 4.0}).context_length == 400
    with pytest.raises(ValueError, match=r"rope_scaling\['factor'\]=nan must be a positive finite number"):
        ModelConfig(**base, rope_scaling={"rope_type": "linear", "factor": float("nan")})  # refused, never guessed
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    assert ModelConfig(**base, rope_scaling=llama3).context_length == 100


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=5, temperature=0.0),  # the fast rows (core/fast_rows.py)
    SamplingParams(max_tokens=5, temperature=0.0, logprobs=2),  # the general path (record_token)
    SamplingParams(max_tokens=5, temperature=1.0, seed=3),
    SamplingParams(max_tokens=5, temperature=0.0, n=2),
], ids=["fast", "logprobs", "seeded", "n2"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_logits_end_the_request_with_an_error_not_token_0(tiny_llama_dir, tmp_path, params, async_scheduling):
    """A checkpoint holding a NaN weight made every logit NaN: greedy picked token 0 five times and the
    request finished with "length", a wrong answer with nothing to show it. Now the request ends with
    finish_reason "error" naming the NaN logits, its pages are freed, and the engine serves on."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_llama_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    name = next(k for k in weights if "layers.0.mlp.down_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, str(broken / "model.safetensors"))
    engine = Engine(EngineArgs(model=str(broken), block_size=4, num_gpu_blocks=64, skip_tokenizer_init=True,
                               async_scheduling=async_scheduling))
    engine.add_request("nan", [5, 6, 7], params)
    outputs = run_to_end(engine)
    out = outputs["nan"]
    assert out.finished and out.error is not None and "NonFiniteLogitsError" in out.error, out
    assert out.error_by_request is False  # the model's fault: a 500
    assert "logits were NaN at output token 0" in out.error
    assert all(c.finish_reason == "error" and not c.token_ids for c in out.outputs)
    assert engine.stats()["num_free_gpu_blocks"] == 64  # nothing held
    engine.check_invariants()
