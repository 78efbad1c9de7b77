"""benches/gpu_check.sh before a GPU run: its dry run takes every step's code path on the CPU and
leaves each step's result in the output folder; gpu_e2e.py keeps the sections that ran when another fails."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_e2e():
    spec = importlib.util.spec_from_file_location("gpu_e2e", ROOT / "benches" / "gpu_e2e.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_runs_every_step_and_writes_each_result(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run = subprocess.run(["bash", str(ROOT / "benches" / "gpu_check.sh"), "--dry-run", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    steps = {line.split()[0]: line for line in summary}
    for name in ("environment", "kernels", "e2e_decode", "e2e_throughput", "overhead", "engine_tests"):
        assert f"{name} rc=0" in steps[name], summary
    assert "DRY RUN" in (out / "environment.txt").read_text()
    decode = json.loads((out / "e2e" / "decode.json").read_text())
    assert set(decode["modes"]) == {"eager", "padded", "graphs", "graphs+async"}
    for mode, row in decode["modes"].items():
        assert [b["batch"] for b in row["batches"]] == [1, 4]
        assert all(b["tokens_per_s"] > 0 and b["decode_steps_timed"] >= 1 for b in row["batches"])
        assert row["padded"] == (mode == "padded") and row["graph_sizes"] == []  # nothing is captured on the CPU
    assert set(decode["speedup_graphs_vs_eager"]) == {"1", "4"}
    throughput = json.loads((out / "e2e" / "throughput.json").read_text())
    assert throughput["paged"]["tokens_per_s"] > 0 and throughput["contiguous"]["tokens_per_s"] > 0
    assert throughput["paged_contiguous_identical_outputs"] == "4/4"
    assert "paged_vs_contiguous" in throughput["speedup"]
    assert (out / "overhead.json").stat().st_size > 0


def test_a_failing_section_keeps_the_others_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e2e = _load_e2e()

    def broken(args, folder, write):
        write("throughput", {"partial": True})
        raise RuntimeError("out of time")

    monkeypatch.setitem(e2e.SECTIONS, "throughput", broken)
    assert e2e.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "decode.json").read_text())["modes"]["graphs"]["batches"]
    assert json.loads((tmp_path / "throughput.json").read_text()) == {"partial": True}
    assert "out of time" in (tmp_path / "throughput.error.txt").read_text()
