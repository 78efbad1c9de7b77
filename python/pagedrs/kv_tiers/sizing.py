"""How big the host tier for evicted prefix pages is by default.

``EngineArgs.kv_host_cache_gb=None`` means min(4 GiB, 10% of MemAvailable): large enough
that a multi-turn workload finds its evicted conversations again, small enough never to
push a shared machine into swap. On a CPU device the "device" pool is host RAM too, so
there the default is further capped at the device pool's own size (the host tier is an
extension of the same memory, not a different, cheaper memory).
"""

from __future__ import annotations

from typing import Optional

DEFAULT_CAP_GB = 4.0
DEFAULT_FRACTION = 0.10


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
    available = mem_available_bytes()
    if available is None:
        return 1.0
    return min(DEFAULT_CAP_GB, DEFAULT_FRACTION * available / 2**30)


def host_cache_blocks(kv_host_cache_gb: Optional[float], bytes_per_block: int, *, device_type: str,
                      num_gpu_blocks: int) -> int:
    """Host blocks for evicted prefix pages: 0 disables the tier."""
    if kv_host_cache_gb is None:
        blocks = int(default_host_cache_gb() * 2**30) // bytes_per_block
        return min(blocks, num_gpu_blocks) if device_type == "cpu" else blocks
    return int(kv_host_cache_gb * 2**30) // bytes_per_block
