//! [`BlockManagerConfig`]: how big the tiers are and which features are on.
//!
//! Why separate: the configuration is a plain value that callers (the scheduler, the bindings)
//! build and read on their own; the manager only validates it (`BlockManager::new`).

use super::EvictionPolicyKind;

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
    /// be released (see [`window`](super::window)) and prefix hits need only the window. `None` (full
    /// attention, or a model that mixes full and windowed layers) keeps every page.
    pub sliding_window: Option<usize>,
    /// Which cached page every tier gives up first when it needs a block (see [`eviction`](super::eviction)).
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
