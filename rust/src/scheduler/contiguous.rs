//! The traditional baseline: each sequence reserves one contiguous run of slots
//! for the longest it may grow, up front. No sharing, no paging, no swapping.
//!
//! It exists so the benchmark can measure what paging buys with everything else
//! equal: the same scheduler loop and model code read its regions through block
//! tables that happen to be consecutive ids. Its waste is the two kinds the
//! PagedAttention paper names: reserved-but-unused slots inside a region
//! (internal) and free runs too short for the next reservation (external).
//! Free runs are kept coalesced in a `BTreeMap` and handed out first-fit.

use std::collections::{BTreeMap, HashMap};

use crate::block_manager::{BlockId, BlockManagerStats, SeqId, SwapInStatus, TokenId, Transfer, TransferId};
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

impl KvSpace for ContiguousSpace {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn num_free_blocks(&self) -> usize {
        self.num_free
    }
    fn num_free_host_blocks(&self) -> usize {
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
    fn admit(&mut self, seq: SeqId, tokens: &[TokenId], reserve_tokens: usize, _root: u64) -> Result<usize, CoreError> {
        if self.regions.contains_key(&seq) {
            return Err(CoreError::InvalidArgument(format!("sequence {seq} already has a region")));
        }
        let len = self.blocks_for(reserve_tokens.max(tokens.len()));
        let table = self.take_run(len)?;
        self.regions.insert(seq, Region { table, num_tokens: tokens.len() });
        Ok(0)
    }
    fn blocks_to_append(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError> {
        let region = self.region(seq)?;
        let capacity = region.table.len() * self.block_size;
        // A region never grows: an append past it cannot be served by any number of free blocks.
        Ok(if region.num_tokens + num_new_tokens <= capacity { 0 } else { usize::MAX })
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
    fn supports_swap(&self) -> bool {
        false
    }
    fn blocks_to_swap_out(&self, _seqs: &[SeqId]) -> Result<usize, CoreError> {
        Ok(0)
    }
    fn swap_out(&mut self, _seqs: &[SeqId]) -> Result<CopyPairs, CoreError> {
        Err(CoreError::InvalidArgument("the contiguous layout cannot swap; use preemption_mode='recompute'".into()))
    }
    fn can_swap_in(&self, _seqs: &[SeqId]) -> Result<SwapInStatus, CoreError> {
        Ok(SwapInStatus::Never)
    }
    fn swap_in(&mut self, _seqs: &[SeqId]) -> Result<CopyPairs, CoreError> {
        Err(CoreError::InvalidArgument("the contiguous layout cannot swap".into()))
    }
    fn start_transfers(&mut self, to_host: CopyPairs, to_device: CopyPairs) -> Vec<Transfer> {
        debug_assert!(to_host.is_empty() && to_device.is_empty(), "the contiguous layout never swaps");
        Vec::new()
    }
    fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError> {
        match ids.first() {
            None => Ok(()),
            Some(id) => Err(CoreError::InvalidArgument(format!("transfer {id} is not in flight: the contiguous layout has no host tier"))),
        }
    }
    fn num_pinned_host_blocks(&self) -> usize {
        0
    }
    fn block_manager_stats(&self) -> BlockManagerStats {
        BlockManagerStats::default()
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
