"""The grid `pagedrs bench map` sweeps, the requests of one cell, and the one KV pool every cell gets.

A cell is (concurrency C, spread s, shared-prefix share f):

* concurrency: the engine runs at most C sequences at once (``max_num_seqs = C``) and the cell
  submits ``requests_per_user * C`` requests at t=0, so C "users" each send requests back to
  back (the engine starts the next waiting request as soon as a sequence finishes);
* spread: every request's total length (prompt + output) lies in ``[L / s, L]`` with
  ``L = max_total_len``, log-uniform, and one request at each end, so the realised
  max / min is s (exactly when ``s`` divides ``L``); s = 1 gives equal lengths;
* share: the first ``round(f * prompt)`` tokens of every prompt are the start of one common
  "system prompt" (a prefix of a single token sequence), the rest are the request's own. Two
  requests therefore share the shorter one's system part; with equal lengths all share it whole.

Each prompt is ``prompt_fraction`` of its total, the output the rest (at least one token each).

Equal memory: both layouts get the same pool, sized once for the whole grid by
``throughput.make_budget``: ``budget_seqs`` contiguous reservations of ``max_model_len = L``
tokens, i.e. ``budget_seqs * ceil(L / block_size)`` blocks of ``block_size`` tokens, in bytes
``blocks * block_size * bytes_per_token`` (KV dtype = the model dtype). Every request fits one
reservation, so the contiguous layout always runs ``min(C, budget_seqs)`` sequences and queues
the rest; the paged layout runs as many as its pages (and its admission policy) allow, up to C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedrs.bench.model_spec import KVGeometry
from pagedrs.bench.throughput import KVBudget, make_budget
from pagedrs.bench.workloads import BenchRequest


@dataclass(frozen=True)
class MapCell:
    concurrency: int
    spread: float
    share: float

    def key(self) -> str:
        return f"c{self.concurrency}-s{self.spread:g}-p{round(100 * self.share)}"


@dataclass(frozen=True)
class MapGrid:
    concurrency: tuple[int, ...]
    spreads: tuple[float, ...]  # max / min of total lengths; 1 = equal lengths
    shares: tuple[float, ...]  # fraction of every prompt that is the common system prompt
    max_total_len: int  # L: the longest request (prompt + output) and both layouts' max_model_len
    prompt_fraction: float = 0.5  # of each total; the rest is output
    requests_per_user: int = 2  # requests per unit of concurrency
    min_requests: int = 4  # at least this many per cell (a single user still sends several)
    budget_seqs: int = 4  # pool = this many contiguous reservations of L tokens
    repeats: int = 1  # runs per layout and cell; tokens/s is their median
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency values must be >= 1, got {self.concurrency}")
        if not self.spreads or min(self.spreads) < 1:
            raise ValueError(f"spreads must be >= 1 (max/min of lengths), got {self.spreads}")
        if not self.shares or not all(0 <= f < 1 for f in self.shares):
            raise ValueError(f"shares must be in [0, 1), got {self.shares}")
        if not 0 < self.prompt_fraction < 1:
            raise ValueError(f"prompt_fraction must be in (0, 1), got {self.prompt_fraction}")
        shortest = self.max_total_len / max(self.spreads)
        if shortest < 2:
            raise ValueError(
                f"max_total_len {self.max_total_len} / spread {max(self.spreads)} = {shortest:.1f} tokens; "
                "the shortest request needs >= 2 (one prompt and one output token)"
            )
        for name in ("requests_per_user", "min_requests", "budget_seqs", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def cells(self) -> list[MapCell]:
        return [MapCell(c, s, f) for f in self.shares for s in self.spreads for c in self.concurrency]

    def corners(self) -> MapGrid:
        """The same grid cut to its extremes (lowest and highest of every axis): the tiny model's cells."""
        def ends(values: tuple) -> tuple:  # type: ignore[type-arg]
            return tuple(sorted({min(values), max(values)}))

        return MapGrid(ends(self.concurrency), ends(self.spreads), ends(self.shares), self.max_total_len,
                       self.prompt_fraction, self.requests_per_user, self.min_requests, self.budget_seqs,
                       self.repeats, self.seed)

    def num_requests(self, cell: MapCell) -> int:
        return max(self.min_requests, self.requests_per_user * cell.concurrency)


