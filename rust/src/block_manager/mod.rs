//! Block tables, refcounts and copy-on-write, the prefix cache and the swap tiers:
//! every decision about which physical page holds which token.
//!
//! ```text
//!  sequence tokens   | t0 .. t15 | t16 .. t31 | t32 t33 _ _ |
//!  block table       |    7      |     2      |     9       |   (gpu block ids)
//!  slot of t33       = 9 * block_size + 1
//!  committed         |<------ hashed, cacheable ------>|       (full blocks only)
//! ```
//!
//! Files: [`tier`] (pool + refcounts + cache of one tier), [`prefix_cache`] (hashes),
//! [`eviction`] (which cached page goes first: LRU or LFU with aging), `allocate` (prefix lookup, allocate, commit), [`block_table`] (append, COW,
//! fork, free), `swap` (swapping sequences to the host), `tiers` (evicted pages moving
//! device → host → disk, miss reasons, the persistent disk tier's seeding and flush),
//! `page_swap` (a paused sequence's pages moved to the host one by one),
//! [`transfer`] (copies between tiers as values), [`window`] (pages released out of a
//! sliding window), `reset` (the prefix cache cleared on every tier; per-tier hits),
//! `pins` (pinned prefixes held as hidden sequences), `truncate` (rejected draft tokens rolled back),
//! `invariants`.
//!
//! The manager is single-owner (`&mut self`); the page pool underneath is lock-free so
//! that other components may take and return raw blocks concurrently.

mod allocate;
pub(crate) mod block_table;
pub mod eviction;
mod invariants;
pub mod kv_events;
mod lru;
mod page_swap;
mod pins;
mod plan;
pub(crate) mod prefix_cache;
mod publish;
mod reset;
mod swap;
pub(crate) mod tier;
mod tiers;
mod transfer;
mod truncate;
pub mod window;

use block_table::Sequence;
use prefix_cache::{root_seed, IdMap};
use tier::TierPool;

use crate::error::invalid;
pub use crate::error::{BlockId, CoreError, SeqId, Tier, TokenId, PLACEHOLDER_TOKEN};
pub use eviction::EvictionPolicyKind;
pub use kv_events::KvEvent;
pub use reset::PrefixCacheReset;
pub use tiers::{DiskPage, MissReason};
pub use transfer::{Transfer, TransferId};
pub use prefix_cache::prompt_block_hashes;
pub use window::NULL_BLOCK;

use tiers::MissLog;
use transfer::{Pending, Pin};

/// Block copies for the runner: (source, destination) pairs.
pub type CopyPairs = Vec<(BlockId, BlockId)>;

/// How big the tiers are and which features are on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockManagerConfig {
    /// Device blocks (pages); ≥ 1.
    pub num_gpu_blocks: usize,
    /// Tokens per block; ≥ 1.
    pub block_size: usize,
    /// Host blocks for swapping (and host-cached evictions); may be 0.
    pub num_cpu_blocks: usize,
    /// Share committed full blocks between equal prefixes.
    pub enable_prefix_caching: bool,
    /// Folded into every chain's first hash: prompts with another salt never share.
    pub cache_salt: Option<u64>,
    /// When a cached device block is evicted and the host tier has a free block, keep its
    /// content there; a later prefix hit on it becomes a host→device copy, not a recompute.
    pub host_cache_evicted: bool,
    /// Page slots of the persistent disk tier (0 = off): pages evicted from the host (or
    /// from the device when the host keeps none) go there; a prefix hit reads them back.
    pub num_disk_blocks: usize,
    /// The attention window of every layer (Mistral), ≥ 1: pages that fell out of it may
    /// be released (see [`window`]) and prefix hits need only the window. `None` (full
    /// attention, or a model that mixes full and windowed layers) keeps every page.
    pub sliding_window: Option<usize>,
    /// Which cached page every tier gives up first when it needs a block (see [`eviction`]).
    pub eviction_policy: EvictionPolicyKind,
}

impl BlockManagerConfig {
    /// `num_gpu_blocks` blocks of `block_size`, no host tier, prefix caching on.
    pub fn new(num_gpu_blocks: usize, block_size: usize) -> Self {
        BlockManagerConfig {
            num_gpu_blocks,
            block_size,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            cache_salt: None,
            host_cache_evicted: false,
            num_disk_blocks: 0,
            sliding_window: None,
            eviction_policy: EvictionPolicyKind::Lru,
        }
    }
}

