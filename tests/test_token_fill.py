"""Step N's drawn tokens into step N+1's placeholders (executor/token_fill.py, core/drawn_ids.py).

Under asynchronous scheduling the core publishes a steady batch's drawn ids while they are still
on the device, and the runner writes them into the next step's ids there (``DeviceFill``); rows
drawn the generic way arrive on the host. On the CPU the same code runs: these tests pin the split,
the writes, that the engine takes the device path where it can and the host path where it must,
with outputs equal to the synchronous engine's, and that a failure after the ids were published
is never papered over by drawing again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs import SamplingParams
from pagedrs._core import PLACEHOLDER_TOKEN
from pagedrs.core import drawn_ids
from pagedrs.executor import token_fill
from pagedrs.executor.token_fill import DrawnTokens, fill_placeholders
from pagedrs.step_input import StepInput
from test_async_scheduling import _both, _greedy, _outputs, _same
from test_engine import hf_greedy, make_engine, make_prompts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

P = PLACEHOLDER_TOKEN


def _step(ids: list[int]) -> StepInput:
    """Four sequences (11..14) over five input ids: 11 has two, the others one each."""
    return StepInput(
        input_ids=np.array(ids, dtype=np.int64), positions=np.arange(5, dtype=np.int64),
        slot_mapping=np.arange(5, dtype=np.int64), query_start_loc=np.array([0, 2, 3, 4, 5], dtype=np.int32),
        seq_lens=np.array([2, 4, 7, 1], dtype=np.int32), block_tables=np.zeros((4, 2), dtype=np.int32),
        seq_ids=np.array([11, 12, 13, 14], dtype=np.uint64))


def test_host_tokens_are_written_and_device_tokens_become_a_fill():
    step = _step([5, 6, P, P, P])
    tokens = DrawnTokens(host={12: 40}, device_ids=torch.tensor([7, 8], dtype=torch.int64), device_rows={14: 1})
    filled, fill = fill_placeholders(step, tokens)
    # 12 from the host; 13 drew nothing (it ended meanwhile: 0, its row is dropped); 14 waits for the device
    assert filled.input_ids.tolist() == [5, 6, 40, 0, 0]
    assert fill is not None and fill.where.tolist() == [4] and fill.rows.tolist() == [1]
    on_device = torch.from_numpy(filled.input_ids.copy())
    fill.apply(on_device)
    assert on_device.tolist() == [5, 6, 40, 0, 8]
    assert fill.materialize(filled).input_ids.tolist() == [5, 6, 40, 0, 8]
    assert step.input_ids.tolist() == [5, 6, P, P, P], "the plan itself is not written"


def test_a_step_without_placeholders_or_device_tokens_needs_no_fill():
    step = _step([5, 6, 7, 8, 9])
    assert fill_placeholders(step, DrawnTokens(device_ids=torch.tensor([1]), device_rows={11: 0})) == (step, None)
    filled, fill = fill_placeholders(_step([5, 6, P, 8, 9]), {12: 3})  # a plain dict: host tokens
    assert fill is None and filled.input_ids.tolist() == [5, 6, 3, 8, 9]


@pytest.mark.parametrize(("kw", "field"), [
    (dict(device_rows={1: 0}), "device_rows"),
    (dict(device_ids=torch.tensor([1.5]), device_rows={1: 0}), "device_ids must be int64"),
    (dict(device_ids=torch.zeros((2, 2), dtype=torch.int64)), "device_ids must be int64 \\[n\\]"),
])
def test_malformed_drawn_tokens_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        DrawnTokens(**kw)


def test_to_host_behind_on_the_cpu_returns_the_values():
    ids, logprobs = drawn_ids.to_host_behind(torch.tensor([3, 1]), torch.tensor([-0.5, -2.0])).wait()
    assert ids.tolist() == [3, 1] and logprobs.tolist() == [-0.5, -2.0]


def _count_fills(monkeypatch) -> dict[str, int]:
    """Counts, on the worker, steps filled on the device and steps filled on the host only."""
    counts = {"device": 0, "host": 0}
    real = token_fill.fill_placeholders

    def counting(step, tokens):
        filled, fill = real(step, tokens)
        if fill is not None:
            counts["device"] += 1
        elif (step.input_ids == P).any():
            counts["host"] += 1
        return filled, fill

    from pagedrs.executor import async_execution
    monkeypatch.setattr(async_execution, "fill_placeholders", counting)
    return counts


@pytest.mark.parametrize("pad", [False, True])
def test_a_plain_batch_runs_ahead_on_device_tokens_and_equals_transformers(tiny_llama_dir, monkeypatch, pad):
    """Greedy plain rows: every placeholder's token is published before the host has it, the runner
    writes it (eagerly, and into the padded path's static ids), and the output is transformers'."""
    import transformers

    counts = _count_fills(monkeypatch)
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 6, seed=11)
    kw = dict(pad_decode=True) if pad else {}
    sync, got, _ = _both(tiny_llama_dir, prompts, _greedy(12), **kw)
    _same(got, sync)
    assert counts["device"] >= 8 and counts["host"] == 0, counts
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"][0][0] == hf_greedy(hf, p, 12)


def test_rows_drawn_the_generic_way_wait_for_the_host(tiny_llama_dir, monkeypatch):
    """A seeded request is not a plain row: a step whose placeholders include it publishes on the
    host, after the generic draw; a batch of sampled plain rows publishes on the device (the draw's
    host copy goes through ``drawn_ids``). Outputs equal the synchronous engine's."""
    counts = _count_fills(monkeypatch)
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 4, seed=12)
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)] + [_greedy(10)] * 3
    sync, got, _ = _both(tiny_llama_dir, prompts, params)
    _same(got, sync)
    assert counts["host"] > 0, counts
    counts.update(device=0, host=0)
    copies = []
    real = drawn_ids.to_host_behind
    monkeypatch.setattr(drawn_ids, "to_host_behind", lambda *t: copies.append(len(t)) or real(*t))
    engine = make_engine(tiny_llama_dir, async_scheduling=True)
    torch.manual_seed(0)
    _outputs(engine, prompts, SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True))
    assert counts["device"] > 0 and copies, (counts, copies)


