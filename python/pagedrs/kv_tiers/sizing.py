"""How big the host tiers (swap space, and the cache of evicted prefix pages) are by default.

``None`` ("auto") for ``EngineArgs.swap_space_gb`` and ``kv_host_cache_gb`` depends on the device:

- CUDA: 1 GiB of swap space, and a host cache of min(4 GiB, 10% of MemAvailable): large
  enough that a multi-turn workload finds its evicted conversations again, small enough
  never to push a shared machine into swap.
- CPU: neither. The "device" pool is host RAM too, so a host tier there is a second copy of
  the same memory: it doubled the KV footprint (the pool, plus a host tier as large, plus
  1 GiB of swap) and added page copies for capacity the pool itself gives. The KV budget
  is the pool's alone (``kv_cache_memory``, else a tenth of the memory available).

An explicit value is honoured on every device (the tests of the host tier pass one).
"""

from __future__ import annotations

from typing import Optional

DEFAULT_CAP_GB = 4.0
DEFAULT_FRACTION = 0.10
DEFAULT_SWAP_SPACE_GB = 1.0  # CUDA


def mem_available_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_host_cache_gb() -> float:
    """The CUDA default of the host cache: min(4 GiB, 10% of MemAvailable), 1 GiB if unknown."""
    available = mem_available_bytes()
    if available is None:
        return 1.0
    return min(DEFAULT_CAP_GB, DEFAULT_FRACTION * available / 2**30)


def resolved_swap_space_gb(value: Optional[float], *, device_type: str) -> float:
    """``EngineArgs.swap_space_gb`` resolved: None = 0 on the CPU, 1 GiB elsewhere."""
    if value is not None:
        return float(value)
    return 0.0 if device_type == "cpu" else DEFAULT_SWAP_SPACE_GB


def resolved_host_cache_gb(value: Optional[float], *, device_type: str) -> float:
    """``EngineArgs.kv_host_cache_gb`` resolved: None = 0 on the CPU, ``default_host_cache_gb()`` elsewhere."""
    if value is not None:
        return float(value)
    return 0.0 if device_type == "cpu" else default_host_cache_gb()


def host_cache_blocks(kv_host_cache_gb: Optional[float], bytes_per_block: int, *, device_type: str) -> int:
    """Host blocks for evicted prefix pages: 0 disables the tier."""
    return int(resolved_host_cache_gb(kv_host_cache_gb, device_type=device_type) * 2**30) // bytes_per_block
