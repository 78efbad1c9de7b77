"""Asynchronous scheduling (core/async_step.py) on the CPU: steps complete on a worker thread
(executor/async_execution.py), two in flight, and every output equals the synchronous engine's
(and, greedy, transformers') in the modes the engine tests cover: prefix caching, preemption by
swap and recompute, chunked prefill, n > 1 and best_of, beam search, stop strings and stop
tokens, seeded sampling with logprobs, structured outputs, aborts, and a failed step."""

from __future__ import annotations

import numpy as np
import pytest

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.beam_search import BeamSearchParams
from pagedrs.executor.async_execution import AsyncExecution, fill_placeholders
from pagedrs.step_input import StepInput
from test_engine import hf_greedy, make_engine, make_prompts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def _outputs(engine: Engine, prompts, params, abort_after: dict[str, int] | None = None, check: bool = True) -> dict:
    """Every request's final outputs: ids, text, finish, log-probabilities (see ``_same``)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if abort_after and out.request_id in abort_after and not out.finished \
                    and len(out.outputs[0].token_ids) >= abort_after[out.request_id]:
                engine.abort(out.request_id)
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                         None if c.logprobs is None else [sorted(d.items()) for d in c.logprobs],
                                         c.cumulative_logprob) for c in out.outputs]
        if check:  # an engine whose core is in-process
            engine.check_invariants()
    return done


def _same(got: dict, want: dict) -> None:
    """Equal outputs: ids, text and finish exactly, log-probabilities to 1e-4 (a step's batch may
    differ from the synchronous engine's under preemption, which moves the last bits of a float,
    as any other change of batch does)."""
    assert got.keys() == want.keys()
    for rid in want:
        assert len(got[rid]) == len(want[rid]), rid
        for g, w in zip(got[rid], want[rid]):
            assert g[:4] == w[:4], rid
            assert (g[4] is None) == (w[4] is None), rid
            if w[4] is not None:
                assert [[t for t, _ in d] for d in g[4]] == [[t for t, _ in d] for d in w[4]], rid
                assert [v for d in g[4] for _, v in d] == pytest.approx([v for d in w[4] for _, v in d], abs=1e-4), rid
            assert g[5] == pytest.approx(w[5], abs=1e-4), rid


def _both(model_dir, prompts, params, **kw) -> tuple[dict, dict, Engine]:
    sync = _outputs(make_engine(model_dir, **kw), prompts, params)
    engine = make_engine(model_dir, async_scheduling=True, **kw)
    assert isinstance(engine.core.executor, AsyncExecution)
    return sync, _outputs(engine, prompts, params), engine


def _fail_on_call(engine: Engine, monkeypatch, which: int, exc: BaseException):
    """The executor's forward (on the worker) raises ``exc`` on its ``which``-th call, once;
    returns the real one."""
    inner = engine.core.executor.inner
    real = inner.execute
    calls = {"n": 0}

    def execute(step, **kw):
        calls["n"] += 1
        if calls["n"] == which:
            raise exc
        return real(step, **kw)

    monkeypatch.setattr(inner, "execute", execute)
    return real


def step_through_interrupts(engine: Engine) -> tuple[dict, int]:
    """Steps until nothing is left; a KeyboardInterrupt out of a step is counted, and must leave no
    step open. Returns the finished outputs by request id and the count of interrupts."""
    done: dict = {}
    interrupted = 0
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            interrupted += 1
            assert not engine.core.scheduler.open_steps(), "an interrupted step left a step open"
            continue
        done.update({out.request_id: out for out in outs if out.finished})
        engine.check_invariants()
    return done, interrupted


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("mode", ["prefix", "swap", "recompute", "chunked"])
def test_greedy_output_equals_the_synchronous_engine_and_transformers(tiny_llama_dir, hf_model, mode, monkeypatch):
    kw = {"prefix": dict(enable_prefix_caching=True),
          "swap": dict(num_gpu_blocks=12, preemption_mode="swap", swap_space_gb=0.01, enable_prefix_caching=False,
                       watermark=0.0),
          "recompute": dict(num_gpu_blocks=12, preemption_mode="recompute", enable_prefix_caching=False, watermark=0.0),
          "chunked": dict(max_num_batched_tokens=8)}[mode]
    from pagedrs._core import PLACEHOLDER_TOKEN
    from pagedrs.executor import async_execution

    filled = []
    real_fill = async_execution.fill_placeholders
    monkeypatch.setattr(async_execution, "fill_placeholders",
                        lambda step, tokens: filled.append(int((step.input_ids == PLACEHOLDER_TOKEN).sum()))
                        or real_fill(step, tokens))
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 8, shared=13 if mode == "prefix" else 0, seed=1)
    sync, got, engine = _both(tiny_llama_dir, prompts, _greedy(16), **kw)
    assert sum(filled) > 8 * 10, f"few steps ran ahead on placeholders: {filled}"
    _same(got, sync)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"][0][0] == hf_greedy(hf_model, p, 16), f"r{i} ({mode})"
    stats = engine.stats()
    if mode in ("swap", "recompute"):
        assert stats["num_preemptions"] > 0
    if mode == "prefix":
        assert stats["prefix_hits"] > 0


def test_sampling_kinds_equal_the_synchronous_engine(tiny_llama_dir):
    """n > 1, best_of, stop strings and stop tokens, EOS, seeded sampling with logprobs, and
    beam search (synchronous inside: it sits out a step) all give the sync engine's outputs."""
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 8, seed=2)
    eos = min(probe.loaded.tokenizer.eos_token_ids)
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=3),
        SamplingParams(max_tokens=10, temperature=1.0, seed=2, n=2, best_of=3),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, stop=["e", " "]),
        SamplingParams(max_tokens=20, temperature=1.0, seed=4, stop_token_ids=[5, 9, 11, 20, 30, eos]),
        SamplingParams(max_tokens=30, temperature=0.0),  # may end at EOS
        SamplingParams(max_tokens=9, temperature=0.7, seed=5, logprobs=2),
        BeamSearchParams(beam_width=3, max_tokens=6),
        SamplingParams(max_tokens=11, temperature=0.0, min_tokens=5, ignore_eos=False),
    ]
    sync, got, _ = _both(tiny_llama_dir, prompts, params)
    _same(got, sync)


