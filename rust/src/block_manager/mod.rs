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
//! `invariants`, `config` / `stats` (the public configuration and counters), `queries`
//! (read-only accessors).
//!
//! The manager is single-owner (`&mut self`); the page pool underneath is lock-free so
//! that other components may take and return raw blocks concurrently.

mod allocate;
pub(crate) mod block_table;
mod config;
pub mod eviction;
mod footprint;
mod invariants;
pub mod kv_events;
mod lru;
mod page_swap;
mod pins;
mod plan;
pub(crate) mod prefix_cache;
mod publish;
mod queries;
mod reset;
mod stats;
mod swap;
pub(crate) mod tier;
mod tiers;
mod transfer;
mod truncate;
pub mod window;

use block_table::Sequence;
pub(crate) use prefix_cache::IdMap;
use prefix_cache::root_seed;
use tier::TierPool;

use crate::error::invalid;
pub use config::BlockManagerConfig;
pub use crate::error::{BlockId, CoreError, SeqId, Tier, TokenId, PLACEHOLDER_TOKEN};
pub use eviction::EvictionPolicyKind;
pub use kv_events::KvEvent;
pub use reset::PrefixCacheReset;
pub use stats::BlockManagerStats;
pub use tiers::{DiskPage, MissReason};
pub use transfer::{Transfer, TransferId};
pub use prefix_cache::prompt_block_hashes;
pub use window::NULL_BLOCK;

use tiers::MissLog;
use transfer::{Pending, Pin};

/// Block copies for the runner: (source, destination) pairs.
pub type CopyPairs = Vec<(BlockId, BlockId)>;

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
        footprint::check([cfg.num_gpu_blocks, cfg.num_cpu_blocks, cfg.num_disk_blocks], cfg.block_size)?;
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
