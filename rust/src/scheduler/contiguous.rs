//! The traditional baseline: each sequence reserves one contiguous run of slots
//! for the longest it may grow, up front. No sharing, no paging, no swapping.
//!
//! It exists so the benchmark can measure what paging buys with everything else
//! equal: the same scheduler loop and model code read its regions through block
//! tables that happen to be consecutive ids. Its waste is the two kinds the
//! PagedAttention paper names: reserved-but-unused slots inside a region
//! (internal) and free runs too short for the next reservation (external).
//! Free runs are kept coalesced in a `BTreeMap` and handed out first-fit.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::block_manager::{BlockId, BlockManagerStats, DiskPage, PrefixCacheReset, SeqId, SwapInStatus, TokenId, Transfer, TransferId};
use crate::error::{CoreError, Tier};
use crate::scheduler::kv_space::{CopyPairs, KvSpace};

struct Region {
    /// Consecutive block ids `start .. start + table.len()`, kept as a table for `block_table`.
    table: Vec<BlockId>,
    num_tokens: usize,
}

pub struct ContiguousSpace {
    block_size: usize,
    num_blocks: usize,
    /// start -> length of each free run; runs never touch (coalesced on release).
    free_runs: BTreeMap<usize, usize>,
    num_free: usize,
    regions: HashMap<SeqId, Region>,
}

impl ContiguousSpace {
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, CoreError> {
        if block_size == 0 {
            return Err(CoreError::InvalidArgument("block_size is 0; it must be at least 1".into()));
        }
        let mut free_runs = BTreeMap::new();
        if num_blocks > 0 {
            free_runs.insert(0, num_blocks);
        }
        Ok(Self { block_size, num_blocks, free_runs, num_free: num_blocks, regions: HashMap::new() })
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size).max(1)
    }

    fn first_fit(&self, len: usize) -> Option<usize> {
        self.free_runs.iter().find(|(_, &run)| run >= len).map(|(&start, _)| start)
    }

    fn take_run(&mut self, len: usize) -> Result<Vec<BlockId>, CoreError> {
        let start = self.first_fit(len).ok_or(CoreError::OutOfBlocks {
            tier: Tier::Gpu,
            needed: len,
            available: self.largest_free_run(),
        })?;
        let run = self.free_runs.remove(&start).expect("first_fit returned a run start");
        if run > len {
            self.free_runs.insert(start + len, run - len);
        }
        self.num_free -= len;
        Ok((start..start + len).map(|b| b as BlockId).collect())
    }

    fn release_run(&mut self, start: usize, released: usize) {
        let (mut start, mut len) = (start, released);
        if let Some((&prev, &prev_len)) = self.free_runs.range(..start).next_back() {
            if prev + prev_len == start {
                self.free_runs.remove(&prev);
                start = prev;
                len += prev_len;
            }
        }
        if let Some(next_len) = self.free_runs.remove(&(start + len)) {
            len += next_len;
        }
        self.free_runs.insert(start, len);
        self.num_free += released;
    }

    fn largest_free_run(&self) -> usize {
        self.free_runs.values().copied().max().unwrap_or(0)
    }

    fn region(&self, seq: SeqId) -> Result<&Region, CoreError> {
        self.regions.get(&seq).ok_or(CoreError::UnknownSequence(seq))
    }
}

/// The baseline behind the paged interface. What it lacks it says once: no host tier
/// (`supports_swap` is false; swaps and transfers are errors naming it), no prefix cache
/// and no disk tier (nothing is ever cached, so counts are 0 and the step lifecycle has
/// nothing to publish or forget), and regions that never shrink (a window releases none).
impl KvSpace for ContiguousSpace {
    // ---- the device pool
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn num_free_blocks(&self) -> usize {
        self.num_free
    }
    fn reserved_slots(&self) -> usize {
        (self.num_blocks - self.num_free) * self.block_size
    }
    fn check_invariants(&self) -> Result<(), String> {
        let free: usize = self.free_runs.values().sum();
        let used: usize = self.regions.values().map(|r| r.table.len()).sum();
        if free != self.num_free || free + used != self.num_blocks {
            return Err(format!("contiguous space: free {free} (counter {}) + used {used} != {}", self.num_free, self.num_blocks));
        }
        Ok(())
    }

