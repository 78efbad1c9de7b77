//! The paged layout behind [`KvSpace`]: the [`BlockManager`], method for method.

use std::collections::HashSet;

use super::kv_space::{CopyPairs, KvSpace};
use crate::block_manager::{BlockId, BlockManager, BlockManagerStats, DiskPage, PrefixCacheReset, SeqId, SwapInStatus, TokenId, Transfer, TransferId, NULL_BLOCK};
use crate::block_manager::KvEvent;
use crate::error::{CoreError, Tier};

impl KvSpace for BlockManager {
    fn block_size(&self) -> usize {
        BlockManager::block_size(self)
    }
    fn num_blocks(&self) -> usize {
        self.num_gpu_blocks()
    }
    fn num_free_blocks(&self) -> usize {
        self.num_free_gpu_blocks()
    }
    fn num_free_host_blocks(&self) -> usize {
        self.num_free_cpu_blocks()
    }
    fn blocks_to_admit(&self, tokens: &[TokenId], _reserve_tokens: usize, root: u64) -> usize {
        self.num_blocks_to_allocate_under(tokens, root)
    }
    fn admit(&mut self, seq: SeqId, tokens: &[TokenId], _reserve_tokens: usize, root: u64) -> Result<usize, CoreError> {
        self.allocate_under(seq, tokens, root)
    }
    fn salted_root(&self, salt: Option<&[u8]>) -> u64 {
        BlockManager::salted_root(self, salt)
    }
    fn cached_tokens_by_tier(&self, seq: SeqId) -> Result<[usize; 3], CoreError> {
        BlockManager::cached_tokens_by_tier(self, seq)
    }
    fn reset_prefix_cache(&mut self) -> Result<PrefixCacheReset, CoreError> {
        BlockManager::reset_prefix_cache(self)
    }
    fn pin_cached(&mut self, seq: SeqId, tokens: &[TokenId], root: u64) -> Result<usize, CoreError> {
        BlockManager::pin_cached(self, seq, tokens, root)
    }
    fn num_new_pinned_blocks(&self, tokens: &[TokenId], root: u64) -> usize {
        BlockManager::num_new_pinned_blocks(self, tokens, root)
    }
    fn num_pinned_prefix_blocks(&self) -> usize {
        BlockManager::num_pinned_prefix_blocks(self)
    }
    fn enable_kv_events(&mut self) {
        BlockManager::enable_kv_events(self)
    }
    fn take_kv_events(&mut self) -> Vec<KvEvent> {
        BlockManager::take_kv_events(self)
    }
    fn cached_hashes(&self, tier: Tier) -> Vec<u64> {
        BlockManager::cached_hashes(self, tier)
    }
    fn begin_step(&mut self, step: u64) {
        BlockManager::begin_step(self, step)
    }
    fn complete_step(&mut self, step: u64, ok: bool) {
        BlockManager::complete_step(self, step, ok);
    }
    fn fail_transfers(&mut self, ids: &[TransferId]) -> Result<Vec<SeqId>, CoreError> {
        BlockManager::fail_transfers(self, ids)
    }
    fn transfers_in_flight(&self) -> Vec<TransferId> {
        BlockManager::transfers_in_flight(self)
    }
    fn invalidate_disk_slots(&mut self, slots: &[BlockId]) -> usize {
        BlockManager::invalidate_disk_slots(self, slots)
    }
    fn forget_device_pages(&mut self, blocks: &[BlockId]) {
        BlockManager::forget_device_pages(self, blocks)
    }
    fn device_block_table_contains(&self, seq: SeqId, blocks: &HashSet<BlockId>) -> Result<bool, CoreError> {
        let table = BlockManager::block_table(self, seq)?;
        let on_host = self.host_entries(seq)?;
        Ok(table.iter().zip(on_host).any(|(b, &host)| !host && *b != NULL_BLOCK && blocks.contains(b)))
    }
    fn blocks_to_append(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError> {
        self.num_blocks_to_append(seq, num_new_tokens)
    }
    fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<CopyPairs, CoreError> {
        self.append_tokens(seq, tokens)
    }
    fn commit(&mut self, seq: SeqId, num_computed_tokens: usize) -> Result<(), CoreError> {
        BlockManager::commit(self, seq, num_computed_tokens)
    }
    fn set_token(&mut self, seq: SeqId, pos: usize, token: TokenId, in_flight: bool) -> Result<(), CoreError> {
        BlockManager::set_token(self, seq, pos, token, in_flight)
    }
    fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize, CoreError> {
        BlockManager::truncate(self, seq, num_tokens)
    }
    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<CopyPairs, CoreError> {
        BlockManager::fork(self, parent, child).map(|()| Vec::new())
    }
    fn free(&mut self, seq: SeqId) -> Result<(), CoreError> {
        BlockManager::free(self, seq)
    }
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CoreError> {
        BlockManager::block_table(self, seq)
    }
    fn device_pages_with_refs(&self, seq: SeqId, out: &mut Vec<(BlockId, u32)>) -> Result<(), CoreError> {
        let table = BlockManager::block_table(self, seq)?;
        let on_host = self.host_entries(seq)?;
        for (&block, &host) in table.iter().zip(on_host) {
            if block != NULL_BLOCK && !host {
                out.push((block, self.gpu_refcount(block).unwrap_or(0)));
            }
        }
        Ok(())
    }
    fn slot_mapping_into(&self, seq: SeqId, start: usize, end: usize, out: &mut Vec<i64>) -> Result<(), CoreError> {
        BlockManager::slot_mapping_into(self, seq, start, end, out)
    }
    fn supports_swap(&self) -> bool {
        self.num_cpu_blocks() > 0
    }
    fn blocks_to_swap_out(&self, seqs: &[SeqId]) -> Result<usize, CoreError> {
        self.num_blocks_to_swap_out(seqs)
    }
    fn swap_out(&mut self, seqs: &[SeqId]) -> Result<CopyPairs, CoreError> {
        BlockManager::swap_out(self, seqs)
    }
    fn can_swap_in(&self, seqs: &[SeqId]) -> Result<SwapInStatus, CoreError> {
        BlockManager::can_swap_in(self, seqs)
    }
    fn swap_in(&mut self, seqs: &[SeqId]) -> Result<CopyPairs, CoreError> {
        BlockManager::swap_in(self, seqs)
    }
    fn num_swappable_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        BlockManager::num_swappable_pages(self, seq)
    }
    fn swap_out_pages(&mut self, seq: SeqId, n: usize) -> Result<CopyPairs, CoreError> {
        BlockManager::swap_out_pages(self, seq, n)
    }
    fn num_host_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        BlockManager::num_host_pages(self, seq)
    }
    fn is_swapped(&self, seq: SeqId) -> Result<bool, CoreError> {
        BlockManager::is_swapped(self, seq)
    }
    fn blocks_to_resume(&self, seq: SeqId, n: usize) -> Result<usize, CoreError> {
        BlockManager::num_blocks_to_resume(self, seq, n)
    }
    fn start_transfers(&mut self, to_host: CopyPairs, to_device: CopyPairs) -> Vec<Transfer> {
        BlockManager::start_transfers(self, to_host, to_device)
    }
    fn release_copy_sources(&mut self) {
        BlockManager::release_cow_pins(self)
    }
    fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError> {
        BlockManager::complete_transfers(self, ids)
    }
    fn num_pinned_host_blocks(&self) -> usize {
        BlockManager::num_pinned_host_blocks(self)
    }
    fn seed_disk(&mut self, pages: &[DiskPage], invalidated: &[u64]) -> Result<usize, CoreError> {
        BlockManager::seed_disk(self, pages, invalidated)
    }
    fn flush_to_disk(&mut self) -> Vec<Transfer> {
        BlockManager::flush_to_disk(self)
    }
    fn num_cached_blocks(&self) -> (usize, usize, usize) {
        BlockManager::num_cached_blocks(self)
    }
    fn num_disk_blocks(&self) -> usize {
        BlockManager::num_disk_blocks(self)
    }
    fn disk_page(&self, slot: BlockId) -> Option<DiskPage> {
        BlockManager::disk_page(self, slot)
    }
    fn block_manager_stats(&self) -> BlockManagerStats {
        self.stats()
    }
    fn reserved_slots(&self) -> usize {
        // Cached evictable blocks are free for allocation, so they hold nothing for a live request.
        (self.num_gpu_blocks() - self.num_free_gpu_blocks()) * BlockManager::block_size(self)
    }
    fn check_invariants(&self) -> Result<(), String> {
        BlockManager::check_invariants(self)
    }
    fn release_outside_window(&mut self, seq: SeqId, first_needed_pos: usize) -> Result<usize, CoreError> {
        match self.sliding_window() {
            Some(_) => BlockManager::release_outside_window(self, seq, first_needed_pos),
            None => Ok(0),
        }
    }
    fn num_held_blocks(&self, seq: SeqId) -> Result<usize, CoreError> {
        BlockManager::num_held_blocks(self, seq)
    }
    fn num_cached_tokens(&self, tokens: &[TokenId], root: u64) -> usize {
        BlockManager::num_cached_tokens_under(self, tokens, root)
    }
}
