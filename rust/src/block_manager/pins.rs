//! Pinned prefixes: hidden sequences that hold a prompt's committed device pages so that
//! no eviction takes them (issue 27, `LLM.pin_prefix`).
//!
//! ```text
//!  prompt        | b0 | b1 | b2 |t t|      only full, committed, device-cached blocks are pinned:
//!  device cache    c7   c2   c9   -        a pin never holds a page whose K/V is unwritten
//!  pin table     | c7 | c2 | c9 |          (refcount + 1 each: invariant 2 counts the table)
//! ```
//!
//! A pin is a sequence like any other in the manager's table map (so invariants 1, 2
//! and 5 see its pages as in use, and `free` unpins it); it is only marked as a pin, so
//! that a reset of the prefix cache may run while pins are alive (their pages stay
//! cached, the rest is cleared) and so that the scheduler never schedules it. The
//! caller computes the prompt first (a prefill), and pins afterwards what it committed.

use std::collections::BTreeSet;

use super::prefix_cache::block_hash;
use super::{BlockManager, Sequence};
use crate::error::{invalid, BlockId, CoreError, SeqId, TokenId};

impl BlockManager {
    /// The leading full blocks of `tokens` (chain seeded by `root`) that the device
    /// caches now, with their chain hashes; stops at the first that it does not.
    fn device_chain(&self, tokens: &[TokenId], root: u64) -> (Vec<BlockId>, Vec<u64>) {
        let (mut blocks, mut hashes) = (Vec::new(), Vec::new());
        if !self.cfg.enable_prefix_caching {
            return (blocks, hashes);
        }
        let mut parent = root;
        for block in tokens.chunks_exact(self.cfg.block_size) {
            let h = block_hash(parent, block);
            let Some(b) = self.gpu.cache.lookup(h, parent, block) else { break };
            blocks.push(b);
            hashes.push(h);
            parent = h;
        }
        (blocks, hashes)
    }

    /// Pins the leading full blocks of `tokens` that are committed and cached on the
    /// device as the hidden sequence `seq`; returns how many pages it holds (≥ 1).
    /// Fails, nothing changed, when `seq` exists, when the manager has a sliding window or
    /// no prefix cache, or when not even the first block is cached (compute it first).
    pub fn pin_cached(&mut self, seq: SeqId, tokens: &[TokenId], root: u64) -> Result<usize, CoreError> {
        if self.seqs.contains_key(&seq) {
            return Err(invalid!("sequence id {seq} is already allocated; a pin needs a new id"));
        }
        if !self.cfg.enable_prefix_caching {
            return Err(invalid!("cannot pin a prefix with enable_prefix_caching=False: there is no prefix cache to keep it in"));
        }
        if self.cfg.sliding_window.is_some() {
            return Err(invalid!("cannot pin a prefix with a sliding window: its pages would be released out of the window"));
        }
        let bs = self.cfg.block_size;
        let (blocks, hashes) = self.device_chain(tokens, root);
        if blocks.is_empty() {
            return Err(invalid!(
                "no full block of the {} prompt tokens is cached on the device (block_size = {bs}); prefill the prompt, then pin it",
                tokens.len()
            ));
        }
        for &b in &blocks {
            self.gpu.cache.note_hit(b);
            self.gpu.retain(b, 1);
        }
        let n = blocks.len();
        self.seqs.insert(seq, Sequence::on_device(blocks, tokens[..n * bs].to_vec(), hashes, n * bs, 0, root));
        self.pinned.insert(seq);
        Ok(n)
    }

    /// Pages a pin of `tokens` would add to the pinned set: its full blocks less the
    /// leading ones that already are pinned pages (of another pin of the same prefix).
    pub fn num_new_pinned_blocks(&self, tokens: &[TokenId], root: u64) -> usize {
        let full = tokens.len() / self.cfg.block_size;
        let pinned = self.pinned_block_set();
        let (blocks, _) = self.device_chain(tokens, root);
        full - blocks.iter().filter(|b| pinned.contains(b)).count()
    }

    /// Distinct device pages that pins hold.
    pub fn num_pinned_prefix_blocks(&self) -> usize {
        self.pinned_block_set().len()
    }

