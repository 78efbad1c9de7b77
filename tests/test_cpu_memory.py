"""On a CPU device "device" and "host" are one RAM: by default the KV budget is the pool's
alone (no host tier, no swap space), explicit host-tier sizes are honoured, and the sizes
are logged once at startup."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedrs import Engine, EngineArgs
from pagedrs.kv_tiers import sizing

BLOCK = 4
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BLOCK  # tiny llama: layers x K,V x kv heads x head_dim x fp32
MIB = 2**20


def gib(blocks: int) -> float:
    return blocks * BYTES_PER_BLOCK / 2**30


def tiny(model_dir, **kw) -> Engine:
    return Engine(EngineArgs(model=str(model_dir), block_size=BLOCK, max_model_len=64, **{"num_gpu_blocks": 24, **kw}))


def test_auto_sizes_are_zero_on_the_cpu_and_todays_values_on_cuda(monkeypatch):
    monkeypatch.setattr(sizing, "mem_available_bytes", lambda: 20 * 2**30)
    assert sizing.resolved_swap_space_gb(None, device_type="cpu") == 0.0
    assert sizing.resolved_host_cache_gb(None, device_type="cpu") == 0.0
    assert sizing.resolved_swap_space_gb(None, device_type="cuda") == 1.0
    assert sizing.resolved_host_cache_gb(None, device_type="cuda") == pytest.approx(2.0)  # 10% of 20 GiB
    monkeypatch.setattr(sizing, "mem_available_bytes", lambda: 200 * 2**30)
    assert sizing.resolved_host_cache_gb(None, device_type="cuda") == 4.0  # capped
    for device_type in ("cpu", "cuda"):  # an explicit value is honoured everywhere, 0 included
        assert sizing.resolved_swap_space_gb(0.25, device_type=device_type) == 0.25
        assert sizing.resolved_host_cache_gb(0.5, device_type=device_type) == 0.5
        assert sizing.resolved_swap_space_gb(0, device_type=device_type) == 0.0
    assert sizing.host_cache_blocks(None, BYTES_PER_BLOCK, device_type="cpu") == 0
    assert sizing.host_cache_blocks(gib(7), BYTES_PER_BLOCK, device_type="cpu") == 7
    assert EngineArgs().swap_space_gb is None and EngineArgs().kv_host_cache_gb is None
    assert EngineArgs(swap_space_gb=1.0).swap_space_gb == 1.0  # the DESIGN.md contract still takes a size


def test_a_cpu_engine_holds_no_host_pool_by_default_and_logs_its_sizes(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedrs.engine"):
        engine = tiny(tiny_llama_dir)
    s = engine.stats()
    assert engine.scheduler_config.num_cpu_blocks == 0 and s["num_host_cache_blocks"] == 0
    assert not engine.scheduler_config.host_cache_evicted
    assert s["memory_host_pool_bytes"] == 0
    assert s["memory_kv_pool_bytes"] == 24 * BYTES_PER_BLOCK  # the pool itself is what was asked for
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pages on cpu")]
    assert lines == [
        f"KV pages on cpu: pool 24 x {BLOCK} tokens (0.00 GB, {BYTES_PER_BLOCK // BLOCK} bytes/token); "
        "host: swap 0 + cache 0 (0.00 GB); disk 0 slots"
    ]


def test_explicit_host_tiers_are_honoured_on_the_cpu(tiny_llama_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pagedrs.engine"):
        engine = tiny(tiny_llama_dir, swap_space_gb=gib(10), kv_host_cache_gb=gib(6), kv_disk_path=str(tmp_path),
                      kv_disk_gb=gib(40))
    s = engine.stats()
    assert engine.scheduler_config.num_cpu_blocks == 16 and s["num_host_cache_blocks"] == 6
    assert s["memory_host_pool_bytes"] == 16 * BYTES_PER_BLOCK
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pages on cpu")]
    assert "host: swap 10 + cache 6" in line and "disk " in line and not line.endswith("disk 0 slots")
    engine.shutdown()


_MEASURE = """
import gc, os, sys
from pagedrs import Engine, EngineArgs, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def tiny(kv):
    return Engine(EngineArgs(model=sys.argv[1], block_size=4, max_model_len=64, kv_cache_memory=kv))

tiny(8 << 20)  # the first engine's one-off imports and allocations
gc.collect()
before = rss()
engine = tiny(256 << 20)
started = rss()
pool = engine.core.executor.runner.kv_cache
assert not pool.any()  # zero where nothing was written, though no byte of it was
engine.add_request("a", "hello there", SamplingParams(max_tokens=4))
while engine.has_unfinished():
    engine.step()
pool.add_(1)  # every page touched, as a pool in long use
print(engine.stats()["memory_kv_pool_bytes"], started - before, rss() - before)
"""


def test_the_default_cpu_engine_holds_about_its_pool_not_twice_it(tiny_llama_dir):
    """A 256 MiB pool used to come with a host cache as large and 1 GiB of swap space (1.5 GiB more).
    Its pages are faulted in as they are used (``huge_pages.zeros``): a start touches none of them
    (writing them all made the default 2.3 GB pool 4.3 s of every start), a pool in use holds about
    itself. Measured in a fresh interpreter: in a long test session the allocator reuses memory
    earlier tests freed, and RSS need not grow at all."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tiny_llama_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pool, at_start, in_use = (int(x) for x in out.stdout.split()[-3:])
    assert pool == 256 * MIB
    assert at_start < 32 * MIB, at_start / MIB
    assert 256 * MIB <= in_use < 256 * MIB + 384 * MIB, in_use / MIB



def test_a_pool_the_host_cannot_map_is_refused_naming_the_fields_and_the_bytes(tiny_llama_dir, monkeypatch):
    """The mapped pool failed with a bare "OSError: [Errno 12] Cannot allocate memory" (torch's allocator
    had named the size). 1 EiB is past any x86-64 process's address space (5-level paging too), so no
    overcommit setting maps it; an engine asking that much is stopped earlier by its bookkeeping's check, so the engine's
    message is checked with the mapping's failure standing in."""
    from pagedrs import huge_pages

    with pytest.raises(MemoryError, match=r"cannot map 1152921504606846976 bytes for a CPU tensor of shape "
                                          r"\(1152921504606846976,\) \(torch.uint8\): "):
        huge_pages.zeros((1 << 60,), torch.uint8)

    def unmappable(shape, dtype):
        raise MemoryError("cannot map 123 bytes: Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "zeros", unmappable)
    with pytest.raises(ValueError, match=r"num_gpu_blocks / kv_cache_memory: the KV pool of 24 blocks of 4 tokens "
                                         r"cannot be allocated in host memory \(cannot map 123 bytes: Cannot "
                                         r"allocate memory\); ask for a smaller pool"):
        tiny(tiny_llama_dir)
