"""The explicit interfaces between executor, runner and model: ``Executor.disk_tier()`` on both
executors, and the model's KV layout (``KvModel``) that the runner allocates by."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs import EngineArgs, SamplingParams
from pagedrs._core import Scheduler
from pagedrs.distributed.tp_executor import TPExecutor
from pagedrs.executor import DiskTierHandle, LocalExecutor, make_executor, plan_tiers
from pagedrs.kv_tiers.errors import DiskTierError
from pagedrs.models.interface import KvModel
from pagedrs.step_input import Transfer, transfers_from
from test_kv_tiers import BLOCK, engine, gib


def args(model_dir, **kw) -> EngineArgs:
    base = dict(model=str(model_dir), block_size=BLOCK, num_gpu_blocks=24, swap_space_gb=0, max_model_len=256,
                kv_host_cache_gb=0)
    base.update(kw)
    return EngineArgs(**base)


def test_a_local_executor_without_a_disk_path_has_no_disk_tier(tiny_llama_dir):
    ex = make_executor(args(tiny_llama_dir))
    assert isinstance(ex, LocalExecutor)
    assert ex.open_disk_tier() is None and ex.disk_tier() is None and ex.take_failed_disk_slots() == []
    tiers = plan_tiers(ex, ex.args, ex.plan_kv_memory())
    assert tiers.disk_blocks == 0
    ex.shutdown()


def test_the_local_disk_tier_runs_the_engines_setup_and_flush(tiny_llama_dir, tmp_path):
    """The sequence Engine.__init__ and its flush at shutdown run, through the handle only."""
    a = args(tiny_llama_dir, kv_disk_path=str(tmp_path / "disk"), kv_disk_gb=gib(16))
    ex = make_executor(a)
    tiers = plan_tiers(ex, a, ex.plan_kv_memory())
    disk = ex.disk_tier()
    assert disk is not None and tiers.disk_blocks == disk.num_slots > 0
    assert len(disk.seed.slots) == 0  # a new store holds nothing
    handle: DiskTierHandle = disk  # the protocol is what the engine holds
    scheduler = Scheduler(_config(a, tiers.disk_blocks))
    ex.init_kv_cache(24, 0)
    assert handle.take_failed_disk_slots() == []
    transfers = list(transfers_from(scheduler.flush_to_disk(), scheduler.disk_pages))
    handle.run_transfers(transfers)  # nothing cached yet: an empty flush
    # a copy to disk without its slots' meta (hash, parent, tokens) is refused, never written with a guess
    with pytest.raises(RuntimeError, match="transfer 7 to the disk tier carries no page meta"):
        handle.run_transfers([Transfer(7, "gpu", "disk", np.array([[0, 0]], dtype=np.int64))])
    assert disk.store.bytes_written == 0
    ex.shutdown()
    assert ex.disk_tier() is None
    handle.close()  # idempotent after shutdown


def test_pages_flushed_through_the_handle_seed_the_next_engine(tiny_llama_dir, tmp_path):
    path = str(tmp_path / "disk")
    first = engine(tiny_llama_dir, kv_disk_path=path, kv_disk_gb=gib(32))
    prompt = list(range(3, 3 + 3 * BLOCK))
    first.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0))
    while first.has_unfinished():
        first.step()
    first.shutdown()
    second = engine(tiny_llama_dir, kv_disk_path=path, kv_disk_gb=gib(32))
    try:
        disk = second.executor.disk_tier()
        assert disk is not None and len(disk.seed.slots) >= 3  # the prompt's full blocks came back
    finally:
        second.shutdown()


def test_the_tensor_parallel_executor_refuses_a_disk_tier(tmp_path):
    ex = TPExecutor.__new__(TPExecutor)  # no workers: only the disk-tier methods are asked
    ex.args = EngineArgs(tensor_parallel_size=2)
    assert ex.open_disk_tier() is None and ex.disk_tier() is None and ex.take_failed_disk_slots() == []
    ex.args = EngineArgs(tensor_parallel_size=2, kv_disk_path=str(tmp_path))
    with pytest.raises(DiskTierError, match="the disk tier needs a local executor, got TPExecutor"):
        ex.open_disk_tier()


def test_the_runner_allocates_the_models_kv_layout(tiny_llama_dir):
    ex = make_executor(args(tiny_llama_dir))
    ex.init_kv_cache(7, 3)
    model: KvModel = ex.loaded.model
    c = ex.loaded.config
    shape = (c.num_hidden_layers, 2, 7, BLOCK, model.kv_heads_per_rank, c.head_dim)
    assert model.kv_cache_shape(7, BLOCK) == shape
    runner = ex.runner
    assert runner is not None and tuple(runner.kv_cache.shape) == shape
    assert tuple(runner.cpu_cache.shape) == model.kv_cache_shape(3, BLOCK)
    views = model.kv_layer_views(runner.kv_cache)
    assert len(views) == c.num_hidden_layers
    k, v = views[1]
    k.fill_(1.0)
    v.fill_(2.0)
    assert torch.equal(runner.kv_cache[1, 0], k) and torch.equal(runner.kv_cache[1, 1], v)  # views, not copies
    assert float(runner.kv_cache[0].abs().sum()) == 0.0 and np.isclose(float(runner.kv_cache[1].sum()), 3.0 * k.numel())
    ex.shutdown()


def _config(a: EngineArgs, disk_blocks: int):
    from pagedrs._core import SchedulerConfig

    return SchedulerConfig(num_gpu_blocks=24, block_size=a.block_size, num_cpu_blocks=0,
                           enable_prefix_caching=True, max_model_len=256, num_disk_blocks=disk_blocks)


def test_a_plan_with_disk_copies_needs_the_cores_page_meta() -> None:
    """Copies to disk take their slots' meta when the core hands them out (``transfers_from``); a
    batch to disk without a source of meta is refused, the other batches need none."""
    pairs = np.array([[3, 7], [4, 9]], dtype=np.int64)
    with pytest.raises(ValueError, match="transfer 5 copies pages to the disk tier: page_meta"):
        transfers_from([(5, "cpu", "disk", pairs)], None)
    asked = []

    def page_meta(slots: np.ndarray):
        asked.append(slots.tolist())
        return np.array([11, 12], dtype=np.uint64), np.array([0, 11], dtype=np.uint64), np.zeros((2, 4), dtype=np.uint32)

    (to_disk,) = transfers_from([(5, "cpu", "disk", pairs)], page_meta)
    assert asked == [[7, 9]] and to_disk.meta is not None and to_disk.meta[0].tolist() == [11, 12]
    (to_host,) = transfers_from([(6, "gpu", "cpu", pairs)], None)
    assert to_host.meta is None and (to_host.id, to_host.src, to_host.dst) == (6, "gpu", "cpu")
