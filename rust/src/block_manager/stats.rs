//! [`BlockManagerStats`]: the manager's counters since creation.
//!
//! Why separate: a plain value copied out by `BlockManager::stats`; every part of the manager
//! bumps its own counters, so none of them owns the list.

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
    /// Prompt blocks that missed, by reason (see [`MissReason`](super::MissReason)); they add up to
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
