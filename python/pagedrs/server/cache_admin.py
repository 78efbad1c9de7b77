"""The prefix cache's admin endpoints: ``POST /reset_prefix_cache`` (vLLM's path).

A reset forgets every cached page on the device, host and disk tiers, and erases the disk
store's records so a restart cannot bring them back (vLLM issue 57727: its CPU tier kept
serving hits after a reset). It runs on the engine thread between two steps. Like vLLM's
reset, which fails while blocks are in use, it is refused while requests are in the engine:
a 409 naming them, nothing cleared; the caller retries once they finished. The guard
(server/guard.py) lets only the admin key through (any tenant's key when no admin key is
set; never no key at all).

It takes no body, and of vLLM's query parameters only the values that ask for what it does:
``reset_running_requests=false`` (vLLM's default: fail while blocks are in use, as here) and
``reset_external=true`` (clear the offloaded tiers too: the host and disk tiers always are).
Any other field or value, in the query or a body, is a 400 naming it and what is allowed: a
reset never does less, or more, than its caller asked without saying so.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel

from pagedrs.errors import PrefixCacheBusyError
from pagedrs.server.errors import APIError, bad_request
from pagedrs.server.json_body import parse
from pagedrs.server.serving import ServerContext

__all__ = ["PrefixCacheResetResponse", "reset_prefix_cache"]


class DroppedPages(BaseModel):
    device: int
    host: int
    disk: int


class PrefixCacheResetResponse(BaseModel):
    object: Literal["prefix_cache_reset"] = "prefix_cache_reset"
    dropped_pages: DroppedPages  # cached pages each tier forgot


# vLLM's query parameters -> the one value that asks for what this reset does, and why no other is honoured
QUERY_FIELDS: dict[str, tuple[str, str]] = {
    "reset_running_requests": ("false", "a reset is refused (409) while requests are in the engine, never "
                                        "preempts them; retry once they finished"),
    "reset_external": ("true", "a reset always clears the host and disk tiers (vLLM's external caches) too"),
}
ALLOWED = "; ".join(f"{name}={value}" for name, (value, _) in QUERY_FIELDS.items())
# a query boolean as vLLM's FastAPI (pydantic) reads it
_BOOLS = {**dict.fromkeys(("true", "1", "yes", "on", "t", "y"), "true"),
          **dict.fromkeys(("false", "0", "no", "off", "f", "n"), "false")}


async def check_reset_request(request: Request) -> None:
    """APIError 400 naming a query field, or body, that asks for other than what the reset does."""
    seen: set[str] = set()
    for name, value in request.query_params.multi_items():
        if name not in QUERY_FIELDS:
            raise bad_request(f"{name!r} is not a query parameter of /reset_prefix_cache, which clears the cached "
                              f"pages of every tier (device, host, disk); allowed: {ALLOWED} (or none)", param=name)
        if name in seen:
            raise bad_request(f"{name} is given twice in the query; give it once", param=name)
        seen.add(name)
        honoured, why = QUERY_FIELDS[name]
        if _BOOLS.get(value.lower()) != honoured:
            raise bad_request(f"{name}={value[:40]!r} is not supported: {why}; allowed: {name}={honoured} "
                              "(or leave it out)", param=name)
    body = await request.body()
    if body.strip():
        fields = parse(body)  # a 400 naming what is wrong when it is not JSON
        if fields != {}:
            named = ", ".join(map(str, fields)) if isinstance(fields, dict) else json.dumps(fields)[:40]
            raise bad_request(f"/reset_prefix_cache takes no body (got {named}); it clears the cached pages of "
                              f"every tier (device, host, disk); its options are query parameters: {ALLOWED}",
                              param=next(iter(fields)) if isinstance(fields, dict) else None)


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
