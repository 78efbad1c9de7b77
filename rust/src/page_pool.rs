//! The lock-free pool of free block ids of one tier, and atomic per-block refcounts.
//!
//! # Algorithm
//!
//! [`PagePool`] is a Treiber stack (R. K. Treiber, *Systems Programming: Coping with
//! Parallelism*, IBM RJ 5118, 1986) laid over an array: block `i`'s successor is
//! `next[i]`, and `head` packs `(tag: u32, top: u32)` into one `AtomicU64`. Batches move
//! as one chain with one compare-and-swap, and an atomic `free` counter makes a batch
//! all-or-nothing:
//!
//! * **take k**: first *reserve* k by CAS-decrementing `free` (fail, changing nothing,
//!   when `free < k`); then read `head`, walk k links, and CAS `head` from
//!   `(tag, top)` to `(tag + 1, kth.next)`. Retry the pop (never the reservation) on a
//!   failed CAS or a chain that looked short.
//! * **put k**: link the batch `ids[0] → … → ids[k-1] → top`, CAS `head` from
//!   `(tag, top)` to `(tag + 1, ids[0])`, then add k to `free`.
//!
//! # Why it is correct
//!
//! * *No ABA.* Every change of `head` is a CAS that bumps `tag`. A pop's CAS succeeds
//!   only if `head` still holds the exact `(tag, top)` it read, so no push or pop
//!   happened in between (barring 2^32 interleaved changes during one pop, the usual
//!   bound of tagged pointers): the stack's membership, hence every `next` link the pop
//!   walked, is what it read. A link is written only by the owner of a block that is
//!   off the stack, before the releasing CAS that publishes it.
//! * *Visibility.* All writes to `head` are read-modify-writes with `Release`, so they
//!   form one release sequence; a pop's `Acquire` load of `head` therefore sees every
//!   link written before any earlier push. A link read while a racing push rewrites it
//!   may be garbage, but then `head` moved and the CAS fails (out-of-range garbage is
//!   caught before use).
//! * *All-or-nothing, never short.* A push adds to the stack before it raises `free`;
//!   a take lowers `free` before it removes from the stack. So
//!   `free + (reserved but not yet popped) <= stack length` at every instant, and a
//!   reservation of k always finds k blocks on a consistent snapshot.
//! * *No block handed out twice, none lost.* A block is removed from the stack only by
//!   the one CAS that moves `head` past it, and each block in a put batch is owned by
//!   the caller. `put` does not check ownership (that would need a per-block flag
//!   written on every take and put); the block manager guarantees it by construction,
//!   and its `check_invariants` reports a block that is on the free stack twice.
//!
//! `rust/tests/loom_page_pool.rs` model-checks these claims with 2–3 threads.

use crate::error::BlockId;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// `next` of the bottom of the stack, and `top` of an empty one.
const NIL: u32 = u32::MAX;

#[inline]
fn pack(tag: u32, top: u32) -> u64 {
    ((tag as u64) << 32) | top as u64
}

#[inline]
fn unpack(head: u64) -> (u32, u32) {
    ((head >> 32) as u32, head as u32)
}

/// Back off after a lost race (a loom yield point under `--cfg loom`).
#[inline]
fn backoff() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// A fixed set of block ids `0..capacity`, of which the free ones sit on a lock-free stack.
pub struct PagePool {
    /// `(tag << 32) | top`: `top` is the block on top of the stack (`NIL` when empty);
    /// `tag` counts the changes of `head`, against ABA.
    head: AtomicU64,
    /// `next[i]` is the block below `i` while `i` is on the stack; meaningless otherwise.
    next: Box<[AtomicU32]>,
    /// Blocks on the stack that no take has reserved yet; never above the stack's length.
    free: AtomicUsize,
}