def test_structured_outputs_run_ahead_and_equal_the_synchronous_engine(tiny_llama_dir):
    from pagedrs.sampling_params import StructuredOutputsParams

    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 3, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]{3,9}"))
    sync, got, _ = _both(tiny_llama_dir, prompts, params)
    _same(got, sync)
    assert all(o[0][2] == "stop" for o in got.values())


def test_aborts_and_a_request_ending_mid_flight_free_every_page(tiny_llama_dir):
    """An abort while a step is in flight: the extra row is dropped, the pages come back (the
    leak fixture checks the idle engine), the other requests are unchanged."""
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 5, seed=4)
    sync = _outputs(make_engine(tiny_llama_dir), prompts, _greedy(14), abort_after={"r1": 3, "r3": 1})
    engine = make_engine(tiny_llama_dir, async_scheduling=True)
    got = _outputs(engine, prompts, _greedy(14), abort_after={"r1": 3, "r3": 1})
    _same({k: got[k] for k in ("r0", "r2", "r4")}, {k: sync[k] for k in ("r0", "r2", "r4")})
    for rid in ("r1", "r3"):
        assert got[rid][0][2] == "abort"
    assert not engine.core.scheduler.open_steps(), "an idle engine holds a step open"


def test_a_failed_step_ends_its_requests_and_caches_nothing_it_wrote(tiny_llama_dir, hf_model, monkeypatch):
    engine = make_engine(tiny_llama_dir, async_scheduling=True)
    real = _fail_on_call(engine, monkeypatch, 3, RuntimeError("injected: the forward failed"))
    prompts = make_prompts(engine, 3, seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _greedy(8))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert all("injected" in (o.error or "") for o in done.values()), {k: o.error for k, o in done.items()}
    monkeypatch.setattr(engine.core.executor.inner, "execute", real)
    # the engine goes on, and what the failed step wrote is no prefix hit (the same prompts again)
    again = _outputs(engine, prompts, _greedy(8))
    for i, p in enumerate(prompts):
        assert again[f"r{i}"][0][0] == hf_greedy(hf_model, p, 8)
    assert not engine.core.scheduler.open_steps()


