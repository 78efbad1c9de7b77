//! What the scheduler needs from a KV memory layout: the paged interface, so that one
//! scheduler loop drives both the paged [`BlockManager`](crate::block_manager::BlockManager)
//! and the contiguous baseline, and the benchmark compares them with everything else equal.
//!
//! The interface is the paged one because that is what the scheduler really drives:
//! tiers, swaps, transfers, a disk tier, a sliding window, deferred publication of a
//! step's blocks, salted prefix chains. Every method is required; none has a default,
//! so no layout answers by silence:
//!
//! - `paged.rs`: the `BlockManager`, method for method.
//! - `contiguous.rs`: the baseline as an adapter. It says what it lacks once and
//!   answers the rest from that: `supports_swap` is false and every swap or transfer
//!   that would need a host tier is an error naming it; counts of host, disk and cached
//!   pages are 0 because it has none; the step lifecycle publishes and forgets nothing
//!   because it caches nothing; a window releases nothing because a region never
//!   shrinks. The scheduler asks `supports_swap` before it swaps, so those errors mean
//!   a scheduler bug, not a user's choice.

use std::collections::HashSet;

pub use crate::block_manager::CopyPairs;
use crate::block_manager::{BlockId, BlockManagerStats, DiskPage, PrefixCacheReset, SeqId, SwapInStatus, TokenId, Transfer, TransferId};
use crate::block_manager::KvEvent;
use crate::error::{CoreError, Tier};

pub trait KvSpace: Send + Sync {
    // ---- the device pool
    fn block_size(&self) -> usize;
    fn num_blocks(&self) -> usize;
    /// Blocks that an admission or an append may take now.
    fn num_free_blocks(&self) -> usize;
    /// Token slots held for live sequences (used blocks × block size, or reserved regions).
    fn reserved_slots(&self) -> usize;
    fn check_invariants(&self) -> Result<(), String>;

    // ---- admission and the prefix cache
    /// The prefix-hash chain seed of prompts salted with `salt` (a layout without a
    /// prefix cache has one chain: every salt gives the same root).
    fn salted_root(&self, salt: Option<&[u8]>) -> u64;
    /// Free blocks admitting `tokens` would consume; `reserve_tokens` is the
    /// length the sequence may grow to (the contiguous layout reserves it up front);
    /// `root` seeds its prefix-hash chain (see [`salted_root`](Self::salted_root)).
    fn blocks_to_admit(&self, tokens: &[TokenId], reserve_tokens: usize, root: u64) -> usize;
    /// Leading tokens of `tokens` an admission would find cached (what `admit` would
    /// return), nothing changed.
    fn num_cached_tokens(&self, tokens: &[TokenId], root: u64) -> usize;
    /// Takes pages for `tokens`; returns how many leading tokens already have K/V.
    fn admit(&mut self, seq: SeqId, tokens: &[TokenId], reserve_tokens: usize, root: u64) -> Result<usize, CoreError>;
    /// What `admit` found cached for `seq`, per tier it was found on: `[device, host, disk]`.
    fn cached_tokens_by_tier(&self, seq: SeqId) -> Result<[usize; 3], CoreError>;
    /// Forgets every cached page on every tier (see `BlockManager::reset_prefix_cache`);
    /// refused while a sequence holds pages.
    fn reset_prefix_cache(&mut self) -> Result<PrefixCacheReset, CoreError>;
    /// Pins the leading committed, device-cached full blocks of `tokens` as the hidden
    /// sequence `seq` (see `block_manager::pins`); returns the pages it holds. The
    /// contiguous layout caches nothing and refuses.
    fn pin_cached(&mut self, seq: SeqId, tokens: &[TokenId], root: u64) -> Result<usize, CoreError>;
    /// Pages a pin of `tokens` would add to the distinct pinned pages.
    fn num_new_pinned_blocks(&self, tokens: &[TokenId], root: u64) -> usize;
    /// Distinct device pages held by pins.
    fn num_pinned_prefix_blocks(&self) -> usize;
    /// KV events for routers (see `block_manager::kv_events`): on from now, off by default.
    fn enable_kv_events(&mut self);
    /// The cache changes since the last take (empty while off).
    fn take_kv_events(&mut self) -> Vec<KvEvent>;
    /// Sorted hashes of the pages `tier` caches now.
    fn cached_hashes(&self, tier: Tier) -> Vec<u64>;

