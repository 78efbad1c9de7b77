"""Typed stats: every counter the server exports is a field of EngineStats, and stats() is its dict view."""

from __future__ import annotations

from dataclasses import fields

from pagedrs import Engine, EngineArgs
from pagedrs.server import metrics
from pagedrs.stats import EngineStats

CONTRACT_KEYS = {"num_gpu_blocks", "num_free_gpu_blocks", "num_preemptions", "prefix_queries", "prefix_hits",
                 "num_running", "num_waiting"}  # DESIGN.md: tests outside this repository read these


def test_every_metric_reads_a_field_of_engine_stats():
    names = {f.name for f in fields(EngineStats)}
    keys = {key for key, _ in metrics._GAUGES.values()}
    keys |= {k for ks, _ in metrics._COUNTERS.values() for k in ks}
    assert keys - names <= metrics.OPTIONAL_KEYS, f"metrics read keys EngineStats lacks: {sorted(keys - names)}"
    assert CONTRACT_KEYS <= names


def test_stats_is_the_dict_view_of_typed_stats(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=16, max_model_len=32))
    typed = engine.typed_stats()
    assert engine.stats() == typed.as_dict()
    assert typed.num_gpu_blocks == typed.num_free_gpu_blocks == 16 and typed.kv_layout == "paged"
