"""EngineStats: the engine's counters as typed fields, so a renamed counter fails loudly.

``Engine.stats()`` keeps returning a dict (``EngineStats.as_dict()``) for callers that
index by name, tests outside this repository among them; code inside pagedrs reads the
fields of ``Engine.typed_stats()``. Core counters come from ``Scheduler.core_stats()`` (the
Rust core's typed, frozen ``CoreStats``) by the same names: a counter the core stops
providing raises ``AttributeError`` here instead of making a metric vanish, and a field
that is neither the core's nor given by the engine is a ``TypeError`` naming it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedrs._core import CoreStats


@dataclass(frozen=True)
class EngineStats:
    # KV pool (blocks)
    num_gpu_blocks: int
    num_free_gpu_blocks: int  # allocatable now, evictable cached blocks included
    num_used_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_pinned_host_blocks: int  # host pages held by copies not yet completed
    num_pins: int  # live pinned prefixes (LLM.pin_prefix)
    num_pinned_blocks: int  # distinct device pages they hold: never evicted while pinned
    num_host_cache_blocks: int  # of num_cpu_blocks, those added for evicted prefix pages
    num_disk_blocks: int  # page slots of the persistent disk tier (0 = off)
    num_cached_gpu_blocks: int  # pages the prefix cache holds on each tier now
    num_cached_cpu_blocks: int
    num_cached_disk_blocks: int
    block_size: int
    kv_bytes_per_block: int
    kv_layout: str
    eviction_policy: str  # "lru" | "lfu": which cached page each tier gives up first (EngineArgs.eviction_policy)
    # requests and sequences
    num_running: int
    num_waiting: int
    num_swapped: int
    peak_running: int
    num_unfinished_requests: int
    # scheduler counters (cumulative)
    num_steps: int
    num_preemptions: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_deferred_forks: int  # n > 1 children that waited for a contiguous region, then were prefilled
    num_failed_steps: int  # steps reported failed: nothing they wrote was cached, their sequences recomputed or ended
    disk_pages_invalidated: int  # disk-tier pages dropped because their write or read failed
    num_prompt_tokens_computed: int
    num_cached_prompt_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    # speculative decoding (core/spec_step.py; zeros when off): drafts verified, drafts accepted,
    # (sequence, step) verifications, accepted / proposed, accepted drafts per verification
    spec_proposed: int
    spec_accepted: int
    spec_verifications: int
    spec_acceptance_rate: float
    spec_mean_accepted_length: float
    # block manager counters (cumulative, in blocks)
    prefix_queries: int
    prefix_hits: int
    host_cache_hits: int
    prefix_hits_device: int  # prefix_hits by the tier that served them
    prefix_hits_host: int
    # counted at lookup: a disk page that then fails its check (and is recomputed) is a hit here and a
    # disk_pages_invalidated too; served from disk = prefix_hits_disk - those lost at read
    prefix_hits_disk: int
    prefix_misses_never_seen: int  # prefix_queries - prefix_hits, by reason
    prefix_misses_evicted: int  # evicted from device and host
    prefix_misses_evicted_disk: int
    prefix_misses_invalidated: int  # the disk store had it but was for another model / dtype / geometry
    host_cache_saves: int  # evicted device pages kept on the host
    disk_writes: int  # pages written to the disk tier
    kv_events_published: int  # KV events (BlockStored / BlockRemoved / AllBlocksCleared) sent to routers
    evictions: int
    cow_copies: int
    swap_out_blocks: int
    swap_in_blocks: int
    # preemption traffic: pages the scheduler's swap-outs / swap-ins copied (page-granular
    # preemption moves only the pages a step needs), and those pages in bytes
    num_pages_swapped_out: int
    num_pages_swapped_in: int
    swap_bytes_out: int
    swap_bytes_in: int
    step_pages_swapped_out: int  # in the last step only
    step_pages_swapped_in: int
    step_swap_bytes_out: int
    step_swap_bytes_in: int
    window_released_blocks: int  # pages given back because they fell out of the sliding window
    # utilization now
    kv_reserved_slots: int
    kv_live_slots: int
    kv_utilization: float
    kv_waste_pct: float
    prefix_hit_rate: float
    kv_bytes_to_host: int  # swap-outs + evicted pages saved to the host
    kv_bytes_from_host: int  # swap-ins + host prefix hits
    kv_bytes_to_disk: int
    kv_bytes_from_disk: int
    # memory of this process (rank 0 under tensor parallelism), bytes
    memory_weights_bytes: int  # model weights (this rank's shard): parameters, buffers, GGUF matrices and tables
    memory_kv_pool_bytes: int  # the device KV pool
    memory_host_pool_bytes: int  # the host tier: swap space and evicted prefix pages
    memory_rss_bytes: int  # resident set of the process now (0 where /proc is missing)

    @classmethod
    def build(cls, core: CoreStats, **engine: Any) -> EngineStats:
        """From ``Scheduler.core_stats()`` plus the engine's own fields; both must be complete."""
        reserved, live = core.reserved_slots, core.live_slots
        utilization = live / reserved if reserved else 1.0
        derived = dict(
            kv_reserved_slots=reserved,
            kv_live_slots=live,
            kv_utilization=utilization,
            kv_waste_pct=100.0 * (1.0 - utilization),
            prefix_hit_rate=(core.prefix_hits / core.prefix_queries) if core.prefix_queries else 0.0,
        )
        per_block = int(engine["kv_bytes_per_block"])
        derived.update(
            kv_bytes_to_host=per_block * (core.swap_out_blocks + core.host_cache_saves),
            kv_bytes_from_host=per_block * (core.swap_in_blocks + core.prefix_hits_host),
            kv_bytes_to_disk=per_block * core.disk_writes,
            kv_bytes_from_disk=per_block * core.prefix_hits_disk,
            swap_bytes_out=per_block * core.num_pages_swapped_out,
            swap_bytes_in=per_block * core.num_pages_swapped_in,
            step_swap_bytes_out=per_block * core.step_pages_swapped_out,
            step_swap_bytes_in=per_block * core.step_pages_swapped_in,
        )
        values = {**derived, **engine}
        core_fields = set(type(core).fields)
        for f in fields(cls):
            if f.name in values:
                continue
            if f.name not in core_fields:
                raise TypeError(f"EngineStats.build: {f.name!r} is neither a CoreStats field nor given by the engine")
            values[f.name] = getattr(core, f.name)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
