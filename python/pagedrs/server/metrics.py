"""Prometheus metrics of the serving engine, in a private registry.

A private ``CollectorRegistry`` (not the process-global default) lets several
servers live in one process — the tests start more than one — without
"Duplicated timeseries" errors, and keeps ``/metrics`` to pagedrs's own series.

Gauges mirror the latest ``Engine.stats()``. The engine reports cumulative
totals, so counters advance by the difference from the previous snapshot; a
counter never moves backwards even if a total did (it would only after an
engine restart).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

# gauge name -> Engine.stats() key
_GAUGES: dict[str, tuple[str, str]] = {
    "pagedrs_kv_total_blocks": ("num_gpu_blocks", "KV cache pages in the device pool."),
    "pagedrs_kv_free_blocks": (
        "num_free_gpu_blocks", "Allocatable device KV pages (evictable cached pages count as free)."
    ),
    "pagedrs_kv_utilization": ("kv_utilization", "Live token slots over reserved slots, 0..1."),
    "pagedrs_requests_running": ("num_running", "Requests in the running batch."),
    "pagedrs_requests_waiting": ("num_waiting", "Requests admitted but not yet scheduled."),
    "pagedrs_requests_swapped": ("num_swapped", "Sequences paused by preemption (pages on the host tier, or some still on the device)."),
    "pagedrs_prefix_pins": ("num_pins", "Live pinned prefixes (POST /v1/cache/pin, --pin-prefix)."),
    "pagedrs_pinned_blocks": ("num_pinned_blocks", "Distinct device KV pages held by pinned prefixes (never evicted)."),
    "pagedrs_core_step_fraction": (
        "core_step_fraction", "Share of the engine core's busy time spent in Engine.step (engine in its own process)."
    ),
}
# labeled gauge name -> (label, {label value: Engine.stats() key}, help)
_LABELED_GAUGES: dict[str, tuple[str, dict[str, str], str]] = {
    "pagedrs_cached_blocks": (
        "tier", {"device": "num_cached_gpu_blocks", "host": "num_cached_cpu_blocks", "disk": "num_cached_disk_blocks"},
        "Prefix-cache pages held on each tier now.",
    ),
    "pagedrs_memory_bytes": (
        "part", {"weights": "memory_weights_bytes", "kv_pool": "memory_kv_pool_bytes",
                 "host_tier": "memory_host_pool_bytes", "resident": "memory_rss_bytes"},
        "Memory of the engine process: weights, the device KV pool, the host tier, and the whole resident set.",
    ),
    "pagedrs_step_preemption_bytes": (
        "direction", {"out": "step_swap_bytes_out", "in": "step_swap_bytes_in"},
        "KV bytes the last step's preemption swap-outs / swap-ins copied.",
    ),
}

# labeled counter name (without _total) -> (label, {label value: Engine.stats() key}, help)
_LABELED_COUNTERS: dict[str, tuple[str, dict[str, str], str]] = {
    "pagedrs_prefix_tier_hits": (
        "tier", {"device": "prefix_hits_device", "host": "prefix_hits_host", "disk": "prefix_hits_disk"},
        "Prefix-cache hits (blocks) by the tier that served them.",
    ),
    "pagedrs_prefix_misses": (
        "reason", {"never_seen": "prefix_misses_never_seen", "evicted": "prefix_misses_evicted",
                   "evicted_disk": "prefix_misses_evicted_disk", "invalidated": "prefix_misses_invalidated"},
        "Prefix-cache misses (blocks) by reason.",
    ),
    "pagedrs_kv_bytes_moved": (
        "direction", {"to_host": "kv_bytes_to_host", "from_host": "kv_bytes_from_host", "to_disk": "kv_bytes_to_disk",
                      "from_disk": "kv_bytes_from_disk"},
        "KV bytes copied between tiers.",
    ),
    "pagedrs_preemption_pages": (
        "direction", {"out": "num_pages_swapped_out", "in": "num_pages_swapped_in"},
        "KV pages copied by preemption (page-granular swap-outs, swap-ins).",
    ),
    "pagedrs_preemption_bytes": (
        "direction", {"out": "swap_bytes_out", "in": "swap_bytes_in"},
        "KV bytes copied by preemption (page-granular swap-outs, swap-ins).",
    ),
}

# Keys that only some engines report (the engine core process); every other key must be a
# field of pagedrs.stats.EngineStats (tests/test_stats.py), so a renamed field fails loudly.
OPTIONAL_KEYS = frozenset({"core_step_fraction"})

# counter name (without _total) -> Engine.stats() keys summed
_COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "pagedrs_prefix_cache_queries": (("prefix_queries",), "Blocks looked up in the prefix cache."),
    "pagedrs_prefix_cache_hits": (("prefix_hits",), "Blocks found in the prefix cache."),
    "pagedrs_preemptions": (("num_preemptions",), "Sequence groups preempted (swap or recompute)."),
    "pagedrs_swapped_pages": (("swap_out_blocks", "swap_in_blocks"), "KV pages moved between device and host."),
    "pagedrs_generated_tokens": (("num_generated_tokens",), "Tokens sampled."),
    "pagedrs_kv_events_published": (
        ("kv_events_published",), "KV events (BlockStored, BlockRemoved, AllBlocksCleared) published to routers."),
    "pagedrs_window_released_pages": (
        ("window_released_blocks",), "KV pages given back because they fell out of every sliding window."),
}

# Counters labeled by a string the engine reports (name without _total -> (label, its stats key, counted key, help))
_COUNTERS_BY_STRING: dict[str, tuple[str, str, str, str]] = {
    "pagedrs_prefix_cache_evictions": (
        "policy", "eviction_policy", "evictions", "Cached device pages whose content was dropped, by eviction policy."),
}

# Latency buckets (seconds) from a few ms (GPU decode) to a minute (CPU prefill under load).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """All series of one server. Thread-safe: the engine thread writes, HTTP handlers read."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._gauges = {name: Gauge(name, doc, registry=self.registry) for name, (_, doc) in _GAUGES.items()}
        self._counters = {name: Counter(name, doc, registry=self.registry) for name, (_, doc) in _COUNTERS.items()}
        self._last_totals: dict[str, float] = {name: 0.0 for name in _COUNTERS}
        self._labeled_gauges = {name: Gauge(name, doc, [label], registry=self.registry)
                                for name, (label, _, doc) in _LABELED_GAUGES.items()}
        self._labeled_counters = {name: Counter(name, doc, [label], registry=self.registry)
                                  for name, (label, _, doc) in _LABELED_COUNTERS.items()}
        self._string_counters = {name: Counter(name, doc, [label], registry=self.registry)
                                 for name, (label, _, _, doc) in _COUNTERS_BY_STRING.items()}
        self.prefix_cache_resets = Counter(
            "pagedrs_prefix_cache_resets", "Resets of the prefix cache (POST /reset_prefix_cache), by outcome.",
            ["outcome"], registry=self.registry,
        )
        self.pins = Counter(
            "pagedrs_prefix_pin_requests", "Pin and unpin requests (/v1/cache/pin), by outcome.",
            ["outcome"], registry=self.registry,
        )
        # finish_reason: a sample's ("stop", "length", "error"), or how the server ended a request in flight:
        # "abort" (its client went away), "timeout" (--request-timeout: a 504), "failed" (the engine failed or
        # the server shut down with it in flight); before, those ended uncounted
        self.requests = Counter(
            "pagedrs_requests_finished", "Requests finished, by reason.", ["finish_reason"], registry=self.registry
        )
        self.rejected = Counter(
            "pagedrs_requests_rejected", "Requests refused before reaching the engine, by HTTP status.",
            ["status"], registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pagedrs_time_to_first_token_seconds", "From arrival at the server to the first sampled token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        # A request's first token, split as vLLM splits it (RequestStateStats): the hand-off to the
        # engine, the wait for admission, the steps that computed its prompt.
        self.handoff_time = Histogram(
            "pagedrs_request_handoff_time_seconds",
            "From arrival at the server to the engine taking the request (between two steps: the step in flight).",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue_time = Histogram(
            "pagedrs_request_queue_time_seconds",
            "From the engine taking the request to the start of its first step (vLLM's request_queue_time).",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.prefill_time = Histogram(
            "pagedrs_request_prefill_time_seconds",
            "From the start of the request's first step to its first sampled token (vLLM's request_prefill_time).",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "pagedrs_inter_token_latency_seconds", "Between consecutive token-bearing outputs of one request.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )

    def update_from_stats(self, stats: Mapping[str, Any]) -> None:
        for name, (key, _) in _GAUGES.items():
            if key in stats:
                self._gauges[name].set(float(stats[key]))
        for name, (label, keys, _) in _LABELED_GAUGES.items():
            for value, key in keys.items():
                if key in stats:
                    self._labeled_gauges[name].labels(**{label: value}).set(float(stats[key]))
        for name, (label, keys, _) in _LABELED_COUNTERS.items():
            for value, key in keys.items():
                if key in stats:
                    self._advance(name + ":" + value, self._labeled_counters[name].labels(**{label: value}),
                                  float(stats[key]))
        for name, (label, label_key, key, _) in _COUNTERS_BY_STRING.items():
            if label_key in stats and key in stats:
                value = str(stats[label_key])
                self._advance(f"{name}:{value}", self._string_counters[name].labels(**{label: value}), float(stats[key]))
        for name, (summed, _) in _COUNTERS.items():
            if all(k in stats for k in summed):
                self._advance(name, self._counters[name], float(sum(stats[k] for k in summed)))

    def _advance(self, key: str, counter: Any, total: float) -> None:
        """Moves a counter to the engine's cumulative ``total`` (never backwards)."""
        delta = total - self._last_totals.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
