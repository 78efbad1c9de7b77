"""The prefix cache's admin endpoints: ``POST /reset_prefix_cache`` (vLLM's path).

A reset forgets every cached page on the device, host and disk tiers, and erases the disk
store's records so a restart cannot bring them back (vLLM issue 57727: its CPU tier kept
serving hits after a reset). It runs on the engine thread between two steps. Like vLLM's
reset, which fails while blocks are in use, it is refused while requests are in the engine:
a 409 naming them, nothing cleared; the caller retries once they finished. The guard
(server/guard.py) lets only the admin key through (any tenant's key when no admin key is
set; never no key at all).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from pagedrs.errors import PrefixCacheBusyError
from pagedrs.server.errors import APIError
from pagedrs.server.serving import ServerContext

__all__ = ["PrefixCacheResetResponse", "reset_prefix_cache"]


class DroppedPages(BaseModel):
    device: int
    host: int
    disk: int


class PrefixCacheResetResponse(BaseModel):
    object: Literal["prefix_cache_reset"] = "prefix_cache_reset"
    dropped_pages: DroppedPages  # cached pages each tier forgot


def _reset(engine: Any) -> Any:
    return engine.reset_prefix_cache()


async def reset_prefix_cache(ctx: ServerContext) -> PrefixCacheResetResponse:
    metrics = ctx.engine_loop.metrics
    try:
        report = await ctx.engine_loop.call(_reset)
    except PrefixCacheBusyError as exc:
        metrics.prefix_cache_resets.labels(outcome="refused").inc()
        raise APIError(409, str(exc), code="prefix_cache_busy") from None
    metrics.prefix_cache_resets.labels(outcome="done").inc()
    return PrefixCacheResetResponse(dropped_pages=DroppedPages(device=report.device, host=report.host, disk=report.disk))