def _fail_third_call(monkeypatch, owner, name: str, exc: BaseException) -> dict[str, int]:
    """``owner.name`` raises ``exc`` on its third call, once; returns the call count."""
    calls = {"n": 0}
    real = getattr(owner, name)

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, failing)
    return calls


def test_a_failure_after_the_ids_were_published_recomputes_both_steps(tiny_llama_dir, monkeypatch):
    """Once the next step may run on the published ids, the core must not draw other tokens for the
    same rows (the generic path's retry would). The step was not reported done yet: it and the step
    launched on its ids are reported failed and computed again, and the output is a clean run's."""
    prompts = make_prompts(make_engine(tiny_llama_dir), 2, seed=13)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True)  # sampled rows, one choice
    clean = _outputs(make_engine(tiny_llama_dir, async_scheduling=True), prompts, params)
    engine = make_engine(tiny_llama_dir, async_scheduling=True)
    calls = _fail_third_call(monkeypatch, drawn_ids.HostCopy, "wait", RuntimeError("the device lost the copy"))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    with pytest.raises(RuntimeError, match="lost the copy"):
        for _ in range(20):
            engine.step()
    assert calls["n"] == 3 and engine.stats()["num_failed_steps"] >= 1
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason, None,
                                         c.cumulative_logprob) for c in out.outputs]
    _same(done, clean)
    stats = engine.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"], stats
    assert not engine.core.scheduler.open_steps()


def test_a_failure_after_the_step_committed_its_published_tokens_ends_the_engine(tiny_llama_dir, monkeypatch):
    """A failure after the step was reported done, with the next step already run on its published
    ids (here: while the rows' decisions are made): the core took those tokens only in part, so no
    request can go on exactly. Every request ends with the error, no page stays held, and the
    engine says it is dead instead of going on from a state it cannot vouch for."""
    from pagedrs.core import step as core_step
    from pagedrs.errors import EngineDeadError

    engine = make_engine(tiny_llama_dir, async_scheduling=True)
    prompts = make_prompts(engine, 2, seed=14)
    _fail_third_call(monkeypatch, core_step, "_decide", RuntimeError("a decision failed"))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _greedy(8))
    with pytest.raises(EngineDeadError, match="a decision failed"):
        for _ in range(20):
            engine.step()
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"], stats
    assert not engine.core.scheduler.open_steps()
