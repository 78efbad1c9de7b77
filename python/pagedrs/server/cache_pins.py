"""The pinned-prefix admin endpoints (issue 27): ``POST /v1/cache/pin``, ``DELETE /v1/cache/pin/{id}``
and ``GET /v1/cache``, plus ``serve --pin-prefix FILE``'s loader.

A pin prefills a prompt (or chat messages, rendered without a generation prompt) and keeps its
full pages on the device until it is unpinned or its ``ttl_s`` runs out (core/pins.py). The
guard (server/guard.py) gives every ``/v1/cache`` path the admin key, like ``/reset_prefix_cache``.
A pin is salted as a request would be: ``cache_salt`` (and, under ``--prefix-cache-isolation
per-tenant``, the ``tenant`` whose requests it serves), so it is hit by exactly the requests
that would share its pages anyway; a pin no request could hit (a salt every request refuses, a
tenant no API key names) is refused. Errors: 400 for a bad body or prompt (naming the field),
409 past ``--max-pinned-fraction`` (naming the cap and the numbers), 404 for an unknown id.

``--pin-prefix FILE``: JSON lines, one pin each, ``{"prompt": "..."}`` or ``{"messages": [...]}``,
optionally with ``ttl_s``, ``cache_salt`` and ``tenant``; blank lines and lines starting with
``#`` are skipped. A bad line stops the server's start with its line number, the field and the
value; a line is read as strictly as a request body (no key twice in one object).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from pagedrs.core.pins import MAX_TTL_S
from pagedrs.errors import PinCapError, UnknownPinError
from pagedrs.sampling_params import MAX_SCHEMA_DEPTH, json_depth
from pagedrs.server.errors import APIError
from pagedrs.server.field_policy import CHAT_ROLES, name_unknown_fields
from pagedrs.server.json_body import unique_keys
from pagedrs.server.protocol import CacheSalt, Text
from pagedrs.server.serving import ServerContext
from pagedrs.server.tenants import engine_salt

__all__ = ["CacheInfo", "PinRequest", "PinResponse", "cache_info", "load_pin_file", "pin", "preload_pins", "unpin"]


class PinRequest(BaseModel):
    """Strict as the request bodies: a float is finite, an unknown field a 400 naming it and the fields a pin takes."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    prompt: Optional[Union[Text, list[StrictInt]]] = None
    messages: Optional[list[dict[str, Any]]] = None
    ttl_s: Optional[Union[StrictInt, StrictFloat]] = None  # seconds, in (0, 7 days]; null: until unpinned
    cache_salt: Optional[CacheSalt] = None  # as a request's: 1 to 256 bytes (no request could hit another)
    tenant: Optional[Text] = None  # --prefix-cache-isolation per-tenant: the tenant whose requests hit it

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return name_unknown_fields(data, handler, "a pin takes " + ", ".join(cls.model_fields))

    def prompt_or_messages(self) -> Any:
        """The prompt as ``Engine.pin`` takes it; APIError 400 naming the field when not exactly one is set."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "a pin needs exactly one of 'prompt' (text or token ids) and 'messages'",
                           param="prompt" if self.prompt is None else "messages", code="invalid_pin")
        if self.messages is not None:
            if not self.messages:
                raise APIError(400, "messages is empty; it needs at least one message", param="messages")
            depth = json_depth(self.messages)
            if depth > MAX_SCHEMA_DEPTH:  # a chat template renders them: a hostile depth overflowed its stack (a 500)
                raise APIError(400, f"messages nest {depth} or more deep; allowed: at most {MAX_SCHEMA_DEPTH}",
                               param="messages")
            for i, message in enumerate(self.messages):
                _check_message(i, message)
            return self.messages
        return {"prompt_token_ids": self.prompt} if isinstance(self.prompt, list) else self.prompt


def _check_message(i: int, message: dict[str, Any]) -> None:
    """APIError 400 naming ``messages.<i>.role`` or ``.content`` when it is not what a pin renders:
    a chat role, and text (the chat template renders a pin's messages as they are)."""
    role, content = message.get("role", _MISSING), message.get("content", _MISSING)
    if role not in CHAT_ROLES:
        raise APIError(400, f"messages.{i}.role is {_shown(role)}; allowed: one of {', '.join(map(repr, CHAT_ROLES))}",
                       param="messages")
    if not isinstance(content, str):
        raise APIError(400, f"messages.{i}.content is {_shown(content)}; allowed: a string (the text the chat "
                            "template renders)", param="messages")


_MISSING = object()


def _shown(value: Any) -> str:
    """A JSON value as an error names it: ``5, a number``; ``missing`` for a field not sent."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object",
             type(None): "null"}
    return "missing" if value is _MISSING else f"{json.dumps(value)[:40]}, {kinds.get(type(value), 'a value')}"


class PinResponse(BaseModel):
    object: Literal["cache.pin"] = "cache.pin"
    id: str
    num_tokens: int  # leading prompt tokens whose pages are pinned (whole pages)
    num_pages: int
    ttl_s: Optional[float]
    expires_at: Optional[float]  # unix seconds; null: no TTL


class PinDeleted(BaseModel):
    object: Literal["cache.pin.deleted"] = "cache.pin.deleted"
    id: str
    deleted: bool = True


class PinEntry(BaseModel):
    id: str
    num_tokens: int
    num_pages: int
    ttl_s: Optional[float]
    ttl_left_s: Optional[float]  # null: no TTL


class TierPages(BaseModel):
    device: int
    host: int
    disk: int


class CacheInfo(BaseModel):
    object: Literal["cache"] = "cache"
    pins: list[PinEntry]
    pinned_pages: int  # distinct device pages the pins hold
    max_pinned_pages: int  # the cap: --max-pinned-fraction of the device pool
    cached_pages: TierPages  # prefix-cache pages each tier holds now
    total_pages: TierPages  # each tier's size
    hit_rate: float  # prefix-cache hits over lookups (blocks), since start


def _salt(ctx: ServerContext, body: PinRequest) -> Optional[str]:
    check_tenant_applies(ctx.prefix_cache_isolation, body.tenant, ctx.tenants)
    try:
        return engine_salt(ctx.prefix_cache_isolation, body.tenant, body.cache_salt)
    except ValueError as exc:
        raise APIError(400, f"{exc}: name it with the pin's 'tenant' field", param="tenant") from None


def check_tenant_applies(isolation: str, tenant: Optional[str], tenants: Collection[str] = ()) -> None:
    """A pin's ``tenant`` means something only under ``--prefix-cache-isolation per-tenant``; under
    ``shared`` it was accepted and changed nothing (alice's and bob's pins shared their pages, and a
    request of no tenant hit them): refused instead, naming the flag that gives it a meaning. A tenant
    that no API key names (``tenants``, when the server knows them) is refused too: no request could
    ever hit its pin, which would only use up the pin cap."""
    if tenant is not None and isolation != "per-tenant":
        raise APIError(400, f"tenant is {tenant!r}, but the server runs --prefix-cache-isolation {isolation}, where "
                            "every tenant shares the prefix cache and a pin's tenant changes nothing; pin without it "
                            "(or use cache_salt), or start the server with --prefix-cache-isolation per-tenant",
                       param="tenant")
    if tenant is not None and tenants and tenant not in tenants:
        raise APIError(400, f"tenant is {tenant!r}, which no API key of this server belongs to, so no request could "
                            f"hit the pin; allowed: {', '.join(sorted(tenants))} (--api-key-file; --api-key is "
                            "tenant 'default')", param="tenant")


async def pin(ctx: ServerContext, body: PinRequest) -> PinResponse:
    prompt, salt = body.prompt_or_messages(), _salt(ctx, body)
    metrics = ctx.engine_loop.metrics

    def run(engine: Any) -> tuple[Any, dict[str, Any]]:
        return engine.pin(prompt, body.ttl_s, salt), engine.stats()

    try:
        state, stats = await ctx.engine_loop.call(run)
    except PinCapError as exc:
        metrics.pins.labels(outcome="refused_cap").inc()
        raise APIError(409, str(exc), param="prompt", code="pin_cap_exceeded") from None
    except ValueError as exc:
        metrics.pins.labels(outcome="invalid").inc()
        raise APIError(400, str(exc), param="ttl_s" if "ttl_s" in str(exc) else "prompt", code="invalid_pin") from None
    metrics.pins.labels(outcome="pinned").inc()
    metrics.update_from_stats(stats)
    expires_at = None if state.expires_in_s is None else time.time() + state.expires_in_s
    return PinResponse(id=state.pin_id, num_tokens=state.num_tokens, num_pages=state.num_pages, ttl_s=state.ttl_s,
                       expires_at=expires_at)


async def unpin(ctx: ServerContext, pin_id: str) -> PinDeleted:
    def run(engine: Any) -> dict[str, Any]:
        engine.unpin(pin_id)
        return dict(engine.stats())

    try:
        stats = await ctx.engine_loop.call(run)
    except UnknownPinError as exc:
        raise APIError(404, str(exc), param="id", code="pin_not_found") from None
    ctx.engine_loop.metrics.pins.labels(outcome="unpinned").inc()
    ctx.engine_loop.metrics.update_from_stats(stats)
    return PinDeleted(id=pin_id)


async def cache_info(ctx: ServerContext) -> CacheInfo:
    def run(engine: Any) -> tuple[list[Any], dict[str, Any]]:
        return engine.list_pins(), dict(engine.stats())

    pins, s = await ctx.engine_loop.call(run)
    fraction = float(getattr(getattr(ctx.engine_loop.engine, "args", None), "max_pinned_fraction", 0.25))
    return CacheInfo(
        pins=[PinEntry(id=p.pin_id, num_tokens=p.num_tokens, num_pages=p.num_pages, ttl_s=p.ttl_s,
                       ttl_left_s=p.expires_in_s) for p in pins],
        pinned_pages=int(s.get("num_pinned_blocks", 0)),
        max_pinned_pages=int(fraction * int(s.get("num_gpu_blocks", 0))),
        cached_pages=TierPages(device=int(s.get("num_cached_gpu_blocks", 0)), host=int(s.get("num_cached_cpu_blocks", 0)),
                               disk=int(s.get("num_cached_disk_blocks", 0))),
        total_pages=TierPages(device=int(s.get("num_gpu_blocks", 0)), host=int(s.get("num_cpu_blocks", 0)),
                              disk=int(s.get("num_disk_blocks", 0))),
        hit_rate=float(s.get("prefix_hit_rate", 0.0)),
    )


def load_pin_file(path: str) -> list[tuple[int, PinRequest]]:
    """``--pin-prefix FILE``'s pins with their line numbers, validated; ValueError naming the file,
    the line and what is wrong. A UTF-8 byte order mark at the start (what Windows editors write) is
    the encoding's mark, not the first line's text: read past (it made line 1 invalid JSON)."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--pin-prefix {path}: cannot read it: {exc}") from None
    pins: list[tuple[int, PinRequest]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            fields = json.loads(line, object_pairs_hook=unique_keys("the line"), parse_float=_Overflow.or_float)
            _refuse_overflow(fields, "")
            request = PinRequest.model_validate(fields)
            if (request.prompt is None) == (request.messages is None):
                raise ValueError("it needs exactly one of 'prompt' and 'messages'")
            request.prompt_or_messages()  # the messages' roles and contents
        except APIError as exc:
            raise ValueError(f"--pin-prefix {path}, line {number}: {exc.message}") from None
        except RecursionError:
            raise ValueError(f"--pin-prefix {path}, line {number}: it nests arrays or objects deeper than this "
                             "server parses (about 1000 levels)") from None
        except (json.JSONDecodeError, ValidationError, ValueError) as exc:
            detail = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else _first_error(exc)
            raise ValueError(f"--pin-prefix {path}, line {number}: {detail} (each line is a JSON object "
                             '{"prompt": "..."} or {"messages": [...]}, optionally with ttl_s and cache_salt)') from None
        pins.append((number, request))
    return pins


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()  # a union (ttl_s: int or float) fails once per member: the one about the value, first
    err = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err.get('msg')}"


