"""The page-cache tiers below the device: the host cache sized, the disk store opened (or refused)."""

from __future__ import annotations

from typing import Optional

import torch

from pagedrs.engine_args import EngineArgs
from pagedrs.executor.base import Executor, TierPlan
from pagedrs.kv_tiers import host_cache_blocks
from pagedrs.kv_tiers.errors import DiskTierError
from pagedrs.memory import KvPlan, log_kv_sizes


def plan_tiers(executor: Executor, args: EngineArgs, plan: KvPlan) -> TierPlan:
    """Sizes the host cache and opens the disk store (see ``_plan_tiers``); logs every tier's size once."""
    tiers = _plan_tiers(executor, args, plan)
    paged = args.kv_layout == "paged"  # the contiguous baseline gets no host tier
    log_kv_sizes(torch.device(args.device), args.block_size, plan, swap_blocks=plan.num_cpu_blocks if paged else 0,
                 host_cache_blocks=tiers.host_cache_blocks, disk_blocks=tiers.disk_blocks)
    return tiers


def _plan_tiers(executor: Executor, args: EngineArgs, plan: KvPlan) -> TierPlan:
    """Sizes the host cache (any executor: each rank keeps its own host pool) and opens the
    disk store through the executor (``Executor.open_disk_tier``: one that cannot hold one refuses)."""
    if args.kv_layout != "paged" or not args.enable_prefix_caching:
        return TierPlan(0, 0)  # nothing is cached: an auto host cache is 0 (an explicit one EngineArgs refused)
    host = host_cache_blocks(args.kv_host_cache_gb, plan.bytes_per_block, device_type=torch.device(args.device).type)
    if args.kv_disk_path is None:
        return TierPlan(host, 0)
    refusal = disk_tier_refusal(args)
    if refusal is not None:
        raise DiskTierError(args.kv_disk_path, refusal)
    disk = executor.open_disk_tier()
    if disk is None:
        raise DiskTierError(args.kv_disk_path, f"{type(executor).__name__} opened no disk tier")
    return TierPlan(host, disk.num_slots)


def disk_tier_refusal(args: EngineArgs) -> Optional[str]:
    """Why settings alone rule out the disk tier that ``kv_disk_path`` asks for, or None.
    Asked before any process starts: a tier asked for and not given is a startup error."""
    if args.kv_disk_path is None:
        return None
    if not args.enable_prefix_caching:
        return ("enable_prefix_caching is False; the disk tier holds evicted prefix-cache pages, so it needs "
                "enable_prefix_caching=True")
    if args.tensor_parallel_size > 1:
        return (f"tensor_parallel_size is {args.tensor_parallel_size}; the disk tier needs tensor_parallel_size=1 "
                "(a tensor-parallel store would need a file per rank)")
    if args.kv_layout != "paged":
        return f"kv_layout is {args.kv_layout!r}; the disk tier needs kv_layout='paged' (the contiguous baseline caches nothing)"
    return None
