"""The prefix cache as its users ask for it, at the engine core: what a request's admission
found cached on each tier, and a reset that clears every tier, the disk store's records too.

Both run on the core's own thread (the in-process client calls them between steps; the core
process applies ``ResetPrefixCache`` between steps), so no step sees a half-cleared cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pagedrs.core.protocol import CacheReset
from pagedrs.errors import PrefixCacheBusyError

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore
    from pagedrs.core.request import Request

TIERS = ("device", "host", "disk")  # the keys of cached_tokens_by_tier, in the core's order


def cached_tokens_by_tier(scheduler: Any, seq_id: int) -> Optional[dict[str, int]]:
    """``{"device", "host", "disk"}``: the prompt tokens the sequence's admission found on each
    tier (a host or disk hit was copied back to the device); None before its admission."""
    split = scheduler.num_cached_tokens_by_tier_of(seq_id)
    return None if split is None else dict(zip(TIERS, (int(n) for n in split)))


def recount_cached_tokens(scheduler: Any, request: Request, seq_id: int, cached: int) -> None:
    """A request re-admitted after a reset found ``cached`` prompt tokens (where its first step starts).
    The core's split is of this admission, but it answers only while the total equals the first
    admission's; otherwise the split is unknown (None), never the pages that were thrown away."""
    split = cached_tokens_by_tier(scheduler, seq_id)
    if split is None or sum(split.values()) != cached:
        split = dict.fromkeys(TIERS, 0) if cached == 0 else None
    request.num_cached_tokens, request.cached_tokens_by_tier = cached, split
    request.recount_cached = False


def answer_reset(core: EngineCore) -> CacheReset:
    """Clears every tier, or says why not (requests in the engine): what the core process sends back."""
    if core.has_unfinished():
        return CacheReset(0, 0, 0, refused=(
            f"cannot reset the prefix cache while {len(core.requests)} request(s) are in the engine "
            "(their pages are in use); retry once they finish, or abort them"))
    try:
        device, host, disk = core.scheduler.reset_prefix_cache()
    except ValueError as exc:  # a step or a copy still in flight: the core's own refusal
        return CacheReset(0, 0, 0, refused=str(exc))
    core.kv_events.publish(core.scheduler)  # AllBlocksCleared now, not at the next request's step
    store = core.executor.disk_tier()
    if store is not None:
        store.erase_pages()  # or the next start would seed the dropped pages back from the file
    return CacheReset(int(device), int(host), int(disk))


def reset_prefix_cache(core: EngineCore) -> CacheReset:
    """``answer_reset``, raising ``PrefixCacheBusyError`` when it refused."""
    answer = answer_reset(core)
    if answer.refused is not None:
        raise PrefixCacheBusyError(answer.refused)
    return answer
