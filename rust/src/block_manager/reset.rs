//! Clearing the prefix cache on every tier at once (`POST /reset_prefix_cache`), and the
//! per-tier split of a sequence's prefix hits (what a client is told hit where).
//!
//! A reset forgets every cached page of the device, the host and the disk tier: none is
//! a hit afterwards. vLLM issue 57727 is the bug this guards against: its CPU tier kept
//! serving hits after a reset that cleared only the device. Like vLLM's
//! `BlockPool.reset_prefix_cache`, a reset is refused while any sequence holds pages or
//! any copy between tiers is planned or in flight (a page being written would land in a
//! block the reset just freed): nothing changes then. Pins (see `pins`) are the one
//! exception: a reset runs while they are alive, and their pages stay cached.

use super::BlockManager;
use crate::error::{invalid, BlockId, CoreError, SeqId, Tier};

/// What a reset dropped: cached pages per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheReset {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

impl BlockManager {
    /// Prompt tokens the sequence's allocation found cached, per tier it found them on:
    /// `[device, host, disk]` (a host or disk hit was copied back to the device). Leading
    /// tokens outside a sliding window count as device hits. They add up to what
    /// `allocate` returned.
    pub fn cached_tokens_by_tier(&self, seq: SeqId) -> Result<[usize; 3], CoreError> {
        let bs = self.cfg.block_size;
        Ok(self.seq(seq)?.hit_blocks.map(|n| n * bs))
    }

    /// Forgets every cached page on every tier; returns how many each tier dropped.
    /// Refused, with nothing changed, while a sequence holds pages or a copy between
    /// tiers is planned or in flight.
    pub fn reset_prefix_cache(&mut self) -> Result<PrefixCacheReset, CoreError> {
        let holding = self.seqs.len() - self.pinned.len();
        if holding > 0 {
            return Err(invalid!(
                "cannot reset the prefix cache while {holding} sequence(s) hold pages; finish or abort them first"
            ));
        }
        let copies = self.pending.all_pins().count() + self.inflight_pins.len() + self.publications.len();
        if copies > 0 {
            return Err(invalid!(
                "cannot reset the prefix cache while {copies} page copies or step publications are in flight; \
                 complete the step first"
            ));
        }
        let pinned = self.pinned_block_set();
        let mut report = PrefixCacheReset::default();
        for tier in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
            let pool = self.pool_mut(tier);
            // Pinned pages stay cached: a pin outlives a reset.
            let cached: Vec<BlockId> = pool.cache.entries().map(|(_, b)| b).filter(|b| tier != Tier::Gpu || !pinned.contains(b)).collect();
            for &b in &cached {
                pool.forget(b);
            }
            match tier {
                Tier::Gpu => report.device = cached.len(),
                Tier::Cpu => report.host = cached.len(),
                Tier::Disk => report.disk = cached.len(),
            }
        }
        // A slot dropped while a copy pinned it went back to the pool with its pin.
        self.disk_invalidated_pinned.clear();
        self.note_all_cleared();
        self.note_still_cached(Tier::Gpu); // the pinned pages a subscriber must not drop
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BlockManager, BlockManagerConfig};

    fn manager() -> BlockManager {
        let cfg = BlockManagerConfig { num_cpu_blocks: 4, host_cache_evicted: true, num_disk_blocks: 4, ..BlockManagerConfig::new(3, 2) };
        BlockManager::new(cfg).unwrap()
    }

    /// Runs a prompt through allocate, commit, the tier copies and free.
    fn serve(bm: &mut BlockManager, seq: u64, prompt: &[u32]) -> [usize; 3] {
        bm.allocate(seq, prompt).unwrap();
        let hits = bm.cached_tokens_by_tier(seq).unwrap();
        bm.commit(seq, prompt.len()).unwrap();
        let ids: Vec<_> = bm.start_transfers(Vec::new(), Vec::new()).iter().map(|t| t.id).collect();
        bm.complete_transfers(&ids).unwrap();
        bm.free(seq).unwrap();
        hits
    }

    #[test]
    fn hits_split_by_tier_then_reset_clears_every_tier() {
        let mut bm = manager();
        let a = [1, 2, 3, 4, 5];
        assert_eq!(serve(&mut bm, 1, &a), [0, 0, 0]);
        assert_eq!(serve(&mut bm, 2, &a), [4, 0, 0], "both full blocks on the device");
        // Two other prompts push `a`'s pages off the 3-block device, down to the host.
        serve(&mut bm, 3, &[9, 9, 9, 9, 9]);
        serve(&mut bm, 4, &[8, 8, 8, 8, 8]);
        let hits = serve(&mut bm, 5, &a);
        assert_eq!(hits.iter().sum::<usize>(), 4, "still a hit, from a lower tier: {hits:?}");
        assert!(hits[1] + hits[2] > 0, "some of it came back from the host or disk: {hits:?}");
        let (d, h, k) = bm.num_cached_blocks();
        assert!(d > 0 && h > 0, "pages cached on the device and the host: {:?}", (d, h, k));

        let report = bm.reset_prefix_cache().unwrap();
        assert_eq!((report.device, report.host, report.disk), (d, h, k));
        assert_eq!(bm.num_cached_blocks(), (0, 0, 0));
        bm.check_invariants().unwrap();
        assert_eq!(serve(&mut bm, 6, &a), [0, 0, 0], "no tier serves a hit after the reset");
        assert_eq!(bm.num_free_gpu_blocks(), 3);
    }

    #[test]
    fn reset_is_refused_while_a_sequence_holds_pages() {
        let mut bm = manager();
        serve(&mut bm, 1, &[1, 2, 3, 4, 5]);
        bm.allocate(2, &[7]).unwrap(); // the one free block: nothing evicted
        let err = bm.reset_prefix_cache().unwrap_err().to_string();
        assert!(err.contains("1 sequence(s) hold pages"), "{err}");
        assert_eq!(bm.num_cached_blocks().0, 2, "nothing changed");
        bm.free(2).unwrap();
        assert_eq!(bm.reset_prefix_cache().unwrap().device, 2);
    }
}
