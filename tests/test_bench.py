"""Smoke and unit tests for ``pagedrs bench``: no timing is ever asserted.

The smoke test runs every benchmark with ``--quick`` and a tiny N on the tiny random
llama from conftest, and checks the files and the JSON keys the README and CI rely on.
The unit tests pin the parts whose numbers must be right: the seeded workload, the
utilization arithmetic, and the pure-Python block manager the allocator bench races
against the Rust one (it must agree with it on every prefix-cache hit).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pagedrs.bench as bench
from pagedrs.bench.allocator import PoolBlockManager, SimpleBlockManager, load_vllm_style_pool, make_trace
from pagedrs.bench.metrics import Timeline, time_weighted_utilization
from pagedrs.bench.workloads import LengthDistribution, WorkloadSpec, synthetic_workload

REQUIRED_KEYS = {"tokens_per_s", "requests_per_s", "peak_concurrency", "kv_utilization"}


def test_all_quick_writes_tables_json_and_plots(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, plots, json_path = tmp_path / "out", tmp_path / "plots", tmp_path / "all.json"
    argv = ["all", "--quick", "--num-requests", "3", "--model", str(tiny_llama_dir),
            "--out", str(out), "--plot", str(plots), "--json", str(json_path)]
    assert bench.main(argv) == 0

    for name in bench.BENCHES:
        assert (out / f"{name}.json").is_file() and (out / f"{name}.md").is_file()
        assert "Machine:" in (out / f"{name}.md").read_text()
    for png in ("throughput.png", "kv_memory_over_time.png", "kv_utilization_hist.png",
                "prefix_sharing.png", "preemption.png", "allocator.png"):
        assert (plots / png).stat().st_size > 0

    throughput = json.loads((out / "throughput.json").read_text())
    assert {"paged", "contiguous", "hf"} <= set(throughput)
    for system in ("paged", "contiguous", "hf"):
        assert REQUIRED_KEYS <= set(throughput[system])
        assert 0.0 < throughput[system]["kv_utilization"] <= 1.0
        assert throughput[system]["num_output_tokens"] == throughput["workload"]["num_output_tokens"]
    combined = json.loads(json_path.read_text())
    assert set(combined) == set(bench.BENCHES)
    assert combined["throughput"]["paged"]["num_requests"] == 3
    assert combined["prefix"]["caching_on"]["cached_prompt_tokens"] > 0
    assert combined["preemption"]["num_requests"] == 3


def test_workload_is_seeded_and_fits_max_model_len() -> None:
    spec = WorkloadSpec("t", 200, LengthDistribution(40, 0.9, 4, 300), LengthDistribution(80, 0.8, 4, 300), 256, seed=7)
    a = synthetic_workload(spec, vocab_size=1000)
    b = synthetic_workload(spec, vocab_size=1000)
    assert a.requests == b.requests
    assert all(r.total_len <= 256 and r.max_tokens >= 1 for r in a.requests)
    assert all(125 <= t < 1000 for r in a.requests for t in r.prompt_token_ids)
    lengths = np.array([r.max_tokens for r in a.requests])
    assert np.percentile(lengths, 95) > 2 * np.median(lengths)  # the long tail is there


def test_length_distribution_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="sigma=-1"):
        LengthDistribution(10, -1, 1, 5).sample(np.random.default_rng(0), 3)


def test_time_weighted_utilization_weights_by_step_duration() -> None:
    # step 1 lasts 1 s at 50%, step 2 lasts 3 s at 100% of 10 slots -> (5 + 30) / (10 + 30)
    tl = Timeline(t=[1.0, 4.0], running=[1, 1], reserved_slots=[10, 10], live_slots=[5, 10])
    assert time_weighted_utilization(tl) == pytest.approx(35 / 40)
    with pytest.raises(ValueError, match="live_slots=1"):
        Timeline(t=[1.0, 2.0], running=[1, 1], reserved_slots=[1, 1], live_slots=[1])


def _python_managers() -> list:
    managers = [lambda n, bs: SimpleBlockManager(n, bs)]
    pool = load_vllm_style_pool()
    if pool is not None:
        managers.append(lambda n, bs: PoolBlockManager(pool, n, bs))
    return managers


@pytest.mark.parametrize("make", _python_managers())
def test_python_block_managers_match_core_prefix_hits(make) -> None:
    from pagedrs import BlockManager

    trace = make_trace(num_seqs=40, block_size=4, seed=3)
    ours, core = make(1000, 4), BlockManager(1000, 4, 0, True)
    for i, prompt in enumerate(trace.prompts):
        sid = i
        assert ours.allocate(sid, prompt) == core.allocate(sid, prompt), f"prefix hit differs for {sid}"
        ours.commit(sid, len(prompt))
        core.commit(sid, len(prompt))
        for t in range(trace.decode_tokens[i]):
            ours.append_tokens(sid, [t])
            core.append_tokens(sid, [t])
        assert len(ours.tables[sid]) == len(core.block_table(sid))
        if i % 3 == 2:
            ours.free(i - 1)
            core.free(i - 1)
        assert ours.num_free_gpu_blocks == core.num_free_gpu_blocks


def test_limits_and_decode_quick_write_bounds_next_to_tokens_per_s(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    common = ["--quick", "--model", str(tiny_llama_dir), "--out", str(out)]
    assert bench.main(["limits", *common]) == 0
    limits = json.loads((out / "limits.json").read_text())
    assert limits["read_bandwidth_bytes_per_s"] > 0
    assert set(limits["gemm_flops"]) == {"float32", "bfloat16", "int8", "int4"}
    assert "GB/s" in (out / "limits.md").read_text()

    assert bench.main(["decode", *common, "--weight-dtype", "int8"]) == 0
    decode = json.loads((out / "decode.json").read_text())
    grid = decode["grid"]
    assert [(r["weights"], r["batch"], r["prompt"]) for r in decode["rows"]] == [
        ("int8", b, p) for b in grid["batch_sizes"] for p in grid["prompt_lens"]
    ]
    for row in decode["rows"]:
        assert row["decode_steps"] == grid["new_tokens"] - 1  # one prefill step, then one token per step
        assert row["bound"] == min(row["stream_bound"], row["gemm_bound"])
        assert row["ratio_to_bound"] == pytest.approx(row["decode_tok_per_s"] / row["bound"])
        assert row["cpu_ratio_to_bound"] == pytest.approx(row["decode_tok_per_cpu_s"] / row["bound"])
    assert "Machine:" in (out / "decode.md").read_text()


def test_structured_quick_reports_mask_cost_and_compiles_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench.main(["structured", "--quick", "--model", str(tiny_llama_dir), "--block-size", "4", "--out", str(out)]) == 0
    data = json.loads((out / "structured.json").read_text())
    assert [r["batch"] for r in data["rows"]] == list(data["settings"]["batches"])
    for row in data["rows"]:
        assert row["free_full_steps"] > 0 and row["json_full_steps"] > 0
        assert 0 < row["json_mask_ms"] < row["json_step_ms"]
        assert 0 < row["mask_share_pct"] < 100
    assert [c["compiles"] for c in data["compiles"]] == [1] * len(data["compiles"])  # the second request hit the cache
    assert "masks' share of the step" in (out / "structured.md").read_text()