# Short outputs (15 tokens at spread 1) after prompts of 45, whose 90% system part spans two
# 16-token pages: 12.6 minutes for SmolLM2 plus the tiny corners on 2 cores at load ~11 (README).
QUICK = MapGrid(concurrency=(1, 8, 32), spreads=(1, 4, 10), shares=(0.0, 0.9), max_total_len=60,
                prompt_fraction=0.75, requests_per_user=1)
# 84 cells, one run per layout each (the tiny corners: three): 73 minutes on one core of a 2-core
# Intel Xeon (2026-12-02, the other core busy); three runs per SmolLM2 cell would take three times that.
FULL = MapGrid(concurrency=(1, 2, 4, 8, 16, 32, 64), spreads=(1, 2, 4, 10), shares=(0.0, 0.5, 0.9),
               max_total_len=160, prompt_fraction=0.75, requests_per_user=1, min_requests=8, repeats=1)


def total_lengths(spread: float, max_total_len: int, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` totals in ``[round(L / spread), L]``, log-uniform, the two ends included (n >= 2)."""
    if n < 2 and spread > 1:
        raise ValueError(f"a spread of {spread} needs at least 2 requests, got {n}")
    lo, hi = max(2, round(max_total_len / spread)), max_total_len
    draws = np.exp(rng.uniform(math.log(lo), math.log(hi), size=n))
    totals = np.clip(np.rint(draws), lo, hi).astype(int)
    totals[0], totals[-1] = lo, hi
    rng.shuffle(totals)
    return [int(t) for t in totals]


@dataclass(frozen=True)
class CellWorkload:
    requests: list[BenchRequest]
    shared_tokens: list[int]  # per request: prompt tokens taken from the common system prompt

    def summary(self) -> dict[str, object]:
        totals = [r.total_len for r in self.requests]
        prompts = [len(r.prompt_token_ids) for r in self.requests]
        return {
            "num_requests": len(self.requests),
            "total_len_min": min(totals),
            "total_len_max": max(totals),
            "spread_realised": max(totals) / min(totals),
            "share_realised": sum(self.shared_tokens) / sum(prompts),
            "prefix_common_to_all": shared_prefix_len(self.requests),
            "num_prompt_tokens": sum(prompts),
            "num_output_tokens": sum(r.max_tokens for r in self.requests),
        }


def cell_requests(grid: MapGrid, cell: MapCell, vocab_size: int) -> CellWorkload:
    """The cell's requests, seeded by the grid's seed: same grid and cell, same requests."""
    n = grid.num_requests(cell)
    # One stream per cell, so adding a cell to the grid does not change another's requests.
    rng = np.random.default_rng([grid.seed, cell.concurrency, round(cell.spread * 100), round(cell.share * 100)])
    low = vocab_size // 8  # special tokens live at the bottom
    system = rng.integers(low, vocab_size, size=grid.max_total_len).tolist()
    requests, shared_tokens = [], []
    for i, total in enumerate(total_lengths(cell.spread, grid.max_total_len, n, rng)):
        prompt_len = min(total - 1, max(1, round(grid.prompt_fraction * total)))
        shared = min(prompt_len, round(cell.share * prompt_len))
        own = rng.integers(low, vocab_size, size=prompt_len - shared).tolist()
        requests.append(BenchRequest(f"{cell.key()}-{i:04d}", system[:shared] + own, total - prompt_len))
        shared_tokens.append(shared)
    return CellWorkload(requests, shared_tokens)


def equal_memory_pool(grid: MapGrid, geo: KVGeometry, block_size: int) -> KVBudget:
    """One pool for both layouts and every cell: ``budget_seqs`` reservations of ``max_total_len``."""
    return make_budget(geo, grid.max_total_len, grid.budget_seqs, block_size)


def shared_prefix_len(requests: list[BenchRequest]) -> int:
    """Tokens every prompt of ``requests`` starts with (the common system part they all hold)."""
    first = requests[0].prompt_token_ids
    n = min(len(r.prompt_token_ids) for r in requests)
    for r in requests[1:]:
        n = next((i for i in range(n) if r.prompt_token_ids[i] != first[i]), n)
    return n
