"""Asynchronous scheduling with the disk tier (EngineArgs(async_scheduling=True, kv_disk_path=...)).

The worker thread runs step N's page copies to disk while the core plans step N+1, so a copy
to disk carries its slots' meta (hash, parent, tokens) from the moment the core handed it out
(``step_input.Transfer.meta``) and the runner never asks the core; the slots themselves stay
pinned in the core until the copy is reported done. Greedy output equals transformers' with
pages really travelling device -> host -> disk -> device, and after a restart on the store an
asynchronous engine wrote. The failures (a full disk, pages corrupted on disk, writes failing
mid-page) run with asynchronous scheduling in tests/test_disk_faults.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from test_async_scheduling import step_through_interrupts
from test_engine import greedy, hf_greedy, run_all
from test_kv_tiers import TIERS, conversations, engine, gib, hf_model, two_turns  # noqa: F401  (a fixture)


@pytest.mark.parametrize("tiers", ["host+disk", "disk"])
def test_greedy_with_disk_tiers_equals_transformers(tiny_llama_dir, hf_model, tmp_path, tiers):  # noqa: F811
    eng = engine(tiny_llama_dir, async_scheduling=True, kv_disk_path=str(tmp_path / "store"), **TIERS[tiers])
    prompts = conversations(eng.loaded.config.vocab_size)
    for turn in two_turns(eng, prompts):
        for i, p in enumerate(prompts):
            assert turn[f"r{i}"] == hf_greedy(hf_model, p, 6), f"{tiers}: user {i}"
    s = eng.stats()
    assert s["prefix_hits_disk"] > 0 and s["disk_writes"] > 0, s
    eng.core.check_invariants()
    # idle again: no step is left in flight, so the reset clears every tier, the store's records too
    reset = eng.reset_prefix_cache()
    assert reset.refused is None and reset.disk > 0, reset
    assert eng.stats()["num_cached_disk_blocks"] == 0
    done = run_all(eng, prompts, greedy(6))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 6), f"{tiers}, after the reset: user {i}"
    eng.shutdown()


class _Recording:
    """The core's scheduler, recording the thread of every ``disk_pages`` call."""

    def __init__(self, inner) -> None:
        self._inner, self.threads = inner, []

    def disk_pages(self, slots):
        self.threads.append(threading.current_thread().name)
        return self._inner.disk_pages(slots)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_pages_go_to_disk_on_the_worker_with_the_meta_the_core_gave(tiny_llama_dir, tmp_path):
    """Copies to disk run on the step worker; the slots' meta is asked of the core on the core's
    thread only, when the step is planned, and is what the store then holds for each slot."""
    eng = engine(tiny_llama_dir, async_scheduling=True, kv_disk_path=str(tmp_path / "store"), kv_disk_gb=gib(400))
    recording = _Recording(eng.core.scheduler)
    eng.core.scheduler = recording
    runner = eng.executor.inner.runner
    written: dict[int, int] = {}  # slot -> page hash, as handed to the runner
    write_threads = []
    write = runner.disk.write

    def watched(cache, pairs, meta):
        write_threads.append(threading.current_thread().name)
        written.update(zip(pairs[:, 1].tolist(), meta[0].tolist()))
        return write(cache, pairs, meta)

    runner.disk.write = watched
    prompts = conversations(eng.loaded.config.vocab_size)
    two_turns(eng, prompts)
    assert written and write_threads and all(t.startswith("pagedrs-step") for t in write_threads), write_threads
    assert recording.threads and set(recording.threads) == {threading.main_thread().name}, set(recording.threads)
    store = eng.executor.inner._disk_store
    store.flush()
    for slot, page_hash in written.items():
        meta = store.slot_meta(slot)
        if meta is not None and meta.page_hash == page_hash:
            continue
        # a slot written twice holds its later page; the core's index says which
        now = eng.core.scheduler.disk_pages(np.array([slot], dtype=np.uint32))[0]
        assert meta is not None and int(now[0]) == meta.page_hash, slot
    eng.shutdown()


def test_a_restart_finds_the_pages_an_asynchronous_engine_wrote(tiny_llama_dir, hf_model, tmp_path):  # noqa: F811
    first = engine(tiny_llama_dir, async_scheduling=True, kv_disk_path=str(tmp_path), kv_disk_gb=gib(400))
    prompts = conversations(first.loaded.config.vocab_size)
    run_all(first, prompts, greedy(4))
    first.shutdown()  # drains the step in flight, stops the worker, then flushes the cached pages

    second = engine(tiny_llama_dir, async_scheduling=True, kv_disk_path=str(tmp_path), kv_disk_gb=gib(400))
    assert second.stats()["num_cached_disk_blocks"] > 0
    done = run_all(second, prompts, greedy(6))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 6)
    s = second.stats()
    eligible = sum((len(p) - 1) // 4 for p in prompts)
    assert s["prefix_hits_disk"] + s["prefix_hits_device"] >= 0.9 * eligible, s
    second.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_interrupt_after_a_steps_disk_copies_never_serves_them_wrong(tiny_llama_dir, hf_model, tmp_path,  # noqa: F811
                                                                        async_scheduling):
    """Ctrl-C right after a step queued its copies to disk (before its forward; on the worker with
    asynchronous scheduling): the steps in flight go back and are computed again, the copies that ran
    are reported done (only those: ``ModelRunner.run_transfers``' done list), and neither this engine
    nor one restarted on the store ever answers differently from transformers."""
    eng = engine(tiny_llama_dir, async_scheduling=async_scheduling, kv_disk_path=str(tmp_path), kv_disk_gb=gib(400))
    runner = (eng.executor.inner if async_scheduling else eng.executor).runner
    real = runner.run_transfers
    armed = {"left": 2}  # two interrupts, each right after copies to disk

    def run_transfers(transfers, done=None):
        real(transfers, done)
        if armed["left"] and any(t.dst == "disk" for t in transfers):
            armed["left"] -= 1
            raise KeyboardInterrupt

    runner.run_transfers = run_transfers
    prompts = conversations(eng.loaded.config.vocab_size)
    interrupted = 0
    for _ in range(2):  # two turns: the second finds pages the first pushed to disk
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, greedy(6))
        finished, count = step_through_interrupts(eng)
        interrupted += count
        for i, p in enumerate(prompts):
            assert finished[f"r{i}"].outputs[0].token_ids == hf_greedy(hf_model, p, 6), f"user {i}"
    assert interrupted == 2 and eng.stats()["prefix_hits_disk"] > 0
    eng.shutdown()

    second = engine(tiny_llama_dir, kv_disk_path=str(tmp_path), kv_disk_gb=gib(400))
    done = run_all(second, prompts, greedy(6))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 6), f"after the restart: user {i}"
    assert second.stats()["prefix_hits_disk"] > 0
    second.shutdown()
