"""The server's limits and access settings, in one value that the CLI fills and the app reads.

Each limit bounds one resource a client could otherwise exhaust; docs/limits_and_safety.md
lists them with their defaults and what a client gets past them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_TOKENIZER_THREADS = 1
# Silence after which /health calls the engine core unresponsive. Its heartbeat comes from a
# thread, so a long step (a CPU prefill of a long prompt) never trips it; 30 s leaves room for
# a GC pause or a kernel compile holding the GIL.
DEFAULT_CORE_TIMEOUT_S = 30.0
# A text prompt longer than max_model_len x this many characters cannot fit whatever it
# tokenizes to, unless one token covers more characters: the factor used is the larger of
# this and 4 x the longest vocabulary entry (see PromptTokenizer.max_chars).
MIN_CHARS_PER_TOKEN_BOUND = 64
# Sequences one request may add (prompts x max(n, best_of); beam search: x its width): the
# engine's default max_num_seqs, so one request can fill a batch but not queue many batches.
DEFAULT_MAX_SEQS_PER_REQUEST = 256
PREFIX_CACHE_ISOLATION = ("shared", "per-tenant")
DEFAULT_TENANT = "default"  # the tenant of --api-key


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # when set, /v1/* (and /metrics) need `Authorization: Bearer <key>`
    metrics_public: bool = False  # /metrics without the key
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # request bodies beyond get 413
    # A connection has this long to send a complete request head (from opening, or from the end
    # of its previous response), and a request this long to send its whole body; then 408 / close.
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # drain deadline after SIGTERM / SIGINT
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS  # worker threads that tokenize prompts
    # `pagedrs serve` hands these two to its RemoteEngine and EngineLoop (an embedding program passes them itself):
    core_timeout_s: float = DEFAULT_CORE_TIMEOUT_S  # engine core silent this long: /health says 503
    request_timeout_s: float | None = None  # no finished output by then: 504 (None: no limit, as in vLLM)
    # key -> tenant (--api-key-file; --api-key is tenant "default"): any of them opens /v1/*
    api_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    admin_api_key: str | None = None  # when set, admin endpoints (/metrics) take this key and no other
    # "per-tenant": requests share cached prefix pages only within their tenant (the cache_salt)
    prefix_cache_isolation: str = "shared"
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST  # past it a request gets 400
    # how tool_choice "auto" reads answers: a name of tool_parsers.PARSERS (None: "auto" is a 400)
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        checks = [
            ("max_request_bytes", self.max_request_bytes, self.max_request_bytes >= 1024, ">= 1024"),
            ("read_timeout_s", self.read_timeout_s, self.read_timeout_s > 0, "> 0"),
            ("shutdown_timeout_s", self.shutdown_timeout_s, self.shutdown_timeout_s >= 0, ">= 0"),
            ("tokenizer_threads", self.tokenizer_threads, self.tokenizer_threads >= 1, ">= 1"),
            ("max_seqs_per_request", self.max_seqs_per_request, self.max_seqs_per_request >= 1, ">= 1"),
            ("prefix_cache_isolation", self.prefix_cache_isolation,
             self.prefix_cache_isolation in PREFIX_CACHE_ISOLATION, " or ".join(PREFIX_CACHE_ISOLATION)),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"ServerOptions.{name}={value!r} is out of range: allowed {allowed}")
        _check_tool_call_parser(self.tool_call_parser)
        _check_seconds("--core-timeout", "core_timeout_s", self.core_timeout_s, none_ok=False)
        _check_seconds("--request-timeout", "request_timeout_s", self.request_timeout_s, none_ok=True)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ServerOptions.api_key is empty: pass a non-empty key, or None for no authentication")
        if self.admin_api_key is not None and not self.admin_api_key.strip():
            raise ValueError("ServerOptions.admin_api_key is empty: pass a non-empty key, or None for no admin key")
        if self.admin_api_key is not None and self.admin_api_key in self.tenants():
            raise ValueError("ServerOptions.admin_api_key is also a tenant's API key: give the admin its own key")
        if self.prefix_cache_isolation == "per-tenant" and not self.tenants():
            raise ValueError("ServerOptions.prefix_cache_isolation='per-tenant' needs API keys to tell tenants "
                             "apart: pass --api-key-file (or --api-key)")

    def tenants(self) -> dict[str, str]:
        """Every accepted API key and its tenant: ``api_keys``, plus ``api_key`` as tenant "default"."""
        keys = dict(self.api_keys)
        if self.api_key is not None:
            keys.setdefault(self.api_key, DEFAULT_TENANT)
        return keys


def _check_tool_call_parser(name: str | None) -> None:
    from pagedrs.server.tool_parsers import TOOL_CALL_PARSERS

    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser={name!r} (ServerOptions.tool_call_parser) is not a parser: allowed "
                         f"{', '.join(TOOL_CALL_PARSERS)} (or no flag: tool_choice \"auto\" is refused)")


def _check_seconds(flag: str, name: str, value: float | None, none_ok: bool) -> None:
    if (value is None and none_ok) or (value is not None and math.isfinite(value) and value > 0):
        return
    allowed = "a finite number of seconds > 0" + (" (or no flag: no limit)" if none_ok else "")
    raise ValueError(f"{flag}={value!r} (ServerOptions.{name}) is out of range: allowed {allowed}")
