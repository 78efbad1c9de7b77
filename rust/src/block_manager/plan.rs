//! The outcome of a prefix lookup, planned before anything changes: what the plain
//! lookup (`allocate`) and the windowed one (`window`) both hand to the allocation.

use crate::error::BlockId;

/// Where a leading prompt block's K/V already is.
#[derive(Debug, Clone, Copy)]
pub(super) enum Hit {
    /// A cached device block.
    Gpu(BlockId),
    /// A host block holding an evicted device block's content.
    Host(BlockId),
    /// A disk slot holding an evicted host (or device) block's content.
    Disk(BlockId),
}

/// The outcome of a prefix lookup, before anything changes.
pub(super) struct Plan {
    /// Leading blocks computed but outside the sliding window: placeholders (`NULL_BLOCK`).
    pub(super) skipped: usize,
    /// The blocks after the skipped ones whose K/V is cached.
    pub(super) hits: Vec<Hit>,
    /// Chain hash of each skipped and hit block.
    pub(super) hashes: Vec<u64>,
    /// Free device blocks the allocation consumes.
    pub(super) cost: usize,
}