    /// Whether `seq` is a pin (a hidden sequence made by [`pin_cached`](Self::pin_cached)).
    pub fn is_pin(&self, seq: SeqId) -> bool {
        self.pinned.contains(&seq)
    }

    /// The pins' sequence ids, in order.
    pub fn pin_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.pinned.iter().copied()
    }

    pub(super) fn pinned_block_set(&self) -> BTreeSet<BlockId> {
        self.pinned.iter().filter_map(|s| self.seqs.get(s)).flat_map(|s| s.table.iter().copied()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BlockManager, BlockManagerConfig};

    fn computed(bm: &mut BlockManager, seq: u64, prompt: &[u32]) {
        bm.allocate(seq, prompt).unwrap();
        bm.commit(seq, prompt.len()).unwrap();
        bm.free(seq).unwrap();
    }

    #[test]
    fn a_pin_holds_committed_pages_through_eviction_and_reset() {
        let mut bm = BlockManager::new(BlockManagerConfig::new(4, 2)).unwrap();
        let prompt = [1, 2, 3, 4, 5];
        assert!(bm.pin_cached(100, &prompt, bm.root_hash()).is_err(), "nothing computed yet: nothing to pin");
        computed(&mut bm, 1, &prompt);
        assert_eq!(bm.num_new_pinned_blocks(&prompt, bm.root_hash()), 2);
        assert_eq!(bm.pin_cached(100, &prompt, bm.root_hash()).unwrap(), 2);
        assert_eq!(bm.num_new_pinned_blocks(&prompt, bm.root_hash()), 0, "the same prefix shares the pinned pages");
        assert_eq!((bm.num_pinned_prefix_blocks(), bm.num_free_gpu_blocks()), (2, 2));
        bm.check_invariants().unwrap();
        // Two other prompts want the whole rest of the pool: the pinned pages stay.
        computed(&mut bm, 2, &[7, 7, 7, 7]);
        computed(&mut bm, 3, &[8, 8, 8, 8]);
        assert_eq!(bm.num_cached_tokens(&[1, 2, 3, 4, 9]), 4, "the pinned prefix is still a hit");
        let report = bm.reset_prefix_cache().unwrap();
        assert_eq!(report.device, 2, "the unpinned pages are cleared, the pinned ones stay");
        assert_eq!(bm.num_cached_tokens(&[1, 2, 3, 4, 9]), 4);
        bm.check_invariants().unwrap();
        bm.free(100).unwrap();
        assert_eq!((bm.num_pinned_prefix_blocks(), bm.num_free_gpu_blocks()), (0, 4));
        bm.check_invariants().unwrap();
    }

    #[test]
    fn after_a_reset_the_events_announce_the_pinned_pages_again() {
        use super::super::KvEvent;
        use crate::error::Tier;

        let mut bm = BlockManager::new(BlockManagerConfig::new(6, 2)).unwrap();
        bm.enable_kv_events();
        computed(&mut bm, 1, &[1, 2, 3, 4, 5]);
        computed(&mut bm, 2, &[7, 7, 7]);
        bm.pin_cached(100, &[1, 2, 3, 4], bm.root_hash()).unwrap();
        bm.take_kv_events();
        bm.reset_prefix_cache().unwrap();
        let events = bm.take_kv_events();
        assert!(matches!(events.first(), Some(KvEvent::AllCleared)), "{events:?}");
        let mut stored: Vec<u64> = events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Stored { tier: Tier::Gpu, hashes, .. } => Some(hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        stored.sort_unstable();
        assert_eq!(stored, bm.cached_hashes(Tier::Gpu), "a subscriber rebuilds exactly the pinned pages");
        assert_eq!(stored.len(), 2);
        bm.free(100).unwrap();
    }

    #[test]
    fn a_reset_is_still_refused_while_a_plain_sequence_holds_pages() {
        let mut bm = BlockManager::new(BlockManagerConfig::new(4, 2)).unwrap();
        computed(&mut bm, 1, &[1, 2, 3]);
        bm.pin_cached(100, &[1, 2, 3], bm.root_hash()).unwrap();
        bm.allocate(2, &[5, 6]).unwrap();
        assert!(bm.reset_prefix_cache().is_err());
        bm.free(2).unwrap();
        bm.free(100).unwrap();
        bm.check_invariants().unwrap();
    }
}