    // ---- a sequence's pages
    fn blocks_to_append(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError>;
    fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<CopyPairs, CoreError>;
    fn commit(&mut self, seq: SeqId, num_computed_tokens: usize) -> Result<(), CoreError>;
    /// A placeholder token at `pos` is now known (asynchronous scheduling; see `BlockManager::set_token`).
    fn set_token(&mut self, seq: SeqId, pos: usize, token: TokenId, in_flight: bool) -> Result<(), CoreError>;
    /// Drops the sequence's tokens past `num_tokens` (rejected draft tokens; see
    /// `BlockManager::truncate`); returns how many pages left its table.
    fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize, CoreError>;
    /// Child shares (paged) or copies (contiguous: returned pairs) the parent's pages.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<CopyPairs, CoreError>;
    fn free(&mut self, seq: SeqId) -> Result<(), CoreError>;
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CoreError>;
    fn slot_mapping_into(&self, seq: SeqId, start: usize, end: usize, out: &mut Vec<i64>) -> Result<(), CoreError>;
    /// Device pages the sequence holds (its table less window placeholders).
    fn num_held_blocks(&self, seq: SeqId) -> Result<usize, CoreError>;
    /// The sequence's device pages, each with its reference count (window placeholders
    /// and host entries left out), appended to `out`: admission credits a page to the
    /// holder whose finish frees it.
    fn device_pages_with_refs(&self, seq: SeqId, out: &mut Vec<(BlockId, u32)>) -> Result<(), CoreError>;
    /// Whether one of `seq`'s device entries (host entries left out) is in `blocks`.
    fn device_block_table_contains(&self, seq: SeqId, blocks: &HashSet<BlockId>) -> Result<bool, CoreError>;
    /// Releases the sequence's pages wholly before `first_needed_pos` (sliding window);
    /// returns how many.
    fn release_outside_window(&mut self, seq: SeqId, first_needed_pos: usize) -> Result<usize, CoreError>;

    // ---- the step lifecycle (see `scheduler::steps`)
    /// Planning of step `step` starts (see `BlockManager::begin_step`).
    fn begin_step(&mut self, step: u64);
    /// The step is planned: blocks its copies on write read may go back to the pool (see
    /// `BlockManager::set_pin_cow_sources`); nothing takes one before the next step.
    fn release_copy_sources(&mut self);
    /// Step `step` is done: `ok` publishes what it wrote (see `BlockManager::complete_step`).
    fn complete_step(&mut self, step: u64, ok: bool);
    /// Device pages whose content is lost (a failed step wrote them): they leave the
    /// device cache, so no later prefix lookup hits them.
    fn forget_device_pages(&mut self, blocks: &[BlockId]);

    // ---- the host tier: swaps
    /// Whether pages can move to the host tier (the contiguous baseline cannot).
    fn supports_swap(&self) -> bool;
    fn num_free_host_blocks(&self) -> usize;
    fn blocks_to_swap_out(&self, seqs: &[SeqId]) -> Result<usize, CoreError>;
    fn swap_out(&mut self, seqs: &[SeqId]) -> Result<CopyPairs, CoreError>;
    fn can_swap_in(&self, seqs: &[SeqId]) -> Result<SwapInStatus, CoreError>;
    fn swap_in(&mut self, seqs: &[SeqId]) -> Result<CopyPairs, CoreError>;
    /// Device pages of `seq` that `swap_out_pages` could free (no other user).
    fn num_swappable_pages(&self, seq: SeqId) -> Result<usize, CoreError>;
    /// Moves up to `n` of `seq`'s exclusive device pages to the host (page-granular preemption).
    fn swap_out_pages(&mut self, seq: SeqId, n: usize) -> Result<CopyPairs, CoreError>;
    /// Entries of `seq`'s block table that are on the host.
    fn num_host_pages(&self, seq: SeqId) -> Result<usize, CoreError>;
    /// Device blocks a paused `seq` needs to come back and record `n` more tokens: its
    /// host pages and what the append then takes (exact, unlike the scheduler's slack).
    fn blocks_to_resume(&self, seq: SeqId, n: usize) -> Result<usize, CoreError>;
    /// Whether `seq` is paused by a swap and needs `swap_in` before it runs again (a
    /// sequence holding no page at all, every one released out of its window, is paused
    /// by `swap_out` too).
    fn is_swapped(&self, seq: SeqId) -> Result<bool, CoreError>;

    // ---- transfers between tiers
    /// Hands out this step's tier copies: `to_host` and `to_device` (the scheduler's
    /// swaps) with the layout's own (evicted pages saved to the host, host prefix hits).
    fn start_transfers(&mut self, to_host: CopyPairs, to_device: CopyPairs) -> Vec<Transfer>;
    /// The runner finished these transfers; their host pins go (all-or-nothing).
    fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError>;
    /// Transfers that will never complete (their step failed): returns the sequences whose
    /// pages they left unwritten (see `BlockManager::fail_transfers`).
    fn fail_transfers(&mut self, ids: &[TransferId]) -> Result<Vec<SeqId>, CoreError>;
    /// Ids of transfers handed out and not yet completed, oldest first.
    fn transfers_in_flight(&self) -> Vec<TransferId>;
    /// Host blocks held by copies not yet completed.
    fn num_pinned_host_blocks(&self) -> usize;

    // ---- the persistent disk tier
    /// Seeds the disk tier at startup (see `BlockManager::seed_disk`).
    fn seed_disk(&mut self, pages: &[DiskPage], invalidated: &[u64]) -> Result<usize, CoreError>;
    /// Clean shutdown: copies of the cached pages to the disk tier, handed out.
    fn flush_to_disk(&mut self) -> Vec<Transfer>;
    /// Drops disk slots whose page was lost (see `BlockManager::invalidate_disk_slots`).
    fn invalidate_disk_slots(&mut self, slots: &[BlockId]) -> usize;
    /// Disk slots of the persistent tier (0 when off).
    fn num_disk_blocks(&self) -> usize;
    /// The page a disk slot caches, if any.
    fn disk_page(&self, slot: BlockId) -> Option<DiskPage>;

    // ---- counters
    /// Pages cached on (device, host, disk) now.
    fn num_cached_blocks(&self) -> (usize, usize, usize);
    fn block_manager_stats(&self) -> BlockManagerStats;
}
