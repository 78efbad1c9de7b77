"""The step codec round-trips every StepInput field, and StepInput mirrors the core's StepPlan."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from pagedrs import _core
from pagedrs.distributed.step_codec import decode, encode
from pagedrs.step_input import CORE_FILLED, StepInput, Transfer


def _assert_equal(a: StepInput, b: StepInput) -> None:
    for name in StepInput.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name == "transfers":
            assert [(t.id, t.src, t.dst) for t in x] == [(t.id, t.src, t.dst) for t in y]
            for s, t in zip(x, y):
                np.testing.assert_array_equal(s.pairs, t.pairs)
                assert s.pairs.dtype == t.pairs.dtype
        elif name == "step_id":  # the one scalar field
            assert type(x) is int and x == y, (x, y)
        else:
            np.testing.assert_array_equal(x, y)
            assert x.dtype == y.dtype and x.shape == y.shape, name


class _Recording:
    """The engine's scheduler, recording each plan it hands out."""

    def __init__(self, core) -> None:
        self.core, self.plans = core, []

    def schedule(self):
        plan = self.core.schedule()
        self.plans.append(StepInput.from_plan(plan))
        return plan

    def __getattr__(self, name):
        return getattr(self.core, name)


def test_real_plans_with_swaps_round_trip(tiny_llama_dir):
    from pagedrs import Engine, EngineArgs, SamplingParams

    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=12, swap_space_gb=0.001,
                               preemption_mode="swap", max_model_len=64, watermark=0.0))
    engine.scheduler = recording = _Recording(engine.scheduler)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10], SamplingParams(max_tokens=14, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.scheduler = recording.core
    assert any(p.transfers for p in recording.plans), "the tiny pool should have forced a swap"
    for plan in recording.plans:
        _assert_equal(decode(encode(plan)), plan)


def test_hand_made_steps_with_transfers_round_trip():
    rng = np.random.default_rng(0)
    step = StepInput(
        input_ids=rng.integers(0, 1000, 7), positions=np.arange(7, dtype=np.int64),
        slot_mapping=rng.integers(0, 99, 7), query_start_loc=np.array([0, 5, 7], dtype=np.int32),
        seq_lens=np.array([9, 3], dtype=np.int32), block_tables=rng.integers(0, 50, (2, 3)).astype(np.int32),
        seq_ids=np.array([3, 2**63 + 5], dtype=np.uint64), do_sample=np.array([True, False]),
        transfers=(Transfer(7, "gpu", "cpu", rng.integers(0, 9, (3, 2))), Transfer(2**40, "cpu", "gpu", np.zeros((0, 2), np.int64))),
        copies=rng.integers(0, 9, (1, 2)), logit_rows=np.array([0, 2, 3], dtype=np.int64),
    )
    _assert_equal(decode(encode(step)), step)
    with pytest.raises(ValueError, match="not a step buffer"):
        decode(b"\0" * 64)


def test_step_input_names_exactly_the_fields_of_the_core_step_plan():
    """One definition per side of the boundary: a field added to one side fails here."""
    plan_fields = {name for name, value in inspect.getmembers(_core.StepPlan) if not name.startswith("_")}
    plan_fields.discard("num_seqs")  # a derived property on both sides
    assert plan_fields == set(StepInput.__dataclass_fields__) - CORE_FILLED
    assert CORE_FILLED <= set(StepInput.__dataclass_fields__)
