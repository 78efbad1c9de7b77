"""The core's ``EngineStats`` snapshot (``core_stats``): the scheduler's counters with the core's own,
speculative decoding's, and the memory the process holds.

Apart from engine_core.py because none of it runs a step or changes a request: it only reads the core,
the executor and /proc, and what it gathers (and where it is 0 when a source is missing) is one place
to look when a metric looks wrong.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from pagedrs.stats import EngineStats

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore
    from pagedrs.core.spec_step import Speculator


def core_stats(core: EngineCore) -> EngineStats:
    """``EngineCore.stats``: one snapshot, taken between steps."""
    memory = core.executor.memory_bytes()
    return EngineStats.build(
        core.scheduler.core_stats(),
        num_cpu_blocks=core.scheduler_config.num_cpu_blocks,
        kv_layout=core.args.kv_layout,
        eviction_policy=core.args.eviction_policy,
        block_size=core.args.block_size,
        num_generated_tokens=core.num_generated,
        peak_running=core.peak_running,
        kv_bytes_per_block=core.kv_plan.bytes_per_block,
        num_host_cache_blocks=core.num_host_cache_blocks,
        num_unfinished_requests=len(core.requests),
        memory_weights_bytes=memory["weights"],
        memory_kv_pool_bytes=memory["kv_pool"],
        memory_host_pool_bytes=memory["host_pool"],
        memory_rss_bytes=_rss_bytes(),
        **_spec_stats(core.speculator),
    )

def _spec_stats(speculator: Optional[Speculator]) -> dict[str, Any]:
    """Speculative decoding's counters (zeros when it is off)."""
    proposed, accepted, verified = (0, 0, 0) if speculator is None else (
        speculator.proposed, speculator.accepted, speculator.verifications)
    return dict(spec_proposed=proposed, spec_accepted=accepted, spec_verifications=verified,
                spec_acceptance_rate=accepted / proposed if proposed else 0.0,
                spec_mean_accepted_length=accepted / verified if verified else 0.0)


def _rss_bytes() -> int:
    """Resident set size of this process from /proc/self/statm (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
