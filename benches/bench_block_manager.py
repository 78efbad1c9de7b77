"""BlockManager from Python vs a pure-Python vLLM-v1-style block pool (py_block_pool.py).

Workloads (block size 16), per call, Python call overhead and token conversion included:
  W0  allocate + free a 1024-token prompt (64 blocks), prefix caching off: like the pool's
      side, which takes and returns 64 blocks without hashing (a list is then not converted)
  W1  allocate + free a 1024-token prompt (64 blocks), prefix caching on, no hit
  W2  allocate + free a fully cached 257-token prompt (16 hit blocks, hashing included)
  W3  a 256-token miss that evicts 16 cached blocks, caches its 16 blocks (commit), frees
pagedrs is measured with token ids as a Python list and as a NumPy int64 array (read in
place; int32/uint32 are zero-copy). Prints the median over rounds, in µs per call.

Run: .venv/bin/python benches/bench_block_manager.py [--rounds 15] [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagedrs import BlockManager  # noqa: E402
from py_block_pool import PyBlockPool, request_block_hashes  # noqa: E402

BS = 16


def median_us(fn, rounds: int, calls: int) -> float:
    fn()  # warm up
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


# ---- baseline ---------------------------------------------------------------------------


def baseline_w1():
    pool = PyBlockPool(128)

    def step():
        blocks = pool.get_new_blocks(64)
        pool.free_blocks(reversed(blocks))

    return step


def baseline_w2():
    pool = PyBlockPool(128)
    prompt = list(range(257))
    hashes = request_block_hashes(prompt, BS)
    blocks = pool.get_new_blocks(17)
    pool.cache_full_blocks(blocks[:16], hashes)
    pool.free_blocks(reversed(blocks))

    def step():
        hs = request_block_hashes(prompt, BS)  # hashing included
        hits = []
        for h in hs[: (len(prompt) - 1) // BS]:
            b = pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        pool.touch(hits)
        new = pool.get_new_blocks(17 - len(hits))
        pool.free_blocks(reversed(hits + new))

    return step


def baseline_w3():
    pool = PyBlockPool(16)  # exactly one prompt: each call evicts the other's blocks
    prompts = [list(range(i * 1000, i * 1000 + 256)) for i in range(2)]
    turn = [0]

    def step():
        prompt = prompts[turn[0]]
        turn[0] ^= 1
        hs = request_block_hashes(prompt, BS)
        assert pool.get_cached_block(hs[0]) is None
        blocks = pool.get_new_blocks(16)
        pool.cache_full_blocks(blocks, hs)
        pool.free_blocks(reversed(blocks))

    for _ in range(2):
        step()
    return step


# ---- pagedrs ------------------------------------------------------------------------------


def rust_w0(tokens):
    bm = BlockManager(128, BS, enable_prefix_caching=False)

    def step():
        bm.allocate(1, tokens)
        bm.free(1)

    return step


def rust_w1(tokens):
    bm = BlockManager(128, BS)

    def step():
        bm.allocate(1, tokens)
        bm.free(1)

    return step


def rust_w2(tokens):
    bm = BlockManager(128, BS)
    bm.allocate(0, tokens)
    bm.commit(0, 257)
    bm.free(0)
    assert bm.allocate(1, tokens) == 256
    bm.free(1)

    def step():
        bm.allocate(1, tokens)
        bm.free(1)

    return step


def rust_w3(prompts):
    bm = BlockManager(16, BS)
    turn = [0]

    def step():
        prompt = prompts[turn[0]]
        turn[0] ^= 1
        bm.allocate(1, prompt)
        bm.commit(1, 256)
        bm.free(1)

    for _ in range(2):
        step()
    assert bm.stats()["evictions"] > 0 and bm.stats()["prefix_hits"] == 0
    return step


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    r, n = args.rounds, args.calls
    as_list = {
        "W0": list(range(1024)),
        "W1": list(range(1024)),
        "W2": list(range(257)),
        "W3": [list(range(i * 1000, i * 1000 + 256)) for i in range(2)],
    }
    as_array = {
        "W0": np.arange(1024, dtype=np.int64),
        "W1": np.arange(1024, dtype=np.int64),
        "W2": np.arange(257, dtype=np.int64),
        "W3": [np.asarray(p, dtype=np.int64) for p in as_list["W3"]],
    }
    as_u32 = {k: (np.asarray(v, dtype=np.uint32) if k != "W3" else [np.asarray(p, dtype=np.uint32) for p in v]) for k, v in as_list.items()}
    rows = [
        ("W0 allocate+free 1024 tokens, caching off", baseline_w1(), rust_w0, "W0"),
        ("W1 allocate+free 1024 tokens (64 blocks)", baseline_w1(), rust_w1, "W1"),
        ("W2 cached 257-token prompt (16 hits)", baseline_w2(), rust_w2, "W2"),
        ("W3 256-token miss: evict, cache, free 16", baseline_w3(), rust_w3, "W3"),
    ]
    print(f"machine: {machine()}")
    print(f"median of {r} rounds x {n} calls, µs per call (lower is better)\n")
    header = f"{'workload':44} {'py pool':>9} {'rs list':>9} {'rs i64':>9} {'rs u32':>9} {'x list':>7} {'x i64':>7} {'x u32':>7}"
    print(header)
    print("-" * len(header))
    for name, base, make, key in rows:
        b = median_us(base, r, n)
        lst = median_us(make(as_list[key]), r, n)
        arr = median_us(make(as_array[key]), r, n)
        u32 = median_us(make(as_u32[key]), r, n)
        print(f"{name:44} {b:9.2f} {lst:9.2f} {arr:9.2f} {u32:9.2f} {b / lst:6.1f}x {b / arr:6.1f}x {b / u32:6.1f}x")


if __name__ == "__main__":
    main()
