//! What the scheduler needs from a KV memory layout, so that one scheduler loop
//! drives both the paged [`BlockManager`] and the contiguous baseline.
//!
//! The benchmark compares the two layouts with the same model code and the same
//! scheduler; only this trait's implementation differs.

pub use crate::block_manager::CopyPairs;
use crate::block_manager::{BlockId, BlockManager, BlockManagerStats, DiskPage, SeqId, SwapInStatus, TokenId, Transfer, TransferId, NULL_BLOCK};
use crate::error::CoreError;

pub trait KvSpace: Send + Sync {
    fn block_size(&self) -> usize;
    fn num_blocks(&self) -> usize;
    /// Blocks that an admission or an append may take now.
    fn num_free_blocks(&self) -> usize;
    fn num_free_host_blocks(&self) -> usize;
    /// Free blocks admitting `tokens` would consume; `reserve_tokens` is the
    /// length the sequence may grow to (the contiguous layout reserves it up front);
    /// `root` seeds its prefix-hash chain (see [`salted_root`](Self::salted_root)).
    fn blocks_to_admit(&self, tokens: &[TokenId], reserve_tokens: usize, root: u64) -> usize;
    /// Takes pages for `tokens`; returns how many leading tokens already have K/V.
    fn admit(&mut self, seq: SeqId, tokens: &[TokenId], reserve_tokens: usize, root: u64) -> Result<usize, CoreError>;
    /// The prefix-hash chain seed of prompts salted with `salt` (a layout without a
    /// prefix cache ignores it).
    fn salted_root(&self, _salt: Option<&[u8]>) -> u64 {
        0
    }
    /// Planning of step `step` starts (see [`BlockManager::begin_step`]).
    fn begin_step(&mut self, _step: u64) {}
    /// Step `step` is done: `ok` publishes what it wrote (see [`BlockManager::complete_step`]).
    fn complete_step(&mut self, _step: u64, _ok: bool) {}
    /// Transfers that will never complete (their step failed): returns the sequences whose
    /// pages they left unwritten (see [`BlockManager::fail_transfers`]).
    fn fail_transfers(&mut self, ids: &[TransferId]) -> Result<Vec<SeqId>, CoreError> {
        self.complete_transfers(ids).map(|()| Vec::new())
    }
    /// Ids of transfers handed out and not yet completed, oldest first.
    fn transfers_in_flight(&self) -> Vec<TransferId> {
        Vec::new()
    }
    /// Device pages whose content is lost (a failed step wrote them): they leave the
    /// device cache, so no later prefix lookup hits them.
    fn forget_device_pages(&mut self, _blocks: &[BlockId]) {}
    /// Whether one of `seq`'s device entries (host entries left out) is in `blocks`.
    fn device_block_table_contains(&self, seq: SeqId, blocks: &std::collections::HashSet<BlockId>) -> Result<bool, CoreError> {
        Ok(self.block_table(seq)?.iter().any(|b| blocks.contains(b)))
    }
    /// Drops disk slots whose page was lost (see [`BlockManager::invalidate_disk_slots`]).
    fn invalidate_disk_slots(&mut self, _slots: &[BlockId]) -> usize {
        0
    }
    fn blocks_to_append(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError>;
    fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<CopyPairs, CoreError>;
    fn commit(&mut self, seq: SeqId, num_computed_tokens: usize) -> Result<(), CoreError>;
    /// Child shares (paged) or copies (contiguous: returned pairs) the parent's pages.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<CopyPairs, CoreError>;
    fn free(&mut self, seq: SeqId) -> Result<(), CoreError>;
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CoreError>;
    fn slot_mapping_into(&self, seq: SeqId, start: usize, end: usize, out: &mut Vec<i64>) -> Result<(), CoreError>;
    /// Whether pages can move to the host tier (the contiguous baseline cannot).
    fn supports_swap(&self) -> bool;
    fn blocks_to_swap_out(&self, seqs: &[SeqId]) -> Result<usize, CoreError>;
    fn swap_out(&mut self, seqs: &[SeqId]) -> Result<CopyPairs, CoreError>;
    fn can_swap_in(&self, seqs: &[SeqId]) -> Result<SwapInStatus, CoreError>;
    fn swap_in(&mut self, seqs: &[SeqId]) -> Result<CopyPairs, CoreError>;
    /// Device pages of `seq` that `swap_out_pages` could free (no other user).
    fn num_swappable_pages(&self, _seq: SeqId) -> Result<usize, CoreError> {
        Ok(0)
    }
    /// Moves up to `n` of `seq`'s exclusive device pages to the host (page-granular preemption).
    fn swap_out_pages(&mut self, seq: SeqId, _n: usize) -> Result<CopyPairs, CoreError> {
        Err(CoreError::InvalidArgument(format!("cannot swap out pages of sequence {seq}: this KV layout has no host tier")))
    }
    /// Entries of `seq`'s block table that are on the host.
    fn num_host_pages(&self, _seq: SeqId) -> Result<usize, CoreError> {
        Ok(0)
    }
    /// Device blocks a paused `seq` needs to come back and record `n` more tokens: its
    /// host pages and what the append then takes (exact, unlike the scheduler's slack).
    fn blocks_to_resume(&self, seq: SeqId, n: usize) -> Result<usize, CoreError> {
        Ok(self.num_host_pages(seq)? + self.blocks_to_append(seq, n)?)
    }
    /// Whether `seq` is paused by a swap and needs `swap_in` before it runs again (a
    /// sequence holding no page at all, every one released out of its window, is paused
    /// by `swap_out` too).
    fn is_swapped(&self, seq: SeqId) -> Result<bool, CoreError> {
        Ok(self.num_host_pages(seq)? > 0)
    }
    /// The step is planned: blocks its copies on write read may go back to the pool (see
    /// [`BlockManager::set_pin_cow_sources`]); nothing takes one before the next step.
    fn release_copy_sources(&mut self) {}
    /// Hands out this step's tier copies: `to_host` and `to_device` (the scheduler's
    /// swaps) with the layout's own (evicted pages saved to the host, host prefix hits).
    fn start_transfers(&mut self, to_host: CopyPairs, to_device: CopyPairs) -> Vec<Transfer>;
    /// The runner finished these transfers; their host pins go (all-or-nothing).
    fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError>;
    /// Host blocks held by copies not yet completed.
    fn num_pinned_host_blocks(&self) -> usize;
    /// Seeds the persistent disk tier at startup (see [`BlockManager::seed_disk`]);
    /// a layout without one seeds nothing.
    fn seed_disk(&mut self, _pages: &[DiskPage], _invalidated: &[u64]) -> Result<usize, CoreError> {
        Ok(0)
    }
    /// Clean shutdown: copies of the cached pages to the disk tier, handed out.
    fn flush_to_disk(&mut self) -> Vec<Transfer> {
        Vec::new()
    }
    /// Pages cached on (device, host, disk) now.
    fn num_cached_blocks(&self) -> (usize, usize, usize) {
        (0, 0, 0)
    }
    /// Disk slots of the persistent tier (0 when off).
    fn num_disk_blocks(&self) -> usize {
        0
    }
    /// The page a disk slot caches, if any.
    fn disk_page(&self, _slot: BlockId) -> Option<DiskPage> {
        None
    }
    fn block_manager_stats(&self) -> BlockManagerStats;
    /// Token slots held for live sequences (used blocks × block size, or reserved regions).
    fn reserved_slots(&self) -> usize;
    fn check_invariants(&self) -> Result<(), String>;
    /// Releases the sequence's pages wholly before `first_needed_pos` (sliding window);
    /// returns how many. A layout without window support keeps them all.
    fn release_outside_window(&mut self, _seq: SeqId, _first_needed_pos: usize) -> Result<usize, CoreError> {
        Ok(0)
    }
    /// Leading tokens of `tokens` an admission would find cached (what `admit` would
    /// return), nothing changed.
    fn num_cached_tokens(&self, _tokens: &[TokenId], _root: u64) -> usize {
        0
    }
    /// Device pages the sequence holds (its table less window placeholders).
    fn num_held_blocks(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.block_table(seq)?.iter().filter(|&&b| b != NULL_BLOCK).count())
    }
    /// The sequence's device pages, each with its reference count (window placeholders
    /// and host entries left out), appended to `out`: admission credits a page to the
    /// holder whose finish frees it. A layout that never shares counts each page once.
    fn device_pages_with_refs(&self, seq: SeqId, out: &mut Vec<(BlockId, u32)>) -> Result<(), CoreError> {
        out.extend(self.block_table(seq)?.iter().filter(|&&b| b != NULL_BLOCK).map(|&b| (b, 1)));
        Ok(())
    }
}

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
    fn device_block_table_contains(&self, seq: SeqId, blocks: &std::collections::HashSet<BlockId>) -> Result<bool, CoreError> {
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