    // ---- admission: no prefix cache, so one hash chain and never a cached token
    fn salted_root(&self, _salt: Option<&[u8]>) -> u64 {
        0
    }
    /// `usize::MAX` when no free run is long enough (external fragmentation).
    fn blocks_to_admit(&self, tokens: &[TokenId], reserve_tokens: usize, _root: u64) -> usize {
        let len = self.blocks_for(reserve_tokens.max(tokens.len()));
        if self.first_fit(len).is_some() {
            len
        } else {
            usize::MAX
        }
    }
    fn num_cached_tokens(&self, _tokens: &[TokenId], _root: u64) -> usize {
        0
    }
    fn admit(&mut self, seq: SeqId, tokens: &[TokenId], reserve_tokens: usize, _root: u64) -> Result<usize, CoreError> {
        if self.regions.contains_key(&seq) {
            return Err(CoreError::InvalidArgument(format!("sequence {seq} already has a region")));
        }
        let len = self.blocks_for(reserve_tokens.max(tokens.len()));
        let table = self.take_run(len)?;
        self.regions.insert(seq, Region { table, num_tokens: tokens.len() });
        Ok(0)
    }

    // ---- a sequence's region
    fn blocks_to_append(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError> {
        let region = self.region(seq)?;
        let capacity = region.table.len() * self.block_size;
        // A region never grows: an append past it cannot be served by any number of free blocks.
        Ok(if region.num_tokens + num_new_tokens <= capacity { 0 } else { usize::MAX })
    }
    fn set_token(&mut self, seq: SeqId, _pos: usize, _token: TokenId, _in_flight: bool) -> Result<(), CoreError> {
        // no token content here (no prefix cache): only the region must exist
        self.regions.get(&seq).map(|_| ()).ok_or(CoreError::UnknownSequence(seq))
    }
    fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<CopyPairs, CoreError> {
        let block_size = self.block_size;
        let region = self.regions.get_mut(&seq).ok_or(CoreError::UnknownSequence(seq))?;
        let capacity = region.table.len() * block_size;
        if region.num_tokens + tokens.len() > capacity {
            return Err(CoreError::OutOfBlocks { tier: Tier::Gpu, needed: 1, available: 0 });
        }
        region.num_tokens += tokens.len();
        Ok(Vec::new())
    }
    /// The region stays reserved (it never shrinks); only its length goes back.
    fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize, CoreError> {
        let region = self.regions.get_mut(&seq).ok_or(CoreError::UnknownSequence(seq))?;
        if num_tokens == 0 || num_tokens > region.num_tokens {
            return Err(CoreError::InvalidArgument(format!(
                "truncate of sequence {seq}: num_tokens = {num_tokens} must be in 1..={}",
                region.num_tokens
            )));
        }
        region.num_tokens = num_tokens;
        Ok(0)
    }
    /// Nothing to publish: with no prefix cache, a computed block is reused by no one.
    fn commit(&mut self, seq: SeqId, _num_computed_tokens: usize) -> Result<(), CoreError> {
        self.region(seq).map(|_| ())
    }
    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<CopyPairs, CoreError> {
        if self.regions.contains_key(&child) {
            return Err(CoreError::InvalidArgument(format!("sequence {child} already has a region")));
        }
        let (parent_table, num_tokens) = {
            let p = self.region(parent)?;
            (p.table.clone(), p.num_tokens)
        };
        let table = self.take_run(parent_table.len())?;
        let used = num_tokens.div_ceil(self.block_size);
        let copies = parent_table.iter().zip(&table).take(used).map(|(&s, &d)| (s, d)).collect();
        self.regions.insert(child, Region { table, num_tokens });
        Ok(copies)
    }
    fn free(&mut self, seq: SeqId) -> Result<(), CoreError> {
        let region = self.regions.remove(&seq).ok_or(CoreError::UnknownSequence(seq))?;
        self.release_run(region.table[0] as usize, region.table.len());
        Ok(())
    }
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CoreError> {
        Ok(&self.region(seq)?.table)
    }
    fn slot_mapping_into(&self, seq: SeqId, start: usize, end: usize, out: &mut Vec<i64>) -> Result<(), CoreError> {
        let region = self.region(seq)?;
        if start > end || end > region.table.len() * self.block_size {
            return Err(CoreError::InvalidArgument(format!(
                "slot range {start}..{end} of sequence {seq} is outside its region of {} slots",
                region.table.len() * self.block_size
            )));
        }
        let base = region.table[0] as i64 * self.block_size as i64;
        out.extend((start..end).map(|p| base + p as i64));
        Ok(())
    }
    fn num_held_blocks(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.region(seq)?.table.len())
    }
    /// A region is never shared: each block counts once.
    fn device_pages_with_refs(&self, seq: SeqId, out: &mut Vec<(BlockId, u32)>) -> Result<(), CoreError> {
        out.extend(self.region(seq)?.table.iter().map(|&b| (b, 1)));
        Ok(())
    }
    fn device_block_table_contains(&self, seq: SeqId, blocks: &HashSet<BlockId>) -> Result<bool, CoreError> {
        Ok(self.region(seq)?.table.iter().any(|b| blocks.contains(b)))
    }
    /// A region never shrinks: nothing is released (the window still bounds attention).
    fn release_outside_window(&mut self, seq: SeqId, _first_needed_pos: usize) -> Result<usize, CoreError> {
        self.region(seq).map(|_| 0)
    }

