"""Executors: where a step's copies and forward pass run, and who knows the device memory.

    base.py     the ``Executor`` protocol, ``DiskTierHandle``, ``TierPlan``
    local.py    ``LocalExecutor``: this process, one device (``ModelRunner``), the disk store
    tiers.py    ``plan_tiers``: the host cache sized, the disk store opened through the executor
    factory.py  ``make_executor``: local, or ``pagedrs.distributed.tp_executor.TPExecutor``
    async_execution.py, token_fill.py  asynchronous scheduling's worker, and the next step's
                placeholder ids filled from the drawn tokens (on the device where they are there)

The tensor-parallel executor imports ``executor.base`` and ``executor.local`` (its shards are
local executors), never this package's factory: no import cycle.
"""

from pagedrs.executor.base import DiskTierHandle, Executor, TierPlan
from pagedrs.executor.factory import make_executor
from pagedrs.executor.local import LocalExecutor
from pagedrs.executor.tiers import disk_tier_refusal, plan_tiers

__all__ = ["DiskTierHandle", "Executor", "LocalExecutor", "TierPlan", "disk_tier_refusal", "make_executor", "plan_tiers"]
