//! The blocks of one tier: the lock-free pool of never-cached free blocks, refcounts,
//! and the prefix cache whose evictable blocks are reclaimed only when the pool is dry.
//!
//! Block states (invariant 1): *free* (on the pool, refcount 0, no hash), *in use*
//! (refcount ≥ 1, hashed or not), *cached and evictable* (refcount 0, hashed, on the
//! evictable set). `num_free()` counts the first and the last.

use super::eviction::EvictionPolicyKind;
use super::prefix_cache::PrefixCache;
use crate::error::BlockId;
use crate::page_pool::{PagePool, RefCounts};

pub(crate) struct TierPool {
    pub(crate) pool: PagePool,
    pub(crate) refs: RefCounts,
    pub(crate) cache: PrefixCache,
    /// Blocks released in one call, returned to `pool` as one batch.
    release_batch: Vec<BlockId>,
}

impl TierPool {
    pub(crate) fn new(num_blocks: usize, block_size: usize, policy: EvictionPolicyKind) -> Self {
        TierPool {
            pool: PagePool::new(num_blocks),
            refs: RefCounts::new(num_blocks),
            cache: PrefixCache::new(num_blocks, block_size, policy),
            release_batch: Vec::new(),
        }
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.pool.capacity()
    }

    /// Blocks a take can have now: never-cached free ones plus evictable cached ones.
    #[inline]
    pub(crate) fn num_free(&self) -> usize {
        self.pool.num_free() + self.cache.evictable.len()
    }

    /// Takes `n` blocks with refcount 1 into `out`: never-cached ones first, then the
    /// cached ones the eviction policy gives up first, whose ids (with the hash they had) are appended
    /// to `evicted`. Returns `false`, changing nothing, when fewer than `n` are free.
    pub(crate) fn take(&mut self, n: usize, out: &mut Vec<BlockId>, evicted: &mut Vec<(BlockId, u64)>) -> bool {
        if n > self.num_free() {
            return false;
        }
        let start = out.len();
        let from_pool = n.min(self.pool.num_free());
        let took = self.pool.take_into(from_pool, out);
        debug_assert!(took, "pool had {from_pool} free under &mut");
        for _ in from_pool..n {
            let b = self.cache.evictable.pop_victim().expect("num_free counted this block");
            let hash = self.cache.uncache(b).expect("evictable blocks are hashed");
            evicted.push((b, hash));
            out.push(b);
        }
        for &b in &out[start..] {
            self.refs.set_exclusive(b, 1);
        }
        true
    }

    /// Adds one user to a block; a cached block with no user leaves the evictable set.
    #[inline]
    pub(crate) fn retain(&mut self, b: BlockId, n: u32) {
        if self.refs.get(b) == 0 {
            self.cache.evictable.remove(b);
        }
        self.refs.add_exclusive(b, n);
    }

    /// Forgets `b`'s cached page (its content is lost) and returns the hash it had; a block
    /// nobody holds leaves the evictable set for the pool at once, a held one goes to the
    /// pool when its last user releases it (it is no longer hashed).
    pub(crate) fn forget(&mut self, b: BlockId) -> Option<u64> {
        let hash = self.cache.uncache(b)?;
        if self.refs.get(b) == 0 {
            self.cache.evictable.remove(b);
            self.pool.put(&[b]);
        }
        Some(hash)
    }

    /// Drops `n` users of `b`; a block left with none becomes evictable when cached, or
    /// goes to the pool batch (call [`flush`](Self::flush) after the last release).
    #[inline]
    pub(crate) fn release(&mut self, b: BlockId, n: u32) {
        if self.refs.sub_exclusive(b, n) == 0 {
            if self.cache.hash_of(b).is_some() {
                self.cache.evictable.push(b);
            } else {
                self.release_batch.push(b);
            }
        }
    }

    /// Returns the released never-cached blocks to the pool as if put one at a time:
    /// the last released is on top.
    pub(crate) fn flush(&mut self) {
        if !self.release_batch.is_empty() {
            self.release_batch.reverse();
            self.pool.put(&self.release_batch);
            self.release_batch.clear();
        }
    }
}
