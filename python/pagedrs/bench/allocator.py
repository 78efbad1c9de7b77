"""Allocator throughput: the Rust BlockManager through Python vs a pure-Python block manager.

Both managers serve the same seeded trace of calls, the life of a serving batch:
``allocate`` a prompt (a quarter of them start with a shared prefix, so the prefix
cache hits), ``append_tokens`` one decoded token at a time, ``commit`` what was
written, and ``free`` at the end. ops/s counts those calls; the reported figure is
the median of several repeats. The pure-Python side is the common design (a deque of
free blocks, a dict from block hash to block): benches/bench_block_manager.py's pool
when that file provides one with the same surface, else ``SimpleBlockManager`` below.
The criterion suite (``cargo bench --bench allocator``) measures the core without
Python in the way; ``make bench`` runs it separately.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.report import Column, markdown_table, render


class SimpleBlockManager:
    """Pure-Python paged block manager with prefix caching: deque free list, dict of hashes,
    LRU of cached blocks nobody uses. The same call surface as ``pagedrs.BlockManager``
    for allocate / append_tokens / commit / free."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_gpu_blocks))
        self.ref = [0] * num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, LRU first
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.hashes: dict[int, list[int]] = {}  # per sequence: hash of each committed full block

    @property
    def num_free_gpu_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block]]  # type: ignore[index]
            self.block_hash[block] = None
        else:
            raise MemoryError("out of blocks")
        self.ref[block] = 1
        return block

    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        bs = self.block_size
        table: list[int] = []
        hashes: list[int] = []
        parent = 0
        full = (len(token_ids) - 1) // bs  # leave the last token to compute
        for i in range(full if self.caching else 0):
            h = hash((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref[block] == 0:
                del self.evictable[block]
            self.ref[block] += 1
            table.append(block)
            hashes.append(h)
            parent = h
        hit_tokens = len(table) * bs
        needed = -(-len(token_ids) // bs) - len(table)
        if needed > self.num_free_gpu_blocks:
            for block in table:
                self._release(block)
            raise MemoryError("out of blocks")
        table += [self._take() for _ in range(needed)]
        self.tables[seq_id] = table
        self.tokens[seq_id] = list(token_ids)
        self.hashes[seq_id] = hashes
        return hit_tokens

    def append_tokens(self, seq_id: int, token_ids: list[int]) -> list[tuple[int, int]]:
        tokens = self.tokens[seq_id]
        table = self.tables[seq_id]
        tokens.extend(token_ids)
        while len(table) * self.block_size < len(tokens):
            table.append(self._take())
        return []

    def commit(self, seq_id: int, num_computed_tokens: int) -> None:
        if not self.caching:
            return
        bs = self.block_size
        tokens, table, hashes = self.tokens[seq_id], self.tables[seq_id], self.hashes[seq_id]
        parent = hashes[-1] if hashes else 0
        for i in range(len(hashes), num_computed_tokens // bs):
            h = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            block = table[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h
            hashes.append(h)
            parent = h

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.block_hash[block] is not None:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def free(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id)):
            self._release(block)
        del self.tokens[seq_id], self.hashes[seq_id]


def _external_pool() -> tuple[str, Callable[..., Any]] | None:
    """The pure-Python pool in benches/bench_block_manager.py, when it has the same surface."""
    path = Path(__file__).resolve().parents[3] / "benches" / "bench_block_manager.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_bench_block_manager", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - a broken sibling script must not break this bench
        return None
    for name, obj in vars(module).items():
        if isinstance(obj, type) and obj.__module__ == module.__name__ and all(
            callable(getattr(obj, m, None)) for m in ("allocate", "append_tokens", "commit", "free")
        ):
            return f"benches/bench_block_manager.py:{name}", obj
    return None


@dataclass(frozen=True)
class Trace:
    prompts: list[list[int]]
    decode_tokens: list[int]  # tokens appended one by one after each prompt


def make_trace(num_seqs: int, block_size: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    shared = rng.integers(100, 30000, size=4 * block_size).tolist()
    prompts = []
    for i in range(num_seqs):
        own = rng.integers(100, 30000, size=int(rng.integers(8, 6 * block_size))).tolist()
        prompts.append(shared + own if i % 4 == 0 else own)
    return Trace(prompts, rng.integers(8, 4 * block_size, size=num_seqs).tolist())


def replay(manager: Any, trace: Trace, concurrency: int) -> int:
    """Run the trace with ``concurrency`` sequences alive at once; returns calls made."""
    ops = 0
    live: deque[int] = deque()
    for i, (prompt, decode) in enumerate(zip(trace.prompts, trace.decode_tokens)):
        if len(live) == concurrency:
            manager.free(live.popleft())
            ops += 1
        sid = i
        manager.allocate(sid, prompt)
        manager.commit(sid, len(prompt))
        ops += 2
        n = len(prompt)
        for t in range(decode):
            manager.append_tokens(sid, [t + 100])
            n += 1
            manager.commit(sid, n)
            ops += 2
        live.append(sid)
    while live:
        manager.free(live.popleft())
        ops += 1
    return ops


def _ops_per_s(factory: Callable[[], Any], trace: Trace, concurrency: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        manager = factory()
        start = time.perf_counter()
        ops = replay(manager, trace, concurrency)
        rates.append(ops / (time.perf_counter() - start))
    return statistics.median(rates)


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    from pagedrs import BlockManager

    num_seqs = cfg.num_requests or (200 if cfg.quick else 2000)
    repeats = 3 if cfg.quick else 7
    concurrency = 32
    bs = cfg.block_size
    blocks = concurrency * (4 + 6 + 4) * 2 + 64  # room for the live set plus cached blocks
    trace = make_trace(num_seqs, bs)
    external = _external_pool()
    py_name, py_cls = external if external else ("SimpleBlockManager (pagedrs.bench.allocator)", SimpleBlockManager)
    rust = _ops_per_s(lambda: BlockManager(blocks, bs, 0, True), trace, concurrency, repeats)
    python = _ops_per_s(lambda: py_cls(blocks, bs, enable_prefix_caching=True), trace, concurrency, repeats)
    data = {
        "rust_ops_per_s": rust,
        "python_ops_per_s": python,
        "ratio": rust / python,
        "python_impl": py_name,
        "num_sequences": num_seqs,
        "concurrency": concurrency,
        "repeats": repeats,
        "num_gpu_blocks": blocks,
        "block_size": bs,
        "machine": machine,
    }
    rows = [
        {"label": "pagedrs.BlockManager (Rust, via PyO3)", "ops": rust},
        {"label": f"pure Python: {py_name}", "ops": python},
    ]
    notes = [
        f"Median of {repeats} replays of {num_seqs} sequences ({concurrency} alive at once): allocate, "
        "commit, append_tokens per decoded token, free; a quarter share a 4-block prefix.",
        f"Rust / Python = {rust / python:.2f}x. The criterion suite without Python: `cargo bench --bench allocator`.",
    ]
    md = render(
        "Allocator throughput",
        markdown_table(rows, [Column("block manager", "label"), Column("ops/s (median)", "ops", "{:,.0f}")]),
        notes,
        machine,
    )
    return data, md