    // ---- the step lifecycle: nothing is cached, so a step publishes and forgets nothing
    fn begin_step(&mut self, _step: u64) {}
    /// Fork copies read the parent's region, which stays the parent's: nothing is pinned.
    fn release_copy_sources(&mut self) {}
    fn complete_step(&mut self, _step: u64, _ok: bool) {}
    fn forget_device_pages(&mut self, _blocks: &[BlockId]) {}

    // ---- no host tier
    fn supports_swap(&self) -> bool {
        false
    }
    fn num_free_host_blocks(&self) -> usize {
        0
    }
    fn blocks_to_swap_out(&self, _seqs: &[SeqId]) -> Result<usize, CoreError> {
        Err(no_host_tier("swap out"))
    }
    fn swap_out(&mut self, _seqs: &[SeqId]) -> Result<CopyPairs, CoreError> {
        Err(no_host_tier("swap out"))
    }
    fn can_swap_in(&self, _seqs: &[SeqId]) -> Result<SwapInStatus, CoreError> {
        Ok(SwapInStatus::Never)
    }
    fn swap_in(&mut self, _seqs: &[SeqId]) -> Result<CopyPairs, CoreError> {
        Err(no_host_tier("swap in"))
    }
    fn num_swappable_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        self.region(seq).map(|_| 0)
    }
    fn swap_out_pages(&mut self, seq: SeqId, _n: usize) -> Result<CopyPairs, CoreError> {
        Err(no_host_tier(&format!("swap out pages of sequence {seq}")))
    }
    fn num_host_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        self.region(seq).map(|_| 0)
    }
    fn blocks_to_resume(&self, seq: SeqId, n: usize) -> Result<usize, CoreError> {
        self.blocks_to_append(seq, n)
    }
    fn is_swapped(&self, seq: SeqId) -> Result<bool, CoreError> {
        self.region(seq).map(|_| false)
    }

    // ---- transfers: with no host tier, none is ever handed out
    fn start_transfers(&mut self, to_host: CopyPairs, to_device: CopyPairs) -> Vec<Transfer> {
        debug_assert!(to_host.is_empty() && to_device.is_empty(), "the contiguous layout never swaps");
        Vec::new()
    }
    fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError> {
        match ids.first() {
            None => Ok(()),
            Some(id) => Err(no_host_tier(&format!("complete transfer {id} (none is ever in flight)"))),
        }
    }
    fn fail_transfers(&mut self, ids: &[TransferId]) -> Result<Vec<SeqId>, CoreError> {
        self.complete_transfers(ids).map(|()| Vec::new())
    }
    fn transfers_in_flight(&self) -> Vec<TransferId> {
        Vec::new()
    }
    fn num_pinned_host_blocks(&self) -> usize {
        0
    }

    // ---- no disk tier: a store opened for it seeds nothing, and shutdown flushes nothing
    fn seed_disk(&mut self, _pages: &[DiskPage], _invalidated: &[u64]) -> Result<usize, CoreError> {
        Ok(0)
    }
    fn flush_to_disk(&mut self) -> Vec<Transfer> {
        Vec::new()
    }
    fn invalidate_disk_slots(&mut self, _slots: &[BlockId]) -> usize {
        0
    }
    fn num_disk_blocks(&self) -> usize {
        0
    }
    fn disk_page(&self, _slot: BlockId) -> Option<DiskPage> {
        None
    }

    // ---- counters: nothing cached, no prefix query ever made
    fn cached_tokens_by_tier(&self, seq: SeqId) -> Result<[usize; 3], CoreError> {
        self.region(seq).map(|_| [0; 3])
    }
    fn reset_prefix_cache(&mut self) -> Result<PrefixCacheReset, CoreError> {
        Ok(PrefixCacheReset::default()) // nothing is ever cached
    }
    fn pin_cached(&mut self, _seq: SeqId, _tokens: &[TokenId], _root: u64) -> Result<usize, CoreError> {
        Err(CoreError::InvalidArgument(
            "cannot pin a prefix with kv_layout='contiguous': it has no prefix cache; use kv_layout='paged'".into(),
        ))
    }
    fn num_new_pinned_blocks(&self, tokens: &[TokenId], _root: u64) -> usize {
        tokens.len() / self.block_size() // nothing is pinned: every full block would be new
    }
    fn num_pinned_prefix_blocks(&self) -> usize {
        0
    }
    fn enable_kv_events(&mut self) {} // nothing is ever cached: no event to send
    fn take_kv_events(&mut self) -> Vec<crate::block_manager::KvEvent> {
        Vec::new()
    }
    fn cached_hashes(&self, _tier: Tier) -> Vec<u64> {
        Vec::new()
    }
    fn num_cached_blocks(&self) -> (usize, usize, usize) {
        (0, 0, 0)
    }
    fn block_manager_stats(&self) -> BlockManagerStats {
        BlockManagerStats::default()
    }
}

