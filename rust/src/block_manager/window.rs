//! Sliding-window attention (Mistral): pages that fell out of a sequence's window go
//! back to the pool, and a prefix hit needs only the pages inside the window.
//!
//! With a window `W` a query at position `q` reads keys `q - W < k <= q` only. Once
//! the earliest query a sequence may still run is at `q0`, the K/V before
//! `first_needed = q0 + 1 - W` is never read again, and every block wholly before it
//! is released: its table entry becomes [`NULL_BLOCK`], its page loses one user
//! (a committed, cached page becomes evictable and stays a prefix hit), as vLLM v1's
//! `SlidingWindowManager` does with its null block.
//!
//! ```text
//!  tokens          | t0..t3 | t4..t7 | t8..t11 | t12..t15 | t16 t17 _ _ |   bs = 4, W = 6
//!  first query q0                                            ^ 17
//!  first_needed    = 17 + 1 - 6 = 12                ^
//!  block table     |  NULL  |  NULL  |  NULL   |    5     |      9      |
//! ```
//!
//! This extends DESIGN.md invariant 3: a live sequence's table gives back every token
//! at or after its first needed position; the leading `released` entries are
//! placeholders, all wholly before the committed tokens. A placeholder is never a
//! user of a page (invariant 2), is never copied by a swap, and never appears in a
//! slot mapping. Forks share placeholders like any entry; each table releases its
//! own users, and the refcounts do the rest.
//!
//! A prefix hit (`allocate`) searches from the right, as vLLM's
//! `find_longest_cache_hit` does for windows: the longest prefix of `h` full blocks
//! whose last `W` tokens before token `h * bs` are cached; the blocks before them
//! become placeholders at once and cost nothing. Every layer must attend with the
//! window: a model that mixes full and windowed layers (Gemma 2) keeps every page.

use super::plan::{Hit, Plan};
use super::prefix_cache::block_hash;
use super::BlockManager;
use crate::error::{invalid, BlockId, CoreError, SeqId, TokenId};

/// The block-table entry of a page released because it fell out of the window. Never a
/// valid block id (ids stop below `u32::MAX - 2`); in the runner's int32 block tables
/// (`SchedulerOutput::block_tables`) it reads as `-1`.
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// First position the K/V of which a query at `first_query_pos` (or later) can read.
#[inline]
pub fn first_needed_pos(first_query_pos: usize, window: usize) -> usize {
    (first_query_pos + 1).saturating_sub(window)
}

impl BlockManager {
    /// The attention window every layer uses (`None`: full attention, every page kept).
    pub fn sliding_window(&self) -> Option<usize> {
        self.cfg.sliding_window
    }

    /// Releases the pages of `seq` wholly before token `first_needed_pos` (their entries
    /// become [`NULL_BLOCK`]); returns how many were released by this call. Released
    /// pages are never given back to the sequence: only call this with a position no
    /// later query of the sequence (nor of a fork made later) can read before.
    ///
    /// Errors (nothing changed): the manager has no window, the sequence is unknown or
    /// swapped out, or `first_needed_pos` is past its committed tokens (a page whose
    /// K/V is not written yet is a prefill's, not the window's to drop).
    pub fn release_outside_window(&mut self, seq: SeqId, first_needed_pos: usize) -> Result<usize, CoreError> {
        if self.cfg.sliding_window.is_none() {
            return Err(invalid!("release_outside_window needs a BlockManager built with sliding_window=W; this one has none"));
        }
        let s = self.seq_on_device(seq, "release the window of")?;
        if first_needed_pos > s.committed {
            return Err(invalid!(
                "release_outside_window of sequence {seq}: first_needed_pos = {first_needed_pos} is past its {} committed tokens",
                s.committed
            ));
        }
        let upto = first_needed_pos / self.cfg.block_size;
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let from = s.released;
        // Front to back: the oldest page becomes the least recently used, evicted first.
        for entry in s.table.iter_mut().take(upto).skip(from) {
            let b = std::mem::replace(entry, NULL_BLOCK);
            self.gpu.release(b, 1);
        }
        self.gpu.flush();
        let released = upto.saturating_sub(from);
        s.released = s.released.max(upto);
        self.stats.window_released_blocks += released as u64;
        Ok(released)
    }

    /// Device pages the sequence's table holds (placeholders excluded).
    pub fn num_held_blocks(&self, seq: SeqId) -> Result<usize, CoreError> {
        let s = self.seq(seq)?;
        Ok(s.table.len() - s.released)
    }

