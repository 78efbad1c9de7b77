//! The page-cache tiers below the device: a committed page evicted from the device moves
//! down to the host tier, a page evicted from the host moves down to the disk tier, and
//! a prefix hit on either brings it back to the device (see `allocate`).
//!
//! ```text
//!   device ──evict──► host ──evict──► disk (persistent) ──evict──► forgotten
//!      ▲                 │                     │                            (miss reason kept)
//!      └──── prefix hit ─┴─────────────────────┘
//! ```
//!
//! Each tier is a [`TierPool`](super::tier::TierPool) with its own prefix cache and evictable
//! set (ordered by the manager's eviction policy, see `eviction`); the host cache lives in the swap pool (`cpu`), where a swap-out may reclaim
//! its pages (they are evictable) and idle swap space serves as cache. A page that
//! leaves the last tier is recorded in a bounded [`MissLog`], so that a later miss on it
//! says why it missed.

use std::collections::VecDeque;

use super::prefix_cache::{block_hash, IdMap};
use super::tier::TierPool;
use super::transfer::Transfer;
use super::BlockManager;
use crate::error::{invalid, BlockId, CoreError, Tier, TokenId};

/// Why a prompt block that could have been a prefix hit was not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    /// No tier ever held this block (as far as the bounded log remembers).
    NeverSeen,
    /// Evicted from the device and from the host (no lower tier could take it).
    Evicted,
    /// Evicted from the disk tier.
    EvictedFromDisk,
    /// The persistent store held it but had to ignore it (model, dtype, geometry mismatch).
    Invalidated,
}