class _Overflow:
    """A JSON number too large for a float (``1e400``), kept as written: json.loads made it infinity,
    which pydantic then refused as "not a valid integer", naming neither the value nor the cause."""

    def __init__(self, text: str) -> None:
        self.text = text

    @classmethod
    def or_float(cls, text: str) -> float | _Overflow:
        value = float(text)
        return value if math.isfinite(value) else cls(text)


def _refuse_overflow(value: Any, where: str) -> None:
    """ValueError naming the field and the number of the first ``_Overflow`` in a parsed line."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        field = f"{where}.{key}" if where else str(key)
        if isinstance(item, _Overflow):
            raise ValueError(f"{field} is {item.text[:40]}, a number too large (it reads as infinity); "
                             + (f"allowed: seconds in (0, {MAX_TTL_S:g}], or null for no TTL" if field == "ttl_s"
                                else "allowed: a finite number"))
        _refuse_overflow(item, field)


def preload_pins(engine: Any, path: str, isolation: str, tenants: Collection[str] = ()) -> list[str]:
    """Pins every line of ``--pin-prefix FILE`` on ``engine`` before the server starts; the ids.
    A bad line, or a pin the engine refuses, stops the start: ValueError naming the line.
    ``tenants``: the tenants the API keys name (a pin for any other is refused; empty: unchecked)."""
    ids = []
    for number, request in load_pin_file(path):
        try:
            check_tenant_applies(isolation, request.tenant, tenants)
            salt = engine_salt(isolation, request.tenant, request.cache_salt)
            ids.append(engine.pin_prefix(request.prompt_or_messages(), request.ttl_s, salt))
        except (ValueError, PinCapError, APIError) as exc:
            raise ValueError(f"--pin-prefix {path}, line {number}: the pin was refused: {exc}") from None
    return ids
