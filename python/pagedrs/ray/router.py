"""The Ray Serve request router that routes by what each replica's cache holds.

Ray Serve calls ``choose_replicas`` for each request with the replicas it may use; the
request's ``route`` keyword (block hashes the ingress computed with the engine's own hash
chain, ``pagedrs._core.prompt_block_hashes``) is scored against each replica's digest
(``PagedrsReplica.record_routing_stats``: the hashes its device tier caches). The decision
itself is ``routing.rank``; this class only keeps the views up to date.

``routing="pow2"`` uses Ray's own ``PowerOfTwoChoicesRequestRouter`` instead (``app.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from pagedrs.ray.routing import DEFAULT_EPSILON, RECENT_SLACK_S, ReplicaView, rank, with_recent

logger = logging.getLogger(__name__)

PICK_TTL_S = 5.0  # a pick no request confirms (cancelled before it was sent) stops counting then


class CacheAffinityRouter(RequestRouter):
    """Longest cached prefix among the replicas within (1 + epsilon) x the mean load."""

    def initialize_state(self, epsilon: float = DEFAULT_EPSILON, use_digests: bool = True, **kwargs: Any) -> None:
        """``use_digests=False``: the approximate router (``routing="approx"``), which predicts each
        replica's cache from the requests it sent there and never learns what was evicted, the way
        Ray's ``PrefixCacheAffinityRouter`` does (that one needs ``ray[llm]``, which needs vLLM)."""
        self._epsilon = float(epsilon)
        self._use_digests = bool(use_digests)
        self._views: dict[ReplicaID, ReplicaView] = {}
        self._digest_seen: dict[ReplicaID, int] = {}  # the digest's sequence number, per replica
        self._inflight: dict[str, ReplicaID] = {}  # internal request id -> where it went
        # Ray runs several routing tasks at once: a pick counts against its replica from the moment
        # it is made, not only once Ray reports the request routed, or concurrent picks all see the
        # same loads and pile onto one replica. Entries no request confirms expire.
        self._picked: dict[str, tuple[ReplicaID, float]] = {}
        self._recent: dict[ReplicaID, list[tuple[float, list[int]]]] = {}  # routes sent, by replica (wall clock)
        self.routed_by_match = 0  # requests that went where a prefix was cached (for the bench)

    def _loads(self) -> dict[Any, float]:
        now = time.monotonic()
        self._picked = {k: v for k, v in self._picked.items() if now - v[1] < PICK_TTL_S}
        extra: dict[Any, float] = {}
        for rid, _ in self._picked.values():
            extra[rid] = extra.get(rid, 0.0) + 1.0
        return extra

    def _view(self, replica: RunningReplica) -> ReplicaView:
        rid = replica.replica_id
        view = self._views.get(rid)
        if view is None:
            view = self._views[rid] = ReplicaView(key=rid, load=0.0)
        stats = (replica.routing_stats or {}) if self._use_digests else {}
        seq = int(stats.get("seq", -1))
        if seq > self._digest_seen.get(rid, -1):  # a new digest replaces the guesses, bar the recent ones
            self._digest_seen[rid] = seq
            taken = float(stats.get("time", time.time()))
            recent = [r for r in self._recent.get(rid, []) if r[0] >= taken - RECENT_SLACK_S]
            self._recent[rid] = recent
            view.cached = with_recent(stats.get("hashes", ()), taken, recent)
        return view

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        route: list[int] = list((pending_request.kwargs.get("route") if pending_request is not None else None) or ())
        by_key: dict[Any, RunningReplica] = {r.replica_id: r for r in candidate_replicas}
        extra = self._loads()
        views = [self._view(r) for r in candidate_replicas]
        counted = [ReplicaView(v.key, v.load + extra.get(v.key, 0.0), v.cached) for v in views]
        tiers = [[by_key[v.key] for v in tier] for tier in rank(route, counted, self._epsilon) if tier]
        if pending_request is not None and tiers:
            self._picked[pending_request.metadata.internal_request_id] = (tiers[0][0].replica_id, time.monotonic())
        return tiers

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        view = self._views.get(replica_id)
        if view is None:
            return
        view.load += 1.0
        self._picked.pop(pending_request.metadata.internal_request_id, None)
        self._inflight[pending_request.metadata.internal_request_id] = replica_id
        route = list(pending_request.kwargs.get("route") or ())
        view.cached.update(route)  # it will hold the prompt's pages once it ran it
        if self._use_digests and route:
            self._recent.setdefault(replica_id, []).append((time.time(), route))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._inflight.pop(internal_request_id, None)
        view = self._views.get(rid if rid is not None else replica_id)
        if view is not None:
            view.load = max(0.0, view.load - 1.0)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Its cache is gone with it: its entries go at once, the requests route around it."""
        super().on_replica_actor_died(replica_id)
        self._views.pop(replica_id, None)
        self._digest_seen.pop(replica_id, None)
        self._recent.pop(replica_id, None)
        self._inflight = {k: v for k, v in self._inflight.items() if v != replica_id}
