"""Allocator throughput: the Rust BlockManager through Python vs a pure-Python block manager.

Both managers serve the same seeded trace of calls, the life of a serving batch:
``allocate`` a prompt (a quarter of them start with a shared prefix, so the prefix
cache hits), ``append_tokens`` one decoded token at a time, ``commit`` what was
written, and ``free`` at the end. ops/s counts those calls; the reported figure is
the median of several repeats. The pure-Python side is the common design in two forms: the
vLLM-v1-style pool of benches/py_block_pool.py (doubly-linked free queue, dict of
hashes; used by benches/bench_block_manager.py) behind ``PoolBlockManager``, and
``SimpleBlockManager`` below (deque free list, dict of hashes).
The criterion suite (``cargo bench --bench allocator``) measures the core without
Python in the way; ``make bench`` runs it separately.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
            del self.cached[self.block_hash[block]]  # type: ignore[index,arg-type]
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


def load_vllm_style_pool() -> Any | None:
    """benches/py_block_pool.py (the vLLM-v1-style pool of bench_block_manager.py), when the
    repository is at hand; None from an installed wheel."""
    path = Path(__file__).resolve().parents[3] / "benches" / "py_block_pool.py"
    spec = importlib.util.spec_from_file_location("_py_block_pool", path) if path.is_file() else None
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PoolBlockManager:
    """The BlockManager surface (allocate / append_tokens / commit / free) over the
    vLLM-style ``PyBlockPool``: block tables per sequence, chained block hashes."""

    def __init__(self, pool_module: Any, num_gpu_blocks: int, block_size: int) -> None:
        self.m = pool_module
        self.pool = pool_module.PyBlockPool(num_gpu_blocks)
        self.block_size = block_size
        self.tables: dict[int, list[Any]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.hashes: dict[int, list[int]] = {}

    @property
    def num_free_gpu_blocks(self) -> int:
        return int(self.pool.free_queue.num_free_blocks)

    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        bs = self.block_size
        hits = []
        for h in self.m.request_block_hashes(token_ids, bs)[: (len(token_ids) - 1) // bs]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.pool.touch(hits)
        new = self.pool.get_new_blocks(-(-len(token_ids) // bs) - len(hits))
        self.tables[seq_id] = hits + new
        self.tokens[seq_id] = list(token_ids)
        self.hashes[seq_id] = []
        return len(hits) * bs

    def append_tokens(self, seq_id: int, token_ids: list[int]) -> list[tuple[int, int]]:
        tokens, table = self.tokens[seq_id], self.tables[seq_id]
        tokens.extend(token_ids)
        missing = -(-len(tokens) // self.block_size) - len(table)
        if missing > 0:
            table += self.pool.get_new_blocks(missing)
        return []

    def commit(self, seq_id: int, num_computed_tokens: int) -> None:
        bs, hashes, tokens = self.block_size, self.hashes[seq_id], self.tokens[seq_id]
        first = len(hashes)
        parent = hashes[-1] if hashes else None
        for i in range(first, num_computed_tokens // bs):
            parent = self.m.hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        if len(hashes) > first:
            self.pool.cache_full_blocks(self.tables[seq_id][first : len(hashes)], hashes[first:])

    def free(self, seq_id: int) -> None:
        self.pool.free_blocks(reversed(self.tables.pop(seq_id)))
        del self.tokens[seq_id], self.hashes[seq_id]


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
    managers: dict[str, Callable[[], Any]] = {"pagedrs.BlockManager (Rust, via PyO3)": lambda: BlockManager(blocks, bs, 0, True)}
    pool_module = load_vllm_style_pool()
    if pool_module is not None:
        managers["pure Python, vLLM-v1 style (benches/py_block_pool.py)"] = lambda: PoolBlockManager(pool_module, blocks, bs)
    managers["pure Python, deque + dict (SimpleBlockManager)"] = lambda: SimpleBlockManager(blocks, bs)
    rates = {name: _ops_per_s(factory, trace, concurrency, repeats) for name, factory in managers.items()}
    rust = next(iter(rates.values()))
    python = max(list(rates.values())[1:])  # the faster pure-Python design is the fair baseline
    data = {
        "rust_ops_per_s": rust,
        "python_ops_per_s": python,
        "ratio": rust / python,
        "ops_per_s": rates,
        "num_sequences": num_seqs,
        "concurrency": concurrency,
        "repeats": repeats,
        "num_gpu_blocks": blocks,
        "block_size": bs,
        "machine": machine,
    }
    rows = [{"label": name, "ops": rate, "ratio": rust / rate} for name, rate in rates.items()]
    notes = [
        f"Median of {repeats} replays of {num_seqs} sequences ({concurrency} alive at once): allocate, "
        "commit, append_tokens per decoded token, free; a quarter share a 4-block prefix.",
        f"Rust / fastest pure Python = {rust / python:.2f}x. Per-call microbenchmarks: "
        "`benches/bench_block_manager.py`; the core without Python: `cargo bench --bench allocator`.",
    ]
    columns = [Column("block manager", "label"), Column("ops/s (median)", "ops", "{:,.0f}"), Column("Rust speedup", "ratio", "{:.2f}x")]
    md = render("Allocator throughput", markdown_table(rows, columns), notes, machine)
    return data, md
