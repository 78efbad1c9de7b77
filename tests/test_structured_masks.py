"""A step's grammar masks: the additive bias equals the bitmask bit for bit, the masks are computed
on the mask thread while the forward runs and serve the sampler, and a failed forward with masks
in flight ends only its requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import pagedrs.core.step as step_module
from pagedrs import SamplingParams
from pagedrs.core.structured.mask import StepMasks, apply_grammar_masks, bias_of
from test_structured_outputs import CONSTRAINTS, make_engine, prompts_for, run


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 300, 49152, 49157])
def test_the_bias_is_zero_exactly_where_the_bitmask_allows(vocab):
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(5, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything
    bias = bias_of(bitmask)
    assert bias.dtype == torch.float32 and bias.shape == (5, 32 * words)
    expected = (bitmask[:, :, None].astype(np.int64) >> np.arange(32)) & 1  # bit t % 32 of word t // 32
    assert torch.equal(bias == 0, torch.from_numpy(expected.reshape(5, -1) == 1))
    assert bool(torch.isneginf(bias[bias != 0]).all())


def test_masked_logits_keep_the_allowed_values_exactly(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    state = engine.core.grammars.new_state(CONSTRAINTS["regex"])
    logits = torch.randn(3, engine.loaded.config.vocab_size)
    masked = apply_grammar_masks(logits, [None, state, None])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(masked[1])
    assert 0 < int(allowed.sum()) < logits.shape[1]
    assert torch.equal(masked[1][allowed], logits[1][allowed])  # x + 0.0 == x
    assert logits.isfinite().all()  # a copy: the step's logits stay as the model made them


def test_the_masks_are_computed_beside_the_forward_and_serve_the_sampler(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    threads, served = [], []
    compute, bias = StepMasks._compute, StepMasks.bias

    def recording_compute(self, states):
        threads.append(threading.current_thread().name)
        return compute(self, states)

    def recording_bias(self, rows, states):
        out = bias(self, rows, states)
        served.append(out is not None)
        return out

    monkeypatch.setattr(step_module, "MIN_OVERLAPPED_ROWS", 1)  # 4 rows: overlapped too
    monkeypatch.setattr(StepMasks, "_compute", recording_compute)
    monkeypatch.setattr(StepMasks, "bias", recording_bias)
    prompts = prompts_for(engine, 4, seed=3)
    done = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["json"]))
    assert threads and all(t.startswith("pagedrs-masks") for t in threads)
    assert served and all(served), "every constrained draw of a synchronous step used the planned masks"
    # the same tokens when every mask is computed at sampling time instead
    monkeypatch.setattr(step_module, "start_masks", lambda core, step: None)
    again = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["json"]))
    assert {k: v[0].token_ids for k, v in done.items()} == {k: v[0].token_ids for k, v in again.items()}


def test_a_stale_row_is_masked_at_sampling_time(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    state = engine.core.grammars.new_state(CONSTRAINTS["regex"])
    planned = StepMasks({0: state})
    first = planned.bias([0], [state])
    assert first is not None and first.shape[0] == 1
    token = int(torch.isfinite(first[0]).nonzero()[0])
    assert state.consume(token)
    assert planned.bias([0], [state]) is None  # the state moved: the planned mask is not its mask
    assert planned.bias([1], [state]) is None  # a row that was not planned


def test_a_failed_forward_with_masks_in_flight_ends_only_its_requests(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    execute = engine.core.executor.execute
    calls = {"n": 0}

    def failing_once(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return execute(step)

    monkeypatch.setattr(engine.core.executor, "execute", failing_once)
    monkeypatch.setattr(step_module, "MIN_OVERLAPPED_ROWS", 1)
    params = SamplingParams(temperature=0.0, max_tokens=20, n=2, structured_outputs=CONSTRAINTS["json"])
    for i, p in enumerate(prompts_for(engine, 3, seed=1)):
        engine.add_request(f"f{i}", p, params)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert all(o.outputs[0].finish_reason == "error" for o in finished.values()) and len(finished) == 3
    done = run(engine, prompts_for(engine, 2, seed=2), params)  # the engine goes on, masks and all
    assert all(len(v) == 2 and v[0].token_ids for v in done.values())


def test_a_few_rows_are_masked_when_sampled(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    started = []
    monkeypatch.setattr(StepMasks, "__init__", lambda self, states: started.append(states))
    run(engine, prompts_for(engine, 2), SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=CONSTRAINTS["regex"]))
    assert not started  # 2 rows < MIN_OVERLAPPED_ROWS: no mask thread