impl PagePool {
    /// A pool of `capacity` blocks, all free; takes yield `0, 1, 2, …` first.
    ///
    /// # Panics
    /// When `capacity >= u32::MAX` (block ids are `u32` and `NIL` is reserved); the
    /// block manager validates this before.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity < NIL as usize, "PagePool capacity {capacity} must be below {NIL}");
        let next: Box<[AtomicU32]> = (0..capacity)
            .map(|i| AtomicU32::new(if i + 1 < capacity { i as u32 + 1 } else { NIL }))
            .collect();
        let top = if capacity == 0 { NIL } else { 0 };
        PagePool { head: AtomicU64::new(pack(0, top)), next, free: AtomicUsize::new(capacity) }
    }

    /// The number of block ids the pool manages, free or not.
    pub fn capacity(&self) -> usize {
        self.next.len()
    }

    /// Blocks that a take can have now (a snapshot while other threads run).
    pub fn num_free(&self) -> usize {
        self.free.load(Ordering::Acquire)
    }

    /// Takes `k` free blocks and appends them to `out`, or returns `false` and changes
    /// nothing (neither the pool nor `out`) when fewer than `k` are free.
    pub fn take_into(&self, k: usize, out: &mut Vec<BlockId>) -> bool {
        if k == 0 {
            return true;
        }
        if !self.reserve(k) {
            return false;
        }
        let start = out.len();
        out.reserve(k);
        loop {
            let head = self.head.load(Ordering::Acquire);
            let (tag, top) = unpack(head);
            out.truncate(start);
            let mut cursor = top;
            let mut complete = true;
            for _ in 0..k {
                match self.next.get(cursor as usize) {
                    Some(link) => {
                        out.push(cursor);
                        cursor = link.load(Ordering::Relaxed);
                    }
                    None => {
                        // NIL or a garbage link read during a racing push: head has moved.
                        complete = false;
                        break;
                    }
                }
            }
            if complete
                && self
                    .head
                    .compare_exchange_weak(head, pack(tag.wrapping_add(1), cursor), Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return true;
            }
            backoff();
        }
    }

    /// Takes one free block, or `None` when the pool is empty.
    pub fn take(&self) -> Option<BlockId> {
        let mut one = Vec::with_capacity(1);
        self.take_into(1, &mut one).then(|| one[0])
    }

    /// Returns blocks taken from this pool; `ids[0]` is the next one handed out.
    ///
    /// The caller must own every id (taken and not yet returned); ids out of range panic.
    pub fn put(&self, ids: &[BlockId]) {
        let Some((&first, rest)) = ids.split_first() else { return };
        debug_assert!(ids.iter().all(|&b| (b as usize) < self.capacity()), "block id out of range in {ids:?}");
        let mut last = first;
        for &id in rest {
            self.next[last as usize].store(id, Ordering::Relaxed);
            last = id;
        }
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            self.next[last as usize].store(top, Ordering::Relaxed);
            match self.head.compare_exchange_weak(head, pack(tag.wrapping_add(1), first), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => {
                    head = now;
                    backoff();
                }
            }
        }
        self.free.fetch_add(ids.len(), Ordering::Release);
    }

    /// Lowers `free` by `k` if at least `k` are free.
    fn reserve(&self, k: usize) -> bool {
        let mut free = self.free.load(Ordering::Acquire);
        loop {
            if free < k {
                return false;
            }
            match self.free.compare_exchange_weak(free, free - k, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
    }

    /// The free block ids from top to bottom. Only meaningful while no other thread
    /// uses the pool (the block manager holds `&mut`); used by invariant checks and tests.
    pub fn free_ids(&self) -> Vec<BlockId> {
        let (_, mut cursor) = unpack(self.head.load(Ordering::Acquire));
        let mut ids = Vec::with_capacity(self.num_free());
        while cursor != NIL && ids.len() <= self.capacity() {
            ids.push(cursor);
            cursor = self.next[cursor as usize].load(Ordering::Relaxed);
        }
        ids
    }
}

/// One reference count per block: how many block-table entries (or pinned copies) use it.
///
/// Shared-access methods are atomic read-modify-writes; the `_exclusive` ones are for a
/// caller holding `&mut` (the block manager) and compile to plain loads and stores.
pub struct RefCounts {
    counts: Box<[AtomicU32]>,
}

impl RefCounts {
    pub fn new(n: usize) -> Self {
        RefCounts { counts: (0..n).map(|_| AtomicU32::new(0)).collect() }
    }

    #[inline]
    pub fn get(&self, block: BlockId) -> u32 {
        self.counts[block as usize].load(Ordering::Acquire)
    }

    /// Atomically adds one; returns the new count.
    pub fn incr(&self, block: BlockId) -> u32 {
        self.counts[block as usize].fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Atomically subtracts one; returns the new count. Panics on underflow in debug builds.
    pub fn decr(&self, block: BlockId) -> u32 {
        let before = self.counts[block as usize].fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "refcount of block {block} underflowed");
        before - 1
    }

    /// Sets the count; `&mut` proves no other thread reads it.
    #[inline]
    pub fn set_exclusive(&mut self, block: BlockId, count: u32) {
        self.counts[block as usize].store(count, Ordering::Relaxed);
    }

    /// Adds `n` (plain load + store under `&mut`); returns the new count.
    #[inline]
    pub fn add_exclusive(&mut self, block: BlockId, n: u32) -> u32 {
        let slot = &self.counts[block as usize];
        let now = slot.load(Ordering::Relaxed) + n;
        slot.store(now, Ordering::Relaxed);
        now
    }

    /// Subtracts `n` (plain load + store under `&mut`); returns the new count.
    #[inline]
    pub fn sub_exclusive(&mut self, block: BlockId, n: u32) -> u32 {
        let slot = &self.counts[block as usize];
        let before = slot.load(Ordering::Relaxed);
        debug_assert!(before >= n, "refcount of block {block} underflowed ({before} - {n})");
        let now = before - n;
        slot.store(now, Ordering::Relaxed);
        now
    }

    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn takes_in_id_order_then_lifo() {
        let pool = PagePool::new(5);
        let mut out = Vec::new();
        assert!(pool.take_into(3, &mut out));
        assert_eq!(out, vec![0, 1, 2]);
        assert_eq!(pool.num_free(), 2);
        pool.put(&[2, 0]);
        assert_eq!(pool.free_ids(), vec![2, 0, 3, 4]);
        let mut again = Vec::new();
        assert!(pool.take_into(4, &mut again));
        assert_eq!(again, vec![2, 0, 3, 4]);
        assert_eq!(pool.take(), None);
    }

    #[test]
    fn short_batch_changes_nothing() {
        let pool = PagePool::new(4);
        let mut out = vec![99];
        assert!(pool.take_into(2, &mut out));
        assert!(!pool.take_into(3, &mut out));
        assert_eq!(out, vec![99, 0, 1]);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.free_ids(), vec![2, 3]);
        assert!(pool.take_into(0, &mut out));
    }

    #[test]
    fn empty_pool() {
        let pool = PagePool::new(0);
        assert_eq!(pool.take(), None);
        assert!(pool.free_ids().is_empty());
    }

    #[test]
    fn refcounts() {
        let mut rc = RefCounts::new(3);
        assert_eq!(rc.incr(1), 1);
        assert_eq!(rc.add_exclusive(1, 2), 3);
        assert_eq!(rc.decr(1), 2);
        assert_eq!(rc.sub_exclusive(1, 2), 0);
        rc.set_exclusive(2, 7);
        assert_eq!(rc.get(2), 7);
        assert_eq!(rc.len(), 3);
    }
}
