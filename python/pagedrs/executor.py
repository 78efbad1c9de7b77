"""Executors: where a step's copies and forward pass run, and who knows the device memory.

The engine plans (through the Rust scheduler) and samples; an executor executes. It owns
the model weights and the KV tensors, sizes the KV pools for the memory it has, runs each
step's tier transfers and copy-on-write copies, then the forward pass, and returns the
logits of the rows that sample. The engine never builds a runner or touches a KV tensor.

    engine ──StepInput──► Executor.execute ──► logits [S, vocab]
           ◄── completed transfer ids (take_completed_transfers) ── host pins released in the core

``LocalExecutor`` runs everything in this process on one device (wrapping
``ModelRunner``). A multi-process tensor-parallel executor implements the same
protocol: it broadcasts each ``StepInput`` to its workers and gathers the logits.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from pagedrs.attention import AttentionBackend
from pagedrs.engine_args import EngineArgs
from pagedrs.kv_tiers import DiskPageStore, StoreGeometry, host_cache_blocks, model_fingerprint
from pagedrs.kv_tiers.disk_store import SeedPages
from pagedrs.kv_tiers.disk_tier import DiskTier, PageMeta
from pagedrs.kv_tiers.errors import DiskTierError
from pagedrs.kv_tiers.sizing import resolved_swap_space_gb
from pagedrs.memory import KvPlan, log_kv_sizes, plan_kv_memory
from pagedrs.model_runner import ModelRunner
from pagedrs.models import LoadedModel, load_model
from pagedrs.step_input import StepInput, Transfer

logger = logging.getLogger("pagedrs.executor")


@dataclass(frozen=True)
class TierPlan:
    """The page-cache tiers below the device, in blocks."""

    host_cache_blocks: int  # host blocks for evicted prefix pages (added to the swap pool)
    disk_blocks: int  # slots of the disk store that opened (0 = off)
    seed: Optional[SeedPages]  # the pages the disk store already holds


class Executor(Protocol):
    """What the engine needs from whatever runs the model."""

    loaded: LoadedModel  # config and tokenizer (and, for the local executor, the weights)

    def plan_kv_memory(self) -> KvPlan:
        """How many device and host pages fit, for the settings in EngineArgs."""
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
        """Disk slots whose write failed after it was queued, since the last call."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """{"weights", "kv_pool", "host_pool"}: what this process holds (rank 0's share under TP)."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One process, one device: today's ``ModelRunner`` behind the ``Executor`` protocol."""

    def __init__(
        self, args: EngineArgs, attention_backend: AttentionBackend | None = None, *, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.resolved_cpu_threads())
        from pagedrs.distributed import parallel_state

        if (parallel_state.tp_rank(), parallel_state.tp_size()) != (tp_rank, tp_size):
            raise RuntimeError(
                f"LocalExecutor for rank {tp_rank} of {tp_size}, but this process is rank "
                f"{parallel_state.tp_rank()} of {parallel_state.tp_size()} (set_tensor_parallel first)"
            )
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.loaded = load_model(args.model, dtype=args.dtype, device=self.device, weight_dtype=args.weight_dtype,
                                 skip_tokenizer_init=args.skip_tokenizer_init)
        self._backend = attention_backend
        self.runner: ModelRunner | None = None
        self._completed: list[int] = []
        self._disk_store: DiskPageStore | None = None
        self._page_meta: PageMeta | None = None

    def plan_kv_memory(self) -> KvPlan:
        args = self.args
        num_parameters = sum(p.numel() for p in self.loaded.model.parameters())
        return plan_kv_memory(
            bytes_per_token=self.loaded.config.kv_bytes_per_token(
                args.dtype, kv_heads=getattr(self.loaded.model, "kv_heads_per_rank", None)),
            block_size=args.block_size,
            num_parameters=num_parameters,
            device=self.device,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            swap_space_gb=resolved_swap_space_gb(args.swap_space_gb, device_type=self.device.type),
        )

    def open_disk_store(self) -> tuple[int, SeedPages]:
        """Opens (or creates) the disk page store of EngineArgs.kv_disk_path: (slots, the
        pages it holds). DiskTierError names the path and the reason when it cannot be used
        (another engine holds it, not a writable directory, too small, no space for it)."""
        args = self.args
        assert args.kv_disk_path is not None
        c = self.loaded.config
        geometry = StoreGeometry(
            fingerprint=model_fingerprint(self.loaded.model, c),
            dtype=args.dtype,
            block_size=args.block_size,
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            itemsize=torch.empty(0, dtype=self.loaded.dtype).element_size(),
        )
        slot_bytes = DiskPageStore(args.kv_disk_path, num_slots=1, geometry=geometry).slot_bytes
        num_slots = int(args.kv_disk_gb * 2**30) // slot_bytes
        if num_slots < 1:
            raise DiskTierError(args.kv_disk_path, f"kv_disk_gb={args.kv_disk_gb} holds no page slot; one slot "
                                                   f"needs {slot_bytes} bytes, so kv_disk_gb must be at least "
                                                   f"{slot_bytes / 2**30:.3g}")
        store = DiskPageStore(args.kv_disk_path, num_slots=num_slots, geometry=geometry)
        seed = store.open()
        self._disk_store = store
        return num_slots, seed

    def take_failed_disk_slots(self) -> list[int]:
        """Disk slots whose write failed since the last call (the core drops them); [] without a store."""
        return self._disk_store.take_failed_slots() if self._disk_store is not None else []

    def set_page_meta(self, page_meta: PageMeta) -> None:
        """Where disk writes get each slot's (hash, parent, tokens): the core, which assigned it."""
        self._page_meta = page_meta

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.runner = ModelRunner(
            self.loaded,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size=self.args.block_size,
            backend=self._backend,
        )
        if self._disk_store is not None:
            if self._page_meta is None:
                raise RuntimeError("LocalExecutor.init_kv_cache with a disk store needs set_page_meta first")
            self.runner.disk = DiskTier(self._disk_store, self._page_meta)

    def run_transfers(self, transfers: list[Transfer]) -> None:
        """Runs tier copies outside a step (the shutdown flush), synchronously."""
        if self.runner is None:
            raise RuntimeError("LocalExecutor.run_transfers before init_kv_cache")
        with torch.inference_mode():
            self.runner.run_transfers(transfers)

    def execute(self, step: StepInput, compute_logits: bool = True) -> torch.Tensor:
        if self.runner is None:
            raise RuntimeError("LocalExecutor.execute before init_kv_cache")
        try:
            return self.runner.execute(step, compute_logits=compute_logits)
        finally:
            # The runner's copies are synchronous with respect to later reads of the host
            # pool (a device-to-host copy blocks), so every transfer is done by now, also
            # when the forward pass failed after the copies.
            self._completed.extend(t.id for t in step.transfers)

    def take_completed_transfers(self) -> list[int]:
        done, self._completed = self._completed, []
        return done

    @functools.cached_property
    def _weights_bytes(self) -> int:
        """Parameters and buffers (packed int4/int8 weights are buffers), each tensor once; fixed after load,
        so counted once rather than on every stats() call (the serving loop asks every step)."""
        model = self.loaded.model
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        return int(sum(t.numel() * t.element_size() for t in tensors.values()))

    def memory_bytes(self) -> dict[str, int]:
        weights = self._weights_bytes
        kv = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() if self.runner else 0
        host = self.runner.cpu_cache.numel() * self.runner.cpu_cache.element_size() if self.runner else 0
        return {"weights": int(weights), "kv_pool": int(kv), "host_pool": int(host)}

    def shutdown(self) -> None:
        """Makes the disk store's pages durable and closes it, then drops the KV tensors."""
        if self._disk_store is not None:
            self._disk_store.close()
            self._disk_store = None
        self.runner = None


def plan_tiers(executor: Executor, args: EngineArgs, plan: KvPlan) -> TierPlan:
    """Sizes the host cache and opens the disk store (see ``_plan_tiers``); logs every tier's size once."""
    tiers = _plan_tiers(executor, args, plan)
    paged = args.kv_layout == "paged"  # the contiguous baseline gets no host tier
    log_kv_sizes(torch.device(args.device), args.block_size, plan, swap_blocks=plan.num_cpu_blocks if paged else 0,
                 host_cache_blocks=tiers.host_cache_blocks, disk_blocks=tiers.disk_blocks)
    return tiers


def _plan_tiers(executor: Executor, args: EngineArgs, plan: KvPlan) -> TierPlan:
    """Sizes the host cache (any executor: each rank keeps its own host pool) and opens the
    disk store (one process only: a tensor-parallel store would need a file per rank)."""
    if args.kv_layout != "paged":
        return TierPlan(0, 0, None)  # the contiguous baseline caches nothing
    host = host_cache_blocks(args.kv_host_cache_gb, plan.bytes_per_block, device_type=torch.device(args.device).type)
    if args.kv_disk_path is None:
        return TierPlan(host, 0, None)
    refusal = disk_tier_refusal(args)
    if refusal is None and not isinstance(executor, LocalExecutor):
        refusal = f"the disk tier needs a local executor, got {type(executor).__name__}"
    if refusal is not None:
        raise DiskTierError(args.kv_disk_path, refusal)
    return TierPlan(host, *executor.open_disk_store())


def disk_tier_refusal(args: EngineArgs) -> Optional[str]:
    """Why settings alone rule out the disk tier that ``kv_disk_path`` asks for, or None.
    Asked before any process starts: a tier asked for and not given is a startup error."""
    if args.kv_disk_path is None:
        return None
    if args.tensor_parallel_size > 1:
        return (f"tensor_parallel_size is {args.tensor_parallel_size}; the disk tier needs tensor_parallel_size=1 "
                "(a tensor-parallel store would need a file per rank)")
    if args.kv_layout != "paged":
        return f"kv_layout is {args.kv_layout!r}; the disk tier needs kv_layout='paged' (the contiguous baseline caches nothing)"
    return None


def make_executor(args: EngineArgs, **kwargs: Any) -> Executor:
    """One process, or ``args.tensor_parallel_size`` of them."""
    refusal = disk_tier_refusal(args)
    if refusal is not None:
        raise DiskTierError(args.kv_disk_path, refusal)
    if args.tensor_parallel_size > 1:
        from pagedrs.distributed.tp_executor import TPExecutor

        return TPExecutor(args, **kwargs)
    return LocalExecutor(args, **kwargs)