def test_fill_placeholders_takes_each_rows_token():
    from pagedrs._core import PLACEHOLDER_TOKEN

    step = StepInput(
        input_ids=np.array([5, 6, PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN, 9], dtype=np.int64),
        positions=np.arange(5, dtype=np.int64), slot_mapping=np.arange(5, dtype=np.int64),
        query_start_loc=np.array([0, 2, 3, 4, 5], dtype=np.int32), seq_lens=np.array([2, 4, 7, 1], dtype=np.int32),
        block_tables=np.zeros((4, 2), dtype=np.int32), seq_ids=np.array([11, 12, 13, 14], dtype=np.uint64))
    filled, on_device = fill_placeholders(step, {12: 40, 99: 1})
    assert on_device is None  # host tokens only (tests/test_token_fill.py has the device's)
    assert filled.input_ids.tolist() == [5, 6, 40, 0, 9]  # 13 drew nothing: ended meanwhile, its row dropped
    assert step.input_ids[2] == PLACEHOLDER_TOKEN, "the plan itself is not written"


@pytest.mark.parametrize(("kw", "field"), [
    (dict(async_scheduling="yes"), "async_scheduling is 'yes'"),
    (dict(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config with async_scheduling=True"),
])
def test_bad_settings_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(model="smollm2-135m", **kw)


def test_an_interrupt_mid_step_gives_both_steps_back_and_the_requests_finish_unchanged(tiny_llama_dir, monkeypatch):
    """Ctrl-C while a step runs (here: raised inside the worker's forward): step() raises it, the
    step and the one launched after it are reported failed, and stepping on recomputes them to
    the synchronous engine's tokens, every page freed."""
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 4, seed=6)
    want = _outputs(make_engine(tiny_llama_dir), prompts, _greedy(10))
    engine = make_engine(tiny_llama_dir, async_scheduling=True)
    _fail_on_call(engine, monkeypatch, 4, KeyboardInterrupt())
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _greedy(10))
    finished, interrupted = step_through_interrupts(engine)
    done = {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, None, c.cumulative_logprob)
                  for c in out.outputs] for rid, out in finished.items()}
    assert interrupted == 1
    assert {k: v[0][:4] for k, v in done.items()} == {k: v[0][:4] for k, v in want.items()}


def test_staggered_arrivals_and_the_context_limit_equal_the_synchronous_engine(tiny_llama_dir, hf_model):
    """Requests that arrive while a step is in flight join the next plan; rows that reach
    max_model_len end there (no placeholder past it); greedy equals transformers."""
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 6, seed=7)

    def run(engine: Engine) -> dict:
        done: dict = {}
        pending = list(enumerate(prompts))
        steps = 0
        while pending or engine.has_unfinished():
            if pending and steps % 3 == 0:  # one new request every third step
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, _greedy(400))  # beyond max_model_len: ends there
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            steps += 1
            engine.check_invariants()
        return done

    kw = dict(max_model_len=40, num_gpu_blocks=24, preemption_mode="recompute", watermark=0.0)
    want = run(make_engine(tiny_llama_dir, **kw))
    got = run(make_engine(tiny_llama_dir, async_scheduling=True, **kw))
    assert got == want
    for i, p in enumerate(prompts):
        assert len(got[f"r{i}"][0]) == 40 - len(p) and got[f"r{i}"][1] == "length"
        assert got[f"r{i}"][0] == hf_greedy(hf_model, p, 40 - len(p))


def test_the_core_in_its_own_process_runs_asynchronously_too(tiny_llama_dir):
    from pagedrs.server.engine_core import RemoteEngine

    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 3, seed=8)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=["e"])
    want = _outputs(make_engine(tiny_llama_dir), prompts, params)
    kw = dict(block_size=4, num_gpu_blocks=64, swap_space_gb=0.001, max_model_len=256)
    remote = RemoteEngine(EngineArgs(model=str(tiny_llama_dir), async_scheduling=True, **kw))
    try:
        got = _outputs(remote, prompts, params, check=False)
    finally:
        remote.shutdown(timeout_s=5.0)
    _same(got, want)
