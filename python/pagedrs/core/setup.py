"""What the engine core is built from: the executor, the KV plan and its tiers (host cache,
disk store), the SchedulerConfig and the Scheduler; and how it is released."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedrs._core import Scheduler, SchedulerConfig
from pagedrs.attention import AttentionBackend
from pagedrs.core.kv_events import KvEvents, NoKvEvents, make_kv_events
from pagedrs.engine_args import EngineArgs
from pagedrs.executor import Executor, make_executor, plan_tiers
from pagedrs.executor.base import DiskTierHandle
from pagedrs.memory import KvPlan
from pagedrs.models.config import ModelConfig
from pagedrs.step_input import transfers_from

logger = logging.getLogger("pagedrs.engine")


@dataclass
class CoreParts:
    executor: Executor
    max_model_len: int
    kv_plan: KvPlan
    num_host_cache_blocks: int
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    closer: weakref.finalize  # releases the executor (flushing the disk tier first): once
    kv_events: KvEvents  # the routers' event publisher (core/kv_events.py), closed by the closer


def warn_verify_numerics(args: EngineArgs) -> None:
    """Speculative decoding on the CPU at more than one thread: said at start, since exactness is the
    point of it. A verification's rows are bit-equal to sequential decode's only at one torch thread
    (``attention/torch_backend._attend_rowwise``): at more, torch's CPU attention gives a row that a
    worker thread computes other low bits than the calling thread's, so a tie between two logits
    (common with bf16 weights) can pick another token than decoding without speculation would."""
    if args.speculative_config is None or not str(args.device).startswith("cpu"):
        return
    threads = args.resolved_cpu_threads()
    if threads > 1:
        logger.warning("speculative decoding on the CPU with cpu_threads=%d: its greedy output equals decoding "
                       "without speculation bit for bit only at cpu_threads=1 (torch's CPU attention gives rows on "
                       "its worker threads other low bits), so at an exact tie between two logits it can pick "
                       "another token", threads)


def build_core(owner: object, args: EngineArgs, attention_backend: AttentionBackend | None) -> CoreParts:
    """Builds the executor, plans the KV pools and tiers, and builds the scheduler.

    What the executor holds (tensor-parallel workers and the process group, a disk store) is
    released on shutdown, on garbage collection of ``owner`` or at interpreter exit, whichever
    comes first. The finalizer holds the executor, never ``owner``.
    """
    torch.manual_seed(args.seed)
    warn_verify_numerics(args)
    executor = make_executor(args, attention_backend=attention_backend)
    closer = weakref.finalize(owner, executor.shutdown)
    config = executor.loaded.config
    try:
        max_model_len = resolve_max_model_len(args, config)
    except ValueError:
        closer()  # the executor goes now, not when the half-built owner is collected
        raise
    plan = executor.plan_kv_memory()
    tiers = plan_tiers(executor, args, plan)
    scheduler_config = SchedulerConfig(
        num_gpu_blocks=plan.num_gpu_blocks,
        block_size=args.block_size,
        num_cpu_blocks=plan.num_cpu_blocks + tiers.host_cache_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_layout=args.kv_layout,
        contiguous_reserve=args.contiguous_reserve,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption_mode=args.preemption_mode,
        watermark=args.watermark,
        aging_steps=args.aging_steps,
        admission_policy=args.admission_policy,
        prefill_first=args.prefill_first,
        swap_cost_per_block=plan.swap_cost_per_block,
        recompute_cost_per_token=plan.recompute_cost_per_token,
        host_cache_evicted=args.host_cache_evicted or tiers.host_cache_blocks > 0,
        num_disk_blocks=tiers.disk_blocks,
        sliding_window=_uniform_sliding_window(config) if args.kv_layout == "paged" else None,
        eviction_policy=args.eviction_policy,
    )
    scheduler = Scheduler(scheduler_config)
    disk = executor.disk_tier()
    if disk is not None:
        seed = disk.seed
        scheduler.seed_disk(seed.slots, seed.hashes, seed.parents, seed.tokens, seed.invalidated)
        # A clean shutdown also flushes the cached pages to disk first.
        closer.detach()
        closer = weakref.finalize(owner, functools.partial(_flush_and_close, scheduler, executor, disk))
    # The layout's rules decide the host pool (none for the contiguous baseline).
    executor.init_kv_cache(scheduler_config.num_gpu_blocks, scheduler_config.num_cpu_blocks)
    kv_events = make_kv_events(args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_buffer_steps, scheduler)
    if not isinstance(kv_events, NoKvEvents):  # closed before the executor: its last batch is sent
        detached = closer.detach()
        assert detached is not None, "the closer was made above and has not run"
        _, release, release_args, _ = detached
        closer = weakref.finalize(owner, functools.partial(_close_all, kv_events, functools.partial(release, *release_args)))
    return CoreParts(executor, max_model_len, plan, tiers.host_cache_blocks, scheduler_config, scheduler, closer, kv_events)


def _close_all(kv_events: KvEvents, release: Callable[[], None]) -> None:
    """The publisher first (it sends what is queued), then the executor (and the disk tier)."""
    try:
        kv_events.close()
    finally:
        release()


def _flush_and_close(scheduler: Scheduler, executor: Executor, disk: DiskTierHandle) -> None:
    """Clean shutdown of the disk tier: every cached page the disk lacks goes to it, then
    the store is made durable and closed (by the executor's shutdown). Takes no core, so it
    can run at collection."""
    try:
        transfers = list(transfers_from(scheduler.flush_to_disk(), scheduler.disk_pages))
        disk.run_transfers(transfers)
        scheduler.complete_transfers([t.id for t in transfers])
    finally:
        executor.shutdown()


def _uniform_sliding_window(config: ModelConfig) -> int | None:
    """The window the core may release pages outside of: only when every layer attends with
    it. A model mixing full and windowed layers (Gemma 2, Qwen2's max_window_layers) keeps
    every page, since its full layers read them all."""
    windows = {config.layer_sliding_window(layer) for layer in range(config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else None


LONG_MAX_MODEL_LEN_ENV = "PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(args: EngineArgs, config: ModelConfig) -> int:
    """``args.max_model_len``, or the model's context length when unset.

    A length past the model's context length is refused unless the user says so
    (``allow_long_max_model_len``, or ``PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN=1``, vLLM's rule): the model
    never trained on those positions, so its outputs there may be wrong with nothing to show it.
    Allowed, it is said once in the log (transformers computes those positions the same way)."""
    context = config.context_length
    max_model_len = args.max_model_len or context
    if max_model_len <= context:
        return max_model_len
    if not (args.allow_long_max_model_len or os.environ.get(LONG_MAX_MODEL_LEN_ENV, "") in ("1", "true", "True")):
        raise ValueError(
            f"max_model_len is {max_model_len}; the model's context length is {context} "
            f"(config max_position_embeddings={config.max_position_embeddings}), so allowed: 1 to {context}. "
            f"Positions past it were never trained and may give wrong outputs; to run there anyway, set "
            f"allow_long_max_model_len=True (--allow-long-max-model-len) or {LONG_MAX_MODEL_LEN_ENV}=1")
    logger.warning("max_model_len=%d is past the model's context length %d (max_position_embeddings=%d): "
                   "positions past %d were not trained, and outputs there may degrade", max_model_len, context,
                   config.max_position_embeddings, context)
    return max_model_len
