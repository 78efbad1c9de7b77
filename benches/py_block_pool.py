"""A straightforward pure-Python block pool in the style of vLLM v1's BlockPool
(vllm/v1/core/block_pool.py, kv_cache_utils.py): the baseline of bench_block_manager.py.

Free blocks sit in a doubly-linked queue (O(1) removal from the middle when a cached
block is hit), cached blocks in a dict keyed by a chained hash of
(parent hash, block tokens); eviction pops the least recently freed block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None


class FreeBlockQueue:
    """Doubly-linked free queue with sentinels, as vLLM's FreeKVCacheBlockQueue."""

    def __init__(self, blocks: list[Block]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = Block(-1)
        self.tail = Block(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft_n(self, n: int) -> list[Block]:
        out = []
        cur = self.head.next_free
        for _ in range(n):
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        self.head.next_free = cur
        cur.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, b: Block) -> None:
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[Block]) -> None:
        last = self.tail.prev_free
        n = 0
        for b in blocks:
            b.prev_free = last
            last.next_free = b
            last = b
            n += 1
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free_blocks += n


def hash_block_tokens(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """vLLM's builtin-hash variant: hash((parent, tuple(tokens), extra_keys))."""
    return hash((parent_hash, tuple(tokens), None))


def request_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    hashes = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


class PyBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, dict[int, Block]] = {}

    def get_cached_block(self, block_hash: int) -> Block | None:
        by_id = self.cached.get(block_hash)
        if not by_id:
            return None
        return next(iter(by_id.values()))

    def _maybe_evict(self, b: Block) -> None:
        if b.block_hash is None:
            return
        by_id = self.cached.get(b.block_hash)
        if by_id is not None:
            by_id.pop(b.block_id, None)
            if not by_id:
                del self.cached[b.block_hash]
        b.block_hash = None

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks")
        out = self.free_queue.popleft_n(n)
        for b in out:
            self._maybe_evict(b)
            b.ref_cnt += 1
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def cache_full_blocks(self, blocks: Sequence[Block], hashes: Sequence[int]) -> None:
        for b, h in zip(blocks, hashes):
            if b.block_hash is not None:
                continue
            b.block_hash = h
            self.cached.setdefault(h, {})[b.block_id] = b

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Frees in the given order (callers pass the tail first so it is evicted first)."""
        released = []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                released.append(b)
        self.free_queue.append_n(released)