/// Whether a group of swapped-out sequences can come back to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapInStatus {
    /// Enough device blocks are free (or evictable) now.
    Ok,
    /// Not now, but the device has enough blocks in total.
    Later,
    /// The group needs more blocks than the device has.
    Never,
}

/// Counters since creation. Prefix counters count blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockManagerStats {
    /// Full prompt blocks that could have been hits (all but the last token), per successful allocate.
    pub prefix_queries: u64,
    /// Of those, blocks reused from the cache (device, host and disk hits).
    pub prefix_hits: u64,
    /// Cached device blocks whose content was dropped to reuse the block.
    pub evictions: u64,
    /// Copy-on-write copies returned by append_tokens.
    pub cow_copies: u64,
    /// Device blocks copied to the host by swap_out.
    pub swap_out_blocks: u64,
    /// Host blocks copied to the device by swap_in.
    pub swap_in_blocks: u64,
    /// Prefix hits served from the host tier (a host→device copy instead of a recompute).
    pub host_cache_hits: u64,
    /// Evicted device blocks whose content was kept on the host tier.
    pub host_cache_evictions_saved: u64,
    /// Prefix hits served from the disk tier (a disk→device copy instead of a recompute).
    pub disk_cache_hits: u64,
    /// Pages copied to the disk tier (evicted from above, or flushed at shutdown).
    pub disk_writes: u64,
    /// Prompt blocks that missed, by reason (see [`MissReason`]); they add up to
    /// `prefix_queries - prefix_hits`.
    pub prefix_misses_never_seen: u64,
    pub prefix_misses_evicted: u64,
    pub prefix_misses_evicted_disk: u64,
    pub prefix_misses_invalidated: u64,
    /// Device pages released from block tables because they fell out of the sliding
    /// window (one per table entry; a page shared by forks is counted per table).
    pub window_released_blocks: u64,
    /// Disk pages dropped from the tier's index because their write or read failed.
    pub disk_pages_invalidated: u64,
    /// KV events handed out by `take_kv_events` (see `kv_events`).
    pub kv_events_published: u64,
}

/// The KV-cache memory of one model: every tier and every sequence's block table.
pub struct BlockManager {
    cfg: BlockManagerConfig,
    gpu: TierPool,
    /// Swapped sequences' pages and host-cached evicted pages (evictable, so a swap-out may reclaim them).
    cpu: TierPool,
    /// Slots of the persistent page store: cached pages only, never a sequence's table.
    disk: TierPool,
    seqs: IdMap<SeqId, Sequence>,
    stats: BlockManagerStats,
    /// Seed of every chain's first block (folds in the cache salt).
    root: u64,
    /// Copies between tiers planned and not yet handed out, with their pins: each pinned
    /// host or disk block holds one refcount until its copy completes (see `transfer`),
    /// so no swap or eviction reuses it.
    pending: Pending,
    /// Pins of copies handed out by [`start_transfers`](Self::start_transfers) and
    /// not yet completed, by transfer id.
    inflight_pins: std::collections::BTreeMap<TransferId, Vec<Pin>>,
    /// The destination tier and blocks of each transfer in flight (what a failed one
    /// leaves unwritten, see [`fail_transfers`](Self::fail_transfers)).
    inflight_dst: std::collections::BTreeMap<TransferId, (Tier, Vec<BlockId>)>,
    /// Disk slots invalidated while a copy still pinned them: they cache nothing and go
    /// back to the pool when the pin does (see [`invalidate_disk_slots`](Self::invalidate_disk_slots)).
    disk_invalidated_pinned: std::collections::BTreeSet<BlockId>,
    /// Why pages that left every tier are gone (for miss reasons).
    misses: MissLog,
    /// Id of the next transfer handed out.
    next_transfer_id: TransferId,
    /// When set (the scheduler's mode), `swap_in` keeps one pin on each host source block
    /// until its transfer completes; when not (the plain BlockManager API) it frees them at once.
    pin_swap_in_sources: bool,
    /// When set (the scheduler's mode), a copy on write keeps one pin on its source block
    /// until [`release_cow_pins`](Self::release_cow_pins): see `block_table`.
    pin_cow_sources: bool,
    /// Device blocks that copies on write read and that are pinned (`pin_cow_sources`).
    cow_pins: Vec<BlockId>,
    /// When set (the scheduler's mode), blocks a step writes join the device cache only
    /// when the step is reported complete (see `publish`).
    defer_publish: bool,
    /// Device blocks written by steps not yet reported, each pinned (see `publish`).
    publications: publish::Publications,
    /// KV events' state (see `kv_events`); None while they are off.
    kv_events: Option<kv_events::EventState>,
    /// The sequences that are pins (see `pins`): hidden from the scheduler, kept by a reset.
    pinned: std::collections::BTreeSet<SeqId>,
    /// Scratch: blocks taken in one call.
    taken: Vec<BlockId>,
    /// Scratch: (block, hash) of the device blocks evicted in one call.
    evicted: Vec<(BlockId, u64)>,
}