/// The last reason each forgotten page hash left the tiers, bounded: the oldest
/// records go first once `capacity` is reached.
pub(crate) struct MissLog {
    reasons: IdMap<u64, MissReason>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl MissLog {
    pub(crate) fn new(capacity: usize) -> Self {
        MissLog { reasons: IdMap::default(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    pub(crate) fn record(&mut self, hash: u64, reason: MissReason) {
        if self.reasons.insert(hash, reason).is_none() {
            self.order.push_back(hash);
            if self.order.len() > self.capacity {
                let old = self.order.pop_front().expect("longer than capacity");
                self.reasons.remove(&old);
            }
        }
    }

    pub(crate) fn reason(&self, hash: u64) -> Option<MissReason> {
        self.reasons.get(&hash).copied()
    }
}

/// A page the persistent store holds, for [`BlockManager::seed_disk`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskPage {
    pub slot: BlockId,
    pub hash: u64,
    /// The hash of the previous block of its chain (the root seed for a first block).
    pub parent: u64,
    pub tokens: Vec<TokenId>,
}

impl BlockManager {
    pub(super) fn pool(&self, tier: Tier) -> &TierPool {
        match tier {
            Tier::Gpu => &self.gpu,
            Tier::Cpu => &self.cpu,
            Tier::Disk => &self.disk,
        }
    }

    pub(super) fn pool_mut(&mut self, tier: Tier) -> &mut TierPool {
        match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
            Tier::Disk => &mut self.disk,
        }
    }

    /// Whether `tier` keeps prefix pages evicted from the tier above it.
    pub(super) fn caches_pages(&self, tier: Tier) -> bool {
        match tier {
            Tier::Gpu => true,
            Tier::Cpu => self.cfg.host_cache_evicted && self.cfg.num_cpu_blocks > 0,
            Tier::Disk => self.cfg.num_disk_blocks > 0,
        }
    }

    /// Blocks of `from` whose cached content was just dropped to reuse them (`evicted`,
    /// (block, hash)): each moves down to the first lower tier that can take it, or is
    /// forgotten with its reason. The block's tokens are still readable in `from`'s cache.
    pub(super) fn demote(&mut self, from: Tier, evicted: &[(BlockId, u64)]) {
        for &(b, hash) in evicted {
            let below: &[Tier] = match from {
                Tier::Gpu => &[Tier::Cpu, Tier::Disk],
                Tier::Cpu => &[Tier::Disk],
                Tier::Disk => &[],
            };
            if !below.iter().any(|&to| self.save_copy(from, b, hash, to)) {
                let reason = if from == Tier::Disk { MissReason::EvictedFromDisk } else { MissReason::Evicted };
                self.misses.record(hash, reason);
            }
        }
    }

    /// Plans a copy of the page `hash` held by block `b` of `from` to a block of `to`
    /// (taking the least recently used cached block of `to` when none is free, whose own
    /// page moves further down first). Returns whether `to` holds the page afterwards.
    fn save_copy(&mut self, from: Tier, b: BlockId, hash: u64, to: Tier) -> bool {
        if !self.caches_pages(to) {
            return false;
        }
        if self.pool(to).cache.contains_hash(hash) {
            return true;
        }
        let (mut got, mut evicted) = (Vec::with_capacity(1), Vec::new());
        if !self.pool_mut(to).take(1, &mut got, &mut evicted) {
            return false; // every block of `to` is in use or pinned
        }
        // The page leaving `to` is copied out before `b`'s page lands (transfer ORDER).
        self.demote(to, &evicted);
        let src = self.pool(from);
        let (parent, tokens) = (src.cache.parent_of(b), src.cache.block_tokens(b).to_vec());
        let dst = got[0];
        let inserted = self.pool_mut(to).cache.insert(dst, hash, parent, &tokens);
        debug_assert!(inserted, "{to} block {dst} was free and did not cache {hash:#x}");
        // Refcount 1 from take is the pin until the copy completes.
        self.pending.push(from, to, (b, dst), Some((to, dst)));
        match to {
            Tier::Cpu => self.stats.host_cache_evictions_saved += 1,
            Tier::Disk => self.stats.disk_writes += 1,
            Tier::Gpu => {}
        }
        true
    }

    /// Counts the prompt blocks after the cached prefix by miss reason. A block that is
    /// cached somewhere but follows a miss (its chain broke earlier) takes the reason of
    /// the first miss.
    pub(super) fn count_misses(&mut self, tokens: &[TokenId], num_hits: usize, mut parent: u64) {
        let bs = self.cfg.block_size;
        let mut first: Option<MissReason> = None;
        for block in tokens[..tokens.len() - 1].chunks_exact(bs).skip(num_hits) {
            let h = block_hash(parent, block);
            let cached = [Tier::Gpu, Tier::Cpu, Tier::Disk].iter().any(|&t| self.pool(t).cache.contains_hash(h));
            let reason = match self.misses.reason(h) {
                Some(r) if !cached => r,
                _ if cached => first.unwrap_or(MissReason::Evicted),
                _ => MissReason::NeverSeen,
            };
            first.get_or_insert(reason);
            let s = &mut self.stats;
            match reason {
                MissReason::NeverSeen => s.prefix_misses_never_seen += 1,
                MissReason::Evicted => s.prefix_misses_evicted += 1,
                MissReason::EvictedFromDisk => s.prefix_misses_evicted_disk += 1,
                MissReason::Invalidated => s.prefix_misses_invalidated += 1,
            }
            parent = h;
        }
    }

    /// Seeds the disk tier with the pages a persistent store holds, before the tier is
    /// used: `pages` from least to most recently used (they become evictable in that
    /// order). A page is skipped when its slot is out of range or already seeded, its
    /// hash is already seeded, it has not `block_size` tokens, or its tokens do not hash
    /// to its hash under its parent (a hash alone is never trusted). `invalidated`:
    /// hashes of pages the store ignored; a later miss on one counts as invalidated.
    /// Returns how many pages were seeded.
    pub fn seed_disk(&mut self, pages: &[DiskPage], invalidated: &[u64]) -> Result<usize, CoreError> {
        let n = self.cfg.num_disk_blocks;
        if self.disk.pool.num_free() != n {
            return Err(invalid!(
                "seed_disk needs an unused disk tier: {} of its {n} slots are in use or cached already",
                n - self.disk.pool.num_free()
            ));
        }
        let mut all = Vec::with_capacity(n);
        let took = self.disk.pool.take_into(n, &mut all);
        debug_assert!(took);
        let mut seeded = vec![false; n];
        let mut count = 0;
        for p in pages {
            let ok = (p.slot as usize) < n
                && !seeded[p.slot as usize]
                && p.tokens.len() == self.cfg.block_size
                && block_hash(p.parent, &p.tokens) == p.hash
                && self.disk.cache.insert(p.slot, p.hash, p.parent, &p.tokens);
            if ok {
                seeded[p.slot as usize] = true;
                self.disk.cache.evictable.push(p.slot);
                count += 1;
            }
        }
        let mut rest: Vec<BlockId> = all.into_iter().filter(|&b| !seeded[b as usize]).collect();
        rest.sort_unstable_by(|a, b| b.cmp(a)); // lowest id on top of the free stack
        self.disk.pool.put(&rest);
        for &h in invalidated {
            if !self.disk.cache.contains_hash(h) {
                self.misses.record(h, MissReason::Invalidated);
            }
        }
        Ok(count)
    }

    /// Disk slots whose page was lost (a write that failed after it was queued, a read
    /// that failed its checksum): each leaves the disk tier's index at once, so no later
    /// prefix lookup hits it, and its slot is reused (once no copy pins it). A later
    /// miss on its page counts as invalidated. Out-of-range or uncached slots are
    /// ignored. Returns how many slots were dropped.
    pub fn invalidate_disk_slots(&mut self, slots: &[BlockId]) -> usize {
        let mut dropped = 0;
        for &b in slots {
            if b as usize >= self.cfg.num_disk_blocks {
                continue;
            }
            let Some(h) = self.disk.forget(b) else { continue };
            self.misses.record(h, MissReason::Invalidated);
            dropped += 1;
            if self.disk.refs.get(b) > 0 {
                self.disk_invalidated_pinned.insert(b); // a copy still pins it
            }
        }
        self.stats.disk_pages_invalidated += dropped as u64;
        dropped
    }

    /// The page disk slot `slot` caches (hash, parent, tokens), if any: what the runner
    /// records in the slot when it writes it.
    pub fn disk_page(&self, slot: BlockId) -> Option<DiskPage> {
        let b = slot;
        if b as usize >= self.cfg.num_disk_blocks {
            return None;
        }
        let hash = self.disk.cache.hash_of(b)?;
        Some(DiskPage { slot: b, hash, parent: self.disk.cache.parent_of(b), tokens: self.disk.cache.block_tokens(b).to_vec() })
    }

    /// The pages the disk tier caches now, least recently used first, then pinned ones
    /// (what a persistent store holds, for tests and for checking a store's index).
    pub fn disk_pages(&self) -> Vec<DiskPage> {
        let mut blocks: Vec<BlockId> = self.disk.cache.evictable.iter().collect();
        let pinned = self.disk.cache.entries().map(|(_, b)| b).filter(|&b| self.disk.refs.get(b) > 0);
        blocks.extend(pinned.collect::<Vec<_>>());
        blocks
            .into_iter()
            .map(|b| DiskPage {
                slot: b,
                hash: self.disk.cache.hash_of(b).expect("cached"),
                parent: self.disk.cache.parent_of(b),
                tokens: self.disk.cache.block_tokens(b).to_vec(),
            })
            .collect()
    }

    /// Clean shutdown: plans a copy to the disk tier of every page cached on the host
    /// or the device that the disk does not hold yet, least valuable first (host LRU,
    /// device LRU, then pages of live sequences), so that when the disk is too small the
    /// most recently used pages are the ones kept. Returns the transfers, handed out.
    pub fn flush_to_disk(&mut self) -> Vec<Transfer> {
        if self.caches_pages(Tier::Disk) {
            let mut order: Vec<(Tier, BlockId)> = Vec::new();
            for tier in [Tier::Cpu, Tier::Gpu] {
                order.extend(self.pool(tier).cache.evictable.iter().map(|b| (tier, b)));
            }
            let in_use = self.gpu.cache.entries().filter(|&(_, b)| self.gpu.refs.get(b) > 0).map(|(_, b)| (Tier::Gpu, b));
            order.extend(in_use.collect::<Vec<_>>());
            let skip = order.len().saturating_sub(self.cfg.num_disk_blocks);
            for (tier, b) in order.into_iter().skip(skip) {
                let hash = self.pool(tier).cache.hash_of(b).expect("cached blocks are hashed");
                self.save_copy(tier, b, hash, Tier::Disk);
            }
        }
        self.start_transfers(Vec::new(), Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miss_log_forgets_oldest_first() {
        let mut log = MissLog::new(2);
        log.record(1, MissReason::Evicted);
        log.record(2, MissReason::EvictedFromDisk);
        log.record(1, MissReason::Invalidated); // update, no new slot
        log.record(3, MissReason::Evicted);
        assert_eq!(log.reason(1), None);
        assert_eq!(log.reason(2), Some(MissReason::EvictedFromDisk));
        assert_eq!(log.reason(3), Some(MissReason::Evicted));
    }
}
