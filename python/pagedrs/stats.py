"""EngineStats: the engine's counters as typed fields, so a renamed counter fails loudly.

``Engine.stats()`` keeps returning a dict (``EngineStats.as_dict()``) for callers that
index by name, tests outside this repository among them; code inside pagedrs reads the
fields of ``Engine.typed_stats()``. Core counters come from ``Scheduler.stats()`` by the
same names; a key the core stops providing raises ``KeyError`` here instead of making a
metric vanish.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class EngineStats:
    # KV pool (blocks)
    num_gpu_blocks: int
    num_free_gpu_blocks: int  # allocatable now, evictable cached blocks included
    num_used_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_pinned_host_blocks: int  # host pages held by copies not yet completed
    block_size: int
    kv_bytes_per_block: int
    kv_layout: str
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
    num_prompt_tokens_computed: int
    num_cached_prompt_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    # block manager counters (cumulative, in blocks)
    prefix_queries: int
    prefix_hits: int
    host_cache_hits: int
    evictions: int
    cow_copies: int
    swap_out_blocks: int
    swap_in_blocks: int
    # utilization now
    kv_reserved_slots: int
    kv_live_slots: int
    kv_utilization: float
    kv_waste_pct: float
    prefix_hit_rate: float

    @classmethod
    def build(cls, core: Mapping[str, Any], **engine: Any) -> EngineStats:
        """From ``Scheduler.stats()`` plus the engine's own fields; both must be complete."""
        reserved, live = int(core["reserved_slots"]), int(core["live_slots"])
        utilization = live / reserved if reserved else 1.0
        derived = dict(
            kv_reserved_slots=reserved,
            kv_live_slots=live,
            kv_utilization=utilization,
            kv_waste_pct=100.0 * (1.0 - utilization),
            prefix_hit_rate=(core["prefix_hits"] / core["prefix_queries"]) if core["prefix_queries"] else 0.0,
        )
        values = {**derived, **engine}
        for f in fields(cls):
            if f.name not in values:
                values[f.name] = core[f.name]
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
