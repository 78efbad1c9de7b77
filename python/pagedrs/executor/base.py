"""The executor protocol: what the engine needs from whatever runs the model, and the tier plan.

The engine plans (through the Rust scheduler) and samples; an executor executes. It owns
the model weights and the KV tensors, sizes the KV pools for the memory it has, runs each
step's tier transfers and copy-on-write copies, then the forward pass, and returns the
logits of the rows that sample. The engine never builds a runner or touches a KV tensor.

    engine ──StepInput──► Executor.execute ──► logits [S, vocab]
           ◄── completed transfer ids (take_completed_transfers) ── host pins released in the core

The disk tier, when one is on, is the executor's too (it writes the pages it holds): the
engine reaches it only through ``Executor.disk_tier()``, a ``DiskTierHandle`` or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedrs.kv_tiers.store_layout import SeedPages
from pagedrs.memory import KvPlan
from pagedrs.models.loader import LoadedModel
from pagedrs.step_input import StepInput, Transfer


@dataclass(frozen=True)
class TierPlan:
    """The page-cache tiers below the device, in blocks."""

    host_cache_blocks: int  # host blocks for evicted prefix pages (added to the swap pool)
    disk_blocks: int  # slots of the disk store that opened (0 = off; its pages: Executor.disk_tier().seed)


class DiskTierHandle(Protocol):
    """The engine's handle on an executor's open disk page store.

    Order of use: ``seed`` goes to the scheduler, then ``take_failed_disk_slots`` after each
    step; at a clean shutdown ``run_transfers`` (the scheduler's flush) and ``close``. Copies to
    disk carry their slots' meta (``Transfer.meta``): the tier never asks the core."""

    @property
    def num_slots(self) -> int:
        """Page slots of the store."""
        ...

    @property
    def seed(self) -> SeedPages:
        """The pages the store held when it opened (the scheduler is seeded with them)."""
        ...

    def run_transfers(self, transfers: list[Transfer]) -> None:
        """Runs tier copies outside a step (the shutdown flush), synchronously."""
        ...

    def take_failed_disk_slots(self) -> list[int]:
        """Disk slots whose write failed after it was queued, since the last call (the core drops them)."""
        ...

    def erase_pages(self) -> None:
        """Invalidates every page the store holds, durably (a reset of the prefix cache: the core
        dropped them from its index, and a restart must not seed them back)."""
        ...

    def close(self) -> None:
        """Makes the store's pages durable and closes it; idempotent."""
        ...


class Executor(Protocol):
    """What the engine needs from whatever runs the model."""

    loaded: LoadedModel  # config and tokenizer (and, for the local executor, the weights)

    def plan_kv_memory(self) -> KvPlan:
        """How many device and host pages fit, for the settings in EngineArgs."""
        ...

    def open_disk_tier(self) -> DiskTierHandle | None:
        """Opens the disk store EngineArgs.kv_disk_path names (None when it names none); DiskTierError
        names the path and the reason when this executor cannot have one or the store cannot be used."""
        ...

    def disk_tier(self) -> DiskTierHandle | None:
        """The disk tier ``open_disk_tier`` opened, until shutdown; None when off."""
        ...

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the pools the scheduler will manage (its numbers, after its layout rules)."""
        ...

    def execute(self, step: StepInput) -> torch.Tensor:
        """Transfers, then copies, then the forward pass; float32 logits [S, vocab]."""
        ...

    def take_completed_transfers(self) -> list[int]:
        """Ids of the transfers whose copies have finished since the last call."""
        ...

    def take_failed_disk_slots(self) -> list[int]:
        """``disk_tier().take_failed_disk_slots()``; [] without a disk tier."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """{"weights", "kv_pool", "host_pool"}: what this process holds (rank 0's share under TP)."""
        ...

    def shutdown(self) -> None:
        """Closes the disk tier (when on) and releases the KV tensors and any worker processes."""
        ...