    /// The prefix lookup of a windowed manager (see the module docs): the longest run of
    /// `h` eligible blocks whose window before token `h * bs` is cached on some tier.
    pub(super) fn window_plan(&self, tokens: &[TokenId], window: usize, root: u64) -> Plan {
        let bs = self.cfg.block_size;
        let num_blocks = tokens.len().div_ceil(bs);
        let mut plan = Plan { skipped: 0, hits: Vec::new(), hashes: Vec::new(), cost: num_blocks };
        if !self.cfg.enable_prefix_caching {
            return plan;
        }
        let mut found: Vec<Option<Hit>> = Vec::new();
        let mut parent = root;
        for block in tokens[..tokens.len() - 1].chunks_exact(bs) {
            let h = block_hash(parent, block);
            found.push(self.find_hit(h, parent, block));
            plan.hashes.push(h);
            parent = h;
        }
        // best = the largest h whose needed blocks [lo(h), h) are all found; `run` counts
        // the found blocks ending at block h - 1.
        let (mut best, mut best_lo, mut run) = (0, 0, 0);
        for (i, hit) in found.iter().enumerate() {
            run = if hit.is_some() { run + 1 } else { 0 };
            let h = i + 1;
            let lo = first_needed_pos(h * bs, window) / bs;
            if run >= h - lo {
                (best, best_lo) = (h, lo);
            }
        }
        plan.hashes.truncate(best);
        plan.skipped = best_lo;
        plan.hits = found[best_lo..best].iter().map(|h| h.expect("every needed block was found")).collect();
        let shared = plan.hits.iter().filter(|h| matches!(h, Hit::Gpu(b) if self.gpu.refs.get(*b) > 0)).count();
        plan.cost = num_blocks - best_lo - shared;
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_manager::{BlockManagerConfig, SwapInStatus};

    fn manager(blocks: usize, bs: usize, window: usize) -> BlockManager {
        BlockManager::new(BlockManagerConfig { sliding_window: Some(window), ..BlockManagerConfig::new(blocks, bs) }).unwrap()
    }

    fn tokens(n: u32) -> Vec<TokenId> {
        (100..100 + n).collect()
    }

    #[test]
    fn releases_blocks_wholly_before_the_first_needed_position() {
        let mut bm = manager(16, 4, 6);
        bm.allocate(1, &tokens(18)).unwrap();
        bm.commit(1, 17).unwrap();
        let table: Vec<BlockId> = bm.block_table(1).unwrap().to_vec();
        // The module diagram: the first query at 17 needs 12.. onwards.
        assert_eq!(bm.release_outside_window(1, first_needed_pos(17, 6)).unwrap(), 3);
        assert_eq!(bm.block_table(1).unwrap(), &[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, table[3], table[4]]);
        assert_eq!(bm.num_held_blocks(1).unwrap(), 2);
        assert_eq!(bm.num_free_gpu_blocks(), 14);
        assert_eq!(bm.stats().window_released_blocks, 3);
        // Released again: nothing more to give.
        assert_eq!(bm.release_outside_window(1, 12).unwrap(), 0);
        bm.check_invariants().unwrap();
        // The released pages stay cached (evictable): full, committed, hashed.
        assert_eq!(bm.num_cached_blocks().0, 4);
        bm.free(1).unwrap();
        assert_eq!(bm.num_free_gpu_blocks(), 16);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn refuses_positions_past_the_committed_tokens_and_managers_without_a_window() {
        let mut bm = manager(8, 4, 4);
        bm.allocate(1, &tokens(12)).unwrap();
        bm.commit(1, 4).unwrap();
        let err = bm.release_outside_window(1, 8).unwrap_err().to_string();
        assert!(err.contains("first_needed_pos = 8") && err.contains("4 committed"), "{err}");
        assert_eq!(bm.num_held_blocks(1).unwrap(), 3, "nothing changed");
        let mut full = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
        full.allocate(1, &tokens(8)).unwrap();
        full.commit(1, 8).unwrap();
        assert!(full.release_outside_window(1, 8).unwrap_err().to_string().contains("sliding_window"));
        assert!(matches!(bm.release_outside_window(9, 0), Err(CoreError::UnknownSequence(9))));
    }

    #[test]
    fn a_fork_keeps_the_pages_its_parent_released() {
        let mut bm = manager(16, 4, 4);
        bm.allocate(1, &tokens(16)).unwrap();
        bm.commit(1, 16).unwrap();
        bm.fork(1, 2).unwrap();
        let table: Vec<BlockId> = bm.block_table(1).unwrap().to_vec();
        assert_eq!(bm.release_outside_window(1, 12).unwrap(), 3);
        assert_eq!(bm.block_table(2).unwrap(), &table[..], "the child's table is its own");
        assert_eq!(bm.gpu_refcount(table[0]), Some(1));
        assert_eq!(bm.num_free_gpu_blocks(), 12, "shared pages stay in use");
        assert_eq!(bm.release_outside_window(2, 8).unwrap(), 2);
        assert_eq!(bm.num_free_gpu_blocks(), 14);
        // A fork of a windowed sequence shares its placeholders.
        bm.fork(1, 3).unwrap();
        assert_eq!(bm.block_table(3).unwrap()[..3], [NULL_BLOCK; 3]);
        bm.check_invariants().unwrap();
        for s in 1..=3 {
            bm.free(s).unwrap();
        }
        assert_eq!(bm.num_free_gpu_blocks(), 16);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn a_sequence_holding_no_page_still_swaps_out_and_back_in() {
        // Window 1: the next token reads only itself, so every committed page may go.
        // (Found by the property test: swap_out used to succeed without pausing such a
        // sequence, so the scheduler's later swap_in failed as "on the device".)
        let mut bm = BlockManager::new(BlockManagerConfig {
            num_cpu_blocks: 0,
            enable_prefix_caching: false, // else the prompt's first page is a placeholder at once
            sliding_window: Some(1),
            ..BlockManagerConfig::new(4, 1)
        }).unwrap();
        bm.allocate(1, &tokens(2)).unwrap();
        bm.commit(1, 2).unwrap();
        assert_eq!(bm.release_outside_window(1, 2).unwrap(), 2);
        assert_eq!(bm.num_held_blocks(1).unwrap(), 0);
        assert_eq!(bm.num_blocks_to_swap_out(&[1]).unwrap(), 0);
        assert_eq!(bm.swap_out(&[1]).unwrap(), vec![], "nothing to copy, even with no host tier");
        assert!(bm.is_swapped(1).unwrap(), "swap_out pauses it");
        bm.check_invariants().unwrap();
        assert!(bm.append_tokens(1, &[7]).unwrap_err().to_string().contains("swapped"));
        assert_eq!(bm.can_swap_in(&[1]).unwrap(), SwapInStatus::Ok);
        assert_eq!(bm.swap_in(&[1]).unwrap(), vec![]);
        assert!(!bm.is_swapped(1).unwrap());
        bm.append_tokens(1, &[7]).unwrap();
        bm.check_invariants().unwrap();
        bm.free(1).unwrap();
        assert_eq!(bm.num_free_gpu_blocks(), 4);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn a_prefix_hit_needs_only_the_window_before_the_first_computed_token() {
        let mut bm = manager(12, 4, 6);
        let prompt = tokens(21);
        bm.allocate(1, &prompt).unwrap();
        bm.commit(1, 21).unwrap();
        assert_eq!(bm.release_outside_window(1, 16).unwrap(), 4);
        bm.free(1).unwrap();
        // 7 never-cached pages and 5 cached ones, the released blocks 0..4 least recently
        // used: 9 pages evict blocks 0 and 1, where a full-attention lookup would stop.
        bm.allocate(2, &(900..936).collect::<Vec<_>>()).unwrap();
        assert_eq!(bm.stats().evictions, 2);
        bm.free(2).unwrap();
        // 5 eligible blocks; the first computed token 20 reads 15.. = blocks 3 and 4.
        assert_eq!(bm.num_blocks_to_allocate(&prompt), 3, "two evictable hits (they leave the free count) and one new page");
        assert_eq!(bm.allocate(3, &prompt).unwrap(), 20);
        let table = bm.block_table(3).unwrap();
        assert_eq!(table[..3], [NULL_BLOCK; 3]);
        assert!(table[3..].iter().all(|&b| b != NULL_BLOCK));
        assert_eq!(bm.num_held_blocks(3).unwrap(), 3);
        assert_eq!(bm.stats().prefix_hits, 5);
        assert_eq!(bm.num_committed_tokens(3).unwrap(), 20);
        bm.check_invariants().unwrap();
        bm.free(3).unwrap();
        bm.check_invariants().unwrap();
    }

    #[test]
    fn a_hit_is_the_longest_prefix_whose_window_is_cached() {
        let mut bm = manager(16, 2, 3);
        let prompt = tokens(11);
        bm.allocate(1, &prompt).unwrap();
        bm.commit(1, 11).unwrap();
        bm.free(1).unwrap();
        // free() releases the tail first, so the first eviction drops block 4 (positions 8, 9).
        bm.allocate(2, &(500..524).collect::<Vec<_>>()).unwrap();
        assert_eq!(bm.stats().evictions, 1);
        bm.free(2).unwrap();
        // h = 5 would need block 4; h = 4 (token 8 first) needs 6.. = block 3 only.
        assert_eq!(bm.allocate(3, &prompt).unwrap(), 8);
        assert_eq!(bm.block_table(3).unwrap()[..3], [NULL_BLOCK; 3]);
        assert_eq!(bm.num_held_blocks(3).unwrap(), 3, "block 3 hit, blocks 4 and 5 new");
        bm.check_invariants().unwrap();
        // The chain hashes of the placeholders are kept: committing on extends the chain.
        bm.commit(3, 11).unwrap();
        bm.check_invariants().unwrap();
        bm.free(3).unwrap();
        assert_eq!(bm.allocate(4, &prompt).unwrap(), 10, "block 4 is cached again, under the same hash");
        bm.check_invariants().unwrap();
    }
}