fn no_host_tier(what: &str) -> CoreError {
    CoreError::InvalidArgument(format!("cannot {what}: the contiguous layout has no host tier; use preemption_mode='recompute'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_and_coalescing() {
        let mut s = ContiguousSpace::new(10, 4).unwrap();
        s.admit(1, &[0; 5], 12, 0).unwrap(); // 3 blocks: 0..3
        s.admit(2, &[0; 4], 8, 0).unwrap(); // 2 blocks: 3..5
        s.admit(3, &[0; 1], 16, 0).unwrap(); // 4 blocks: 5..9
        assert_eq!(s.block_table(2).unwrap(), &[3, 4]);
        assert_eq!(s.num_free_blocks(), 1);
        s.free(1).unwrap();
        // 4 free blocks in all, but the longest run is 3: external fragmentation.
        assert_eq!(s.blocks_to_admit(&[0; 1], 16, 0), usize::MAX);
        s.free(2).unwrap();
        assert_eq!(s.blocks_to_admit(&[0; 1], 16, 0), 4);
        s.admit(4, &[0; 1], 16, 0).unwrap();
        assert_eq!(s.block_table(4).unwrap(), &[0, 1, 2, 3]);
        s.check_invariants().unwrap();
        let mut slots = Vec::new();
        s.slot_mapping_into(3, 0, 3, &mut slots).unwrap();
        assert_eq!(slots, vec![20, 21, 22]);
    }

    #[test]
    fn append_beyond_reservation_fails_without_change() {
        let mut s = ContiguousSpace::new(4, 2).unwrap();
        s.admit(1, &[0; 3], 4, 0).unwrap();
        s.append(1, &[7]).unwrap();
        assert!(s.append(1, &[8]).is_err());
        assert_eq!(s.blocks_to_append(1, 1).unwrap(), usize::MAX);
        s.free(1).unwrap();
        assert_eq!(s.num_free_blocks(), 4);
    }
}