impl BlockManager {
    /// Validates `cfg` and builds both tiers with every block free.
    pub fn new(cfg: BlockManagerConfig) -> Result<Self, CoreError> {
        const MAX_BLOCKS: usize = u32::MAX as usize - 2;
        if cfg.block_size == 0 {
            return Err(invalid!("block_size must be at least 1, got 0"));
        }
        if cfg.num_gpu_blocks == 0 || cfg.num_gpu_blocks > MAX_BLOCKS {
            return Err(invalid!("num_gpu_blocks must be in 1..={MAX_BLOCKS}, got {}", cfg.num_gpu_blocks));
        }
        if cfg.num_cpu_blocks > MAX_BLOCKS {
            return Err(invalid!("num_cpu_blocks must be in 0..={MAX_BLOCKS}, got {}", cfg.num_cpu_blocks));
        }
        if cfg.num_disk_blocks > MAX_BLOCKS {
            return Err(invalid!("num_disk_blocks must be in 0..={MAX_BLOCKS}, got {}", cfg.num_disk_blocks));
        }
        if cfg.sliding_window == Some(0) {
            return Err(invalid!("sliding_window must be at least 1 token (or None for full attention), got 0"));
        }
        if cfg.num_gpu_blocks.max(cfg.num_cpu_blocks).checked_mul(cfg.block_size).is_none_or(|n| n > i64::MAX as usize) {
            return Err(invalid!(
                "num_blocks * block_size overflows slot ids: {} blocks of {} tokens",
                cfg.num_gpu_blocks.max(cfg.num_cpu_blocks),
                cfg.block_size
            ));
        }
        Ok(BlockManager {
            gpu: TierPool::new(cfg.num_gpu_blocks, cfg.block_size, cfg.eviction_policy),
            cpu: TierPool::new(cfg.num_cpu_blocks, cfg.block_size, cfg.eviction_policy),
            disk: TierPool::new(cfg.num_disk_blocks, cfg.block_size, cfg.eviction_policy),
            seqs: IdMap::default(),
            stats: BlockManagerStats::default(),
            root: root_seed(cfg.cache_salt),
            pending: Pending::default(),
            inflight_pins: Default::default(),
            inflight_dst: Default::default(),
            disk_invalidated_pinned: Default::default(),
            misses: MissLog::new(4 * (cfg.num_gpu_blocks + cfg.num_cpu_blocks + cfg.num_disk_blocks) + 1024),
            next_transfer_id: 1,
            pin_swap_in_sources: false,
            pin_cow_sources: false,
            cow_pins: Vec::new(),
            defer_publish: false,
            publications: Default::default(),
            kv_events: None,
            pinned: Default::default(),
            taken: Vec::new(),
            evicted: Vec::new(),
            cfg,
        })
    }

