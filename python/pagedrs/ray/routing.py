"""Which replica gets a request: the longest cached prefix, within a bounded load.

Pure decisions, no Ray: ``router.py`` feeds them the replicas Ray Serve knows and the
digests the replicas report; the tests drive them directly.

A replica's digest is the set of block hashes its device tier caches (``cached_hashes``,
the same names its KV events use), reported every ``routing_stats_period_s``; between two
digests the router adds the hashes of each prompt it sends there (the replica caches them
once it has run the prompt), so a burst of one conversation follows its first request.
A digest replaces that guess, except for what was sent there shortly before the digest was taken
or since (``with_recent``: those prompts may not have run yet), so what the replica evicted
meanwhile is gone at once and what it is about to cache is not forgotten.

Bounded load (consistent hashing with bounded loads, Mirrokni et al.): with ``m`` requests in
flight on ``n`` replicas, a replica may take the next one only while its load stays within
``ceil((1 + epsilon) * (m + 1) / n)``, so a hot prefix spreads out instead of piling onto one
replica (a looser "mean + 1" bound let 92% of a multi-turn run's requests onto one of two).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

DEFAULT_EPSILON = 0.25  # the bounded-load slack: at most 1.25 x the mean, rounded up


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    key: Hashable  # Ray's ReplicaID (anything hashable in tests)
    load: float  # requests queued or running there
    cached: set[int] = field(default_factory=set)  # its last digest plus what was sent since


def matched_blocks(prompt_hashes: Sequence[int], cached: set[int]) -> int:
    """How many leading blocks of the prompt the replica holds: a chain breaks at its first miss."""
    n = 0
    for h in prompt_hashes:
        if h not in cached:
            break
        n += 1
    return n


def eligible(replicas: Sequence[ReplicaView], epsilon: float = DEFAULT_EPSILON) -> list[ReplicaView]:
    """The replicas within the load bound; never empty when ``replicas`` is not."""
    if not replicas:
        return []
    capacity = math.ceil((1.0 + epsilon) * (sum(r.load for r in replicas) + 1) / len(replicas))
    within = [r for r in replicas if r.load + 1 <= capacity]
    return within or [min(replicas, key=lambda r: r.load)]


def rank(prompt_hashes: Sequence[int], replicas: Sequence[ReplicaView],
         epsilon: float = DEFAULT_EPSILON) -> list[list[ReplicaView]]:
    """Ray Serve's ranks: first the eligible replicas by (longest match, least load), then the rest
    by load. Ties in match length go to the least loaded, so with no match this is least-load."""
    ok = eligible(replicas, epsilon)
    first = sorted(ok, key=lambda r: (-matched_blocks(prompt_hashes, r.cached), r.load))
    rest = sorted((r for r in replicas if r not in ok), key=lambda r: r.load)
    return [first[:1], first[1:] + rest] if len(first) > 1 or rest else [first]


RECENT_SLACK_S = 2.0  # a prompt sent this long before a digest may still not be in it (queued, prefilling)


def with_recent(digest: Sequence[int], digest_time: float, recent: Sequence[tuple[float, Sequence[int]]],
                slack_s: float = RECENT_SLACK_S) -> set[int]:
    """A replica's cached hashes from its digest (taken at ``digest_time``), plus the routes sent
    there since ``digest_time - slack_s`` (``recent``: (time sent, route)), which it may not have run."""
    cached = set(digest)
    for sent, route in recent:
        if sent >= digest_time - slack_s:
            cached.update(route)
    return cached
