"""``make_executor``: one process, or ``args.tensor_parallel_size`` of them."""

from __future__ import annotations

from typing import Any

from pagedrs.engine_args import EngineArgs
from pagedrs.executor.base import Executor
from pagedrs.executor.local import LocalExecutor
from pagedrs.executor.tiers import disk_tier_refusal
from pagedrs.kv_tiers.errors import DiskTierError


def make_executor(args: EngineArgs, **kwargs: Any) -> Executor:
    """The executor for ``args``; a disk tier the settings rule out is refused before any process starts."""
    refusal = disk_tier_refusal(args)
    if refusal is not None:
        assert args.kv_disk_path is not None  # only a disk path asked for is refused
        raise DiskTierError(args.kv_disk_path, refusal)
    if args.tensor_parallel_size > 1:
        from pagedrs.distributed.tp_executor import TPExecutor

        return TPExecutor(args, **kwargs)
    return LocalExecutor(args, **kwargs)
