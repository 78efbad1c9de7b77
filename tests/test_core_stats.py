"""Scheduler.core_stats(): one typed, frozen value with every counter, and stats() is its dict.

Both layouts are driven by hand (no model) far enough that the counters move: prefix
hits, copy-on-write forks, swap preemptions, host pages, steps. Then every field of
core_stats() must equal the key of stats() with the same name, and nothing else is in
either.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedrs._core import CoreStats, Scheduler, SchedulerConfig


def _drive(sched: Scheduler, seed: int, steps: int = 60) -> None:
    """Queues prompts sharing a prefix, forks some, samples tokens, finishes some; every
    step's transfers are reported and the step completed."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000) for _ in range(12)]
    next_id = 0
    for step in range(steps):
        if step % 3 == 0:
            tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            sched.add_sequence(next_id, np.array(prefix + tail, dtype=np.uint32), max_tokens=24, num_samples=2)
            next_id += 1
        plan = sched.schedule()
        sched.complete_transfers([t[0] for t in plan.transfers])
        sampled = [int(s) for s, do in zip(plan.seq_ids, plan.do_sample, strict=True) if do]
        fork_id = 10_000 + step
        if sampled and rng.random() < 0.3:
            sched.fork(sampled[0], fork_id)
        tokens = [(s, rng.randrange(1000)) for s in sampled if sched.num_tokens(s) < 40]
        if tokens:
            ids, toks = zip(*tokens, strict=True)
            sched.append_tokens(np.array(ids, dtype=np.uint64), np.array(toks, dtype=np.uint32))
        for s in sampled:
            if sched.contains(s) and sched.num_tokens(s) >= 40:
                sched.finish(s)
        sched.complete_step(plan.step_id, True)
        sched.check_invariants()


def _paged() -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_gpu_blocks=24, block_size=4, num_cpu_blocks=32, preemption_mode="swap",
        max_num_batched_tokens=32, admission_policy="prompt_only", watermark=0.05,
    ))


def _contiguous() -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_gpu_blocks=64, block_size=4, kv_layout="contiguous", contiguous_reserve="request",
        max_num_batched_tokens=32,
    ))


def _assert_agree(sched: Scheduler) -> CoreStats:
    typed = sched.core_stats()
    as_dict = sched.stats()
    assert list(as_dict) == CoreStats.fields, "stats() has exactly core_stats()'s fields, in order"
    for name in CoreStats.fields:
        value = getattr(typed, name)
        assert type(value) is int, name
        assert value == as_dict[name], name
    assert typed.as_dict() == as_dict
    return typed


def test_paged_core_stats_agree_with_stats_on_every_key() -> None:
    sched = _paged()
    _assert_agree(sched)  # a fresh scheduler too
    _drive(sched, seed=1)
    s = _assert_agree(sched)
    # The run moved the counters the comparison is about (not all zeros on both sides).
    assert s.num_steps == 60
    assert s.prefix_hits > 0 and s.prefix_queries >= s.prefix_hits
    assert s.prefix_hits == s.prefix_hits_device + s.prefix_hits_host + s.prefix_hits_disk
    assert s.num_swap_preemptions > 0 and s.swap_out_blocks > 0
    assert s.num_preemptions == s.num_swap_preemptions + s.num_recompute_preemptions
    assert s.cow_copies > 0
    assert s.num_used_gpu_blocks == s.num_gpu_blocks - s.num_free_gpu_blocks
    assert s.num_running == sched.num_running and s.num_waiting == sched.num_waiting


def test_contiguous_core_stats_agree_with_stats_on_every_key() -> None:
    sched = _contiguous()
    _drive(sched, seed=2)
    s = _assert_agree(sched)
    assert s.num_steps == 60 and s.num_decode_tokens > 0
    # The baseline caches nothing and has no host tier: its KV counters say so.
    assert (s.prefix_queries, s.prefix_hits, s.num_free_cpu_blocks, s.num_cached_gpu_blocks) == (0, 0, 0, 0)
    assert s.reserved_slots >= s.live_slots > 0


def test_core_stats_is_a_frozen_snapshot() -> None:
    sched = _paged()
    before = sched.core_stats()
    with pytest.raises(AttributeError):
        before.num_steps = 7  # type: ignore[misc]
    _drive(sched, seed=3, steps=5)
    assert before.num_steps == 0 and sched.core_stats().num_steps == 5


def test_engine_stats_are_built_from_core_stats_and_name_a_missing_field() -> None:
    """EngineStats takes every core counter from CoreStats by name; a field neither the core
    nor the engine gives is an error naming it, never a silent zero."""
    from dataclasses import fields

    from pagedrs.stats import EngineStats

    sched = _paged()
    _drive(sched, seed=5)
    core = sched.core_stats()
    engine_fields = {f.name for f in fields(EngineStats)} - set(CoreStats.fields)
    derived = {"kv_reserved_slots", "kv_live_slots", "kv_utilization", "kv_waste_pct", "prefix_hit_rate",
               "kv_bytes_to_host", "kv_bytes_from_host", "kv_bytes_to_disk", "kv_bytes_from_disk",
               "swap_bytes_out", "swap_bytes_in", "step_swap_bytes_out", "step_swap_bytes_in"}
    given = {name: 1 for name in engine_fields - derived}
    given["kv_bytes_per_block"], given["kv_layout"] = 64, "paged"
    stats = EngineStats.build(core, **given)
    assert stats.prefix_hits == core.prefix_hits > 0 and stats.num_steps == core.num_steps
    assert stats.kv_bytes_to_host == 64 * (core.swap_out_blocks + core.host_cache_saves)
    del given["peak_running"]
    with pytest.raises(TypeError, match="'peak_running' is neither a CoreStats field nor given by the engine"):
        EngineStats.build(core, **given)
