"""KV memory sizing and the preemption cost model, from the model config and the device.

The Rust scheduler thinks in blocks; this module turns bytes and device speeds into
block counts and into the two numbers of its `auto` preemption cost model:

    swap a victim       = 2 x blocks x bytes_per_block / host_link_bandwidth
    recompute a victim  = tokens x 2 x num_parameters / device_flops

(See rust/src/scheduler/config.rs.) The speeds are round figures per device kind;
only their ratio matters, and it makes short sequences recompute and long ones swap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("pagedrs.engine")

# Round figures: (host link bytes/s, sustained FLOP/s of the forward pass).
_DEVICE_SPEEDS = {
    "cpu": (8e9, 5e10),  # a memcpy between two host buffers; a few cores of fp32 matmul
    "cuda": (2.5e10, 2e14),  # PCIe 4/5-class pinned copies; a tensor-core GPU at modest efficiency
}
# The CPU pool by default: a tenth of the memory available now, within these bounds.
CPU_KV_FRACTION = 0.10
CPU_KV_MIN_BYTES = 256 * 2**20
CPU_KV_MAX_BYTES = 8 * 2**30


@dataclass(frozen=True)
class KvPlan:
    bytes_per_token: int
    bytes_per_block: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    swap_cost_per_block: float  # seconds
    recompute_cost_per_token: float  # seconds


def plan_kv_memory(
    *,
    bytes_per_token: int,
    block_size: int,
    num_parameters: int,
    device: torch.device,
    num_gpu_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    swap_space_gb: float,
    reserved_blocks: int = 0,
    headroom_bytes: int = 0,
) -> KvPlan:
    """Pages per tier. ``reserved_blocks``: device blocks the executor allocates beside the pool and
    never gives the scheduler (the padded decode path's scratch page); they come out of a pool sized
    from bytes (``kv_cache_memory`` or the device's free memory), and are extra to an explicit
    ``num_gpu_blocks``, which is what the scheduler gets. ``headroom_bytes``: device memory left
    outside the pool when it is sized from the device's free memory (the CUDA graphs' pool)."""
    bytes_per_block = bytes_per_token * block_size
    if num_gpu_blocks is None:
        if kv_cache_memory is None:
            kv_cache_memory = max(0, _default_kv_bytes(device, gpu_memory_utilization) - headroom_bytes)
        num_gpu_blocks = kv_cache_memory // bytes_per_block - reserved_blocks
        if num_gpu_blocks < 1:
            raise ValueError(
                f"kv_cache_memory is {kv_cache_memory} bytes; one block of {block_size} tokens needs {bytes_per_block}"
                + (f", and {reserved_blocks} more are reserved (the padded decode path's scratch page)" if reserved_blocks else "")
            )
    num_cpu_blocks = int(swap_space_gb * 2**30) // bytes_per_block
    host_bw, flops = _DEVICE_SPEEDS["cuda" if device.type == "cuda" else "cpu"]
    return KvPlan(
        bytes_per_token=bytes_per_token,
        bytes_per_block=bytes_per_block,
        num_gpu_blocks=int(num_gpu_blocks),
        num_cpu_blocks=num_cpu_blocks,
        swap_cost_per_block=bytes_per_block / host_bw,
        recompute_cost_per_token=2.0 * num_parameters / flops,
    )


def log_kv_sizes(device: torch.device, block_size: int, plan: KvPlan, *, swap_blocks: int, host_cache_blocks: int,
                 disk_blocks: int) -> None:
    """The one startup line that says how many KV pages each tier holds (rank 0's share under TP)."""
    logger.info(
        "KV pages on %s: pool %d x %d tokens (%.2f GB, %d bytes/token); host: swap %d + cache %d (%.2f GB); "
        "disk %d slots",
        device, plan.num_gpu_blocks, block_size, plan.num_gpu_blocks * plan.bytes_per_block / 1e9,
        plan.bytes_per_token, swap_blocks, host_cache_blocks,
        (swap_blocks + host_cache_blocks) * plan.bytes_per_block / 1e9, disk_blocks,
    )


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_cpu_kv_bytes() -> int:
    """A tenth of the host memory available now, between 256 MiB and 8 GiB (512 MiB if unknown)."""
    available = available_host_bytes()
    if available is None:
        return 512 * 2**20
    return int(min(max(available * CPU_KV_FRACTION, CPU_KV_MIN_BYTES), CPU_KV_MAX_BYTES))


def _default_kv_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    if device.type != "cuda":
        return default_cpu_kv_bytes()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free
    return max(0, int(total * gpu_memory_utilization) - used_by_others)