    pub fn config(&self) -> &BlockManagerConfig {
        &self.cfg
    }
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    pub fn num_gpu_blocks(&self) -> usize {
        self.cfg.num_gpu_blocks
    }
    pub fn num_cpu_blocks(&self) -> usize {
        self.cfg.num_cpu_blocks
    }
    pub fn num_disk_blocks(&self) -> usize {
        self.cfg.num_disk_blocks
    }
    /// Disk slots usable now, counting evictable cached pages.
    pub fn num_free_disk_blocks(&self) -> usize {
        self.disk.num_free()
    }
    /// Pages cached on each tier now: (device, host, disk).
    pub fn num_cached_blocks(&self) -> (usize, usize, usize) {
        (self.gpu.cache.num_cached(), self.cpu.cache.num_cached(), self.disk.cache.num_cached())
    }
    /// The seed of every chain's first block hash (a persistent store records it per page).
    pub fn root_hash(&self) -> u64 {
        self.root
    }
    /// The chain seed of prompts salted with `salt` (vLLM's per-request `cache_salt`):
    /// prompts with different salts never share a page, on any tier or across restarts
    /// (the disk tier keys pages by this chain). No salt is [`root_hash`](Self::root_hash).
    pub fn salted_root(&self, salt: Option<&[u8]>) -> u64 {
        prefix_cache::salted_root(self.root, salt)
    }
    /// The chain seed a live sequence's blocks hash under.
    pub fn root_of(&self, seq: SeqId) -> Result<u64, CoreError> {
        Ok(self.seq(seq)?.root)
    }
    /// Device blocks allocatable now, counting evictable cached blocks.
    pub fn num_free_gpu_blocks(&self) -> usize {
        self.gpu.num_free()
    }
    /// Host blocks usable now, counting evictable host-cached blocks.
    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }
    /// Live sequence ids, in no particular order.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }
    pub fn stats(&self) -> BlockManagerStats {
        self.stats
    }

    /// The sequence's block table: device block ids, or host ids for the entries that
    /// are swapped out (see [`host_entries`](Self::host_entries)); leading entries
    /// released out of the sliding window are [`window::NULL_BLOCK`].
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CoreError> {
        Ok(&self.seq(seq)?.table)
    }
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.seq(seq)?.tokens.len())
    }
    /// The sequence's tokens as recorded by allocate and append_tokens.
    pub fn tokens(&self, seq: SeqId) -> Result<&[TokenId], CoreError> {
        Ok(&self.seq(seq)?.tokens)
    }
    /// Tokens whose K/V the caller has committed.
    pub fn num_committed_tokens(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.seq(seq)?.committed)
    }
    /// Whether any of the sequence's pages is on the host (wholly or page by page).
    pub fn is_swapped(&self, seq: SeqId) -> Result<bool, CoreError> {
        Ok(self.seq(seq)?.swapped())
    }
    /// Per block-table entry, whether it is a host block (else a device block).
    pub fn host_entries(&self, seq: SeqId) -> Result<&[bool], CoreError> {
        Ok(&self.seq(seq)?.on_host)
    }
    /// How many of the sequence's block-table entries are host blocks.
    pub fn num_host_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.seq(seq)?.num_host)
    }
    /// Reference count of a device block (for tests and debugging).
    pub fn gpu_refcount(&self, block: BlockId) -> Option<u32> {
        ((block as usize) < self.cfg.num_gpu_blocks).then(|| self.gpu.refs.get(block))
    }

    /// Appends the slots (`block * block_size + offset`) of token positions `start..end`.
    pub fn slot_mapping_into(&self, seq: SeqId, start: usize, end: usize, out: &mut Vec<i64>) -> Result<(), CoreError> {
        let s = self.seq(seq)?;
        if s.swapped() {
            return Err(invalid!("sequence {seq} is swapped out; swap it in before asking for slots"));
        }
        if start > end || end > s.tokens.len() {
            return Err(invalid!(
                "slot range {start}..{end} of sequence {seq} is invalid: need start <= end <= num_tokens = {}",
                s.tokens.len()
            ));
        }
        let bs = self.cfg.block_size;
        if start < end && start / bs < s.released {
            return Err(invalid!(
                "slot range {start}..{end} of sequence {seq} starts in a page released out of the sliding window; \
                 its first {} tokens have none",
                s.released * bs
            ));
        }
        out.reserve(end - start);
        let mut pos = start;
        while pos < end {
            let block = s.table[pos / bs] as i64 * bs as i64;
            let stop = end.min((pos / bs + 1) * bs);
            out.extend((pos % bs..pos % bs + (stop - pos)).map(|off| block + off as i64));
            pos = stop;
        }
        Ok(())
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence, CoreError> {
        self.seqs.get(&seq).ok_or(CoreError::UnknownSequence(seq))
    }

    /// A live sequence that is on the device, for calls that need its device pages.
    fn seq_on_device(&self, seq: SeqId, what: &str) -> Result<&Sequence, CoreError> {
        let s = self.seq(seq)?;
        if s.swapped() {
            return Err(invalid!("cannot {what} sequence {seq}: it is swapped out; swap it in first"));
        }
        Ok(s)
    }

    /// Takes `n` device blocks into `self.taken` (cleared first); the cached pages evicted
    /// to make room move down the tiers (see `tiers`).
    /// Fails with nothing changed when fewer than `n` are free.
    fn take_gpu(&mut self, n: usize) -> Result<(), CoreError> {
        self.taken.clear();
        self.evicted.clear();
        if !self.gpu.take(n, &mut self.taken, &mut self.evicted) {
            return Err(CoreError::OutOfBlocks { tier: Tier::Gpu, needed: n, available: self.gpu.num_free() });
        }
        self.stats.evictions += self.evicted.len() as u64;
        let evicted = std::mem::take(&mut self.evicted);
        self.demote(Tier::Gpu, &evicted);
        self.evicted = evicted;
        Ok(())
    }
}
