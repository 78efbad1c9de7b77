"""``pagedrs bench spec`` on the tiny llama: one run reports batch 1 and every batch size side by
side, the default config proposes nothing above its CPU threshold, and no run changes a token."""

from __future__ import annotations

from pagedrs.bench import spec
from pagedrs.bench.config import BenchConfig


def test_one_run_reports_batch_one_and_each_batch_size_side_by_side(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(spec.QUICK, "max_tokens", 10)
    monkeypatch.setitem(spec.QUICK, "batches", (3, 4))
    cfg = BenchConfig(model=str(tiny_llama_dir), quick=True, num_requests=None, out_dir=None, plot_dir=None,
                      json_path=None, block_size=4)
    data, text = spec.run(cfg, "test machine")
    rows = data["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [
        (w, b) for w in ("repetitive", "random") for b in (1, 3, 4)]
    assert data["settings"]["default_disable_by_batch_size"] == 2
    for r in rows:
        assert r["same_tokens"], r
        if r["batch"] > 2:
            assert r["proposed"] == 0, r  # the default off-switch
    assert sum(r["proposed"] for r in rows if r["batch"] == 1) > 0  # batch 1 still speculates
    assert "| repetitive | 4 |" in text and "ngram never off" in text
