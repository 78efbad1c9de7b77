"""``pagedrs bench overhead``, run tiny: the report's structure and its arithmetic, never its speed."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import pagedrs.bench as bench
from pagedrs.bench.config import BenchConfig
from pagedrs.bench.overhead import DETAIL, PARTS, OverheadSpec, markdown, measure, spec_from_config, split_step
from pagedrs.bench.report import write_json

TINY = OverheadSpec(batch_sizes=(1, 3), layers=3, prompt_len=5, warmup_steps=1, steps=3, rounds=2)


@pytest.fixture(scope="module")
def report() -> dict:
    return measure(TINY)


def test_every_step_splits_into_ordered_parts_that_add_up_to_it(report: dict) -> None:
    assert report["depths"] == [1, 3]
    for kind, depth, batch in itertools.product(("CUMULATIVE", "DELTA", "FINAL_ONLY"), ("1", "3"), ("1", "3")):
        steps = report["steps"][kind][depth][batch]
        assert len(steps) == TINY.steps
        for s in steps:
            for clock in ("", "cpu_"):  # wall time, this thread's CPU time
                assert all(s[clock + p] >= 0 for p in (*PARTS, *DETAIL)), s  # every boundary fired, in order
                assert sum(s[clock + p] for p in PARTS) == pytest.approx(s[clock + "step"], rel=1e-6, abs=1e-9)
                assert s[clock + "forward"] + s[clock + "head"] <= s[clock + "runner"] * (1 + 1e-9)


def test_fixed_and_per_layer_parts_are_the_line_through_both_depths(report: dict) -> None:
    assert [(r["output_kind"], r["batch"]) for r in report["rows"]] == [
        ("CUMULATIVE", 1), ("CUMULATIVE", 3), ("DELTA", 1), ("DELTA", 3), ("FINAL_ONLY", 1), ("FINAL_ONLY", 3)]
    for row in report["rows"]:
        names = {*PARTS, *DETAIL, "step", "core"}
        assert set(row["measured"]) == names | {f"cpu_{k}" for k in names}
        for key in row["measured"]:
            shallow, deep = row["shallow"][key], row["measured"][key]
            assert row["fixed"][key] + 1 * row["per_layer"][key] == pytest.approx(shallow, abs=1e-12)
            assert row["fixed"][key] + 3 * row["per_layer"][key] == pytest.approx(deep, abs=1e-12)
        # each round's own line: its fixed part from that round's medians at both depths
        spread = row["fixed_rounds"]["cpu_step"]
        assert len(spread) == TINY.rounds and len(row["fixed_rounds"]["step"]) == TINY.rounds
        steps = report["steps"][row["output_kind"]]
        shallow0 = sorted(s["cpu_step"] for s in steps["1"][str(row["batch"])][:2])  # round 0: the first steps
        deep0 = sorted(s["cpu_step"] for s in steps["3"][str(row["batch"])][:2])
        assert spread[0] == pytest.approx(sum(shallow0) / 2 - (sum(deep0) / 2 - sum(shallow0) / 2) / 2, abs=1e-12)


def test_report_prints_its_machine_and_serializes(report: dict, tmp_path: Path) -> None:
    text = markdown(report, "the machine")
    assert "Machine: the machine" in text and "| 3 | FINAL_ONLY |" in text and "| 1 | CUMULATIVE |" in text
    assert "| 3 | DELTA |" in text and "fixed, by round ms" in text
    write_json(str(tmp_path / "o.json"), report)
    assert json.loads((tmp_path / "o.json").read_text())["spec"]["layers"] == 3


def test_split_step_names_each_interval() -> None:
    # the step is reported done (complete) after its draw (sampling): that is part of "output"
    at = {"schedule": 1.0, "schedule_end": 2.0, "execute": 2.5, "forward": 3.0, "forward_end": 5.0, "head": 5.5,
          "head_end": 6.0, "execute_end": 7.0, "sampling": 7.5, "sampling_end": 8.5, "complete": 8.6,
          "complete_end": 8.8, "core": 0.7, "core_end": 9.5}
    parts = split_step(at, start=0.5, end=10.0)
    assert parts == {"schedule": 1.0, "inputs": 1.0, "runner": 4.0, "sampling": 1.5, "output": 1.5,
                     "frontend": 0.5, "forward": 2.0, "head": 0.5, "step": 9.5, "core": 9.0}


def test_cli_registers_the_bench_with_its_layers() -> None:
    assert "overhead" in bench.EXTRA_BENCHES
    assert bench.main(["overhead", "--layers", "0"]) == 2
    cfg = BenchConfig(model="-", quick=True, num_requests=None, out_dir=None, plot_dir=None, json_path=None, layers=7)
    spec = spec_from_config(cfg)
    assert spec.layers == 7 and spec.batch_sizes == (1, 32, 256)


def test_a_final_only_workload_steps_without_outputs(tmp_path: Path) -> None:
    """FINAL_ONLY's timed steps hand out no RequestOutput (the check inside raises otherwise), and
    its requests still run to their end."""
    from pagedrs.bench.overhead import build_overhead_engine, time_decode_steps, write_model

    engine = build_overhead_engine(write_model(tmp_path / "m", 1), TINY)
    try:
        rows = time_decode_steps(engine, TINY, 2, seed=1, output_kind="FINAL_ONLY")
        assert len(rows) == TINY.steps and not engine.has_unfinished()
    finally:
        engine.shutdown()
