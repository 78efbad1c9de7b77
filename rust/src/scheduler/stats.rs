//! What the scheduler counts, and [`CoreStats`]: every counter of the scheduler and
//! its KV space in one flat value, built in one place (`Scheduler::core_stats`), that
//! the bindings hand to Python as it is.

use std::collections::HashMap;

use super::Scheduler;
use crate::block_manager::NULL_BLOCK;

/// Counters the scheduler keeps beside the KV space's own.
#[derive(Clone, Copy, Debug, Default)]
pub struct SchedulerStats {
    pub num_steps: u64,
    pub num_swap_preemptions: u64,
    pub num_recompute_preemptions: u64,
    /// Forks whose child had to wait for a region (contiguous layout, full pool): it is
    /// prefilled when admitted, like a sequence preempted by recompute.
    pub num_deferred_forks: u64,
    /// Prompt (and recomputed) tokens actually computed.
    pub prompt_tokens_computed: u64,
    /// Prompt tokens skipped thanks to the prefix cache.
    pub cached_prompt_tokens: u64,
    pub decode_tokens: u64,
    /// Steps reported failed (and the steps in flight after them).
    pub num_failed_steps: u64,
    /// Pages the scheduler's preemptions copied device→host / host→device (swap-outs and
    /// swap-ins; evicted prefix pages moving between tiers are counted by the KV space).
    pub pages_swapped_out: u64,
    pub pages_swapped_in: u64,
    /// The same, in the last step only.
    pub last_step_pages_swapped_out: u64,
    pub last_step_pages_swapped_in: u64,
    /// Draft tokens (speculative decoding) that decodes carried, and those verified.
    pub draft_tokens_scheduled: u64,
    pub draft_tokens_accepted: u64,
}

/// Snapshot of memory use for utilization reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvUsage {
    /// Token slots held by live sequences' pages (or reserved regions).
    pub reserved_slots: usize,
    /// Of those, slots holding a live token (a page shared by several sequences counts once).
    pub live_slots: usize,
}

impl Scheduler {
    /// Reserved versus live token slots of the device pool right now.
    pub fn kv_usage(&self) -> KvUsage {
        let block_size = self.kv.block_size();
        // Live slots per physical block: the longest fill any sequence has in it.
        let mut fill: HashMap<u32, usize> = HashMap::new();
        for id in &self.running {
            let seq = &self.seqs[id];
            if let Ok(table) = self.kv.block_table(*id) {
                for (i, &block) in table.iter().enumerate().filter(|(_, &b)| b != NULL_BLOCK) {
                    let filled = seq.kv_tokens.saturating_sub(i * block_size).min(block_size);
                    let entry = fill.entry(block).or_insert(0);
                    *entry = (*entry).max(filled);
                }
            }
        }
        KvUsage { reserved_slots: self.kv.reserved_slots(), live_slots: fill.values().sum() }
    }
}

/// Every counter of the scheduler ([`SchedulerStats`]) and of its KV space
/// ([`BlockManagerStats`](crate::block_manager::BlockManagerStats)) plus the KV numbers
/// of the moment, flat, named as the keys of `Scheduler.stats()` in Python (the bindings
/// hand this value over as it is, and build that dict from it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CoreStats {
    // the device and host pools
    pub num_gpu_blocks: usize,
    /// Allocatable now, evictable cached blocks included.
    pub num_free_gpu_blocks: usize,
    pub num_used_gpu_blocks: usize,
    pub num_free_cpu_blocks: usize,
    // the queues
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_swapped: usize,
    // the scheduler's counters (see `SchedulerStats`)
    pub num_steps: u64,
    /// Swap plus recompute preemptions.
    pub num_preemptions: u64,
    pub num_swap_preemptions: u64,
    pub num_recompute_preemptions: u64,
    pub num_deferred_forks: u64,
    pub num_failed_steps: u64,
    pub disk_pages_invalidated: u64,
    pub num_prompt_tokens_computed: u64,
    pub num_cached_prompt_tokens: u64,
    pub num_decode_tokens: u64,
    pub num_pages_swapped_out: u64,
    pub num_pages_swapped_in: u64,
    /// The same two, in the last step only.
    pub step_pages_swapped_out: u64,
    pub step_pages_swapped_in: u64,
    // the KV space's counters (see `BlockManagerStats`)
    pub prefix_queries: u64,
    /// Blocks reused from the cache, on any tier: device + host + disk below.
    pub prefix_hits: u64,
    pub evictions: u64,
    pub cow_copies: u64,
    pub swap_out_blocks: u64,
    pub swap_in_blocks: u64,
    pub host_cache_hits: u64,
    pub prefix_hits_device: u64,
    pub prefix_hits_host: u64,
    pub prefix_hits_disk: u64,
    pub prefix_misses_never_seen: u64,
    pub prefix_misses_evicted: u64,
    pub prefix_misses_evicted_disk: u64,
    pub prefix_misses_invalidated: u64,
    pub window_released_blocks: u64,
    /// Evicted device blocks whose content was kept on the host tier.
    pub host_cache_saves: u64,
    pub disk_writes: u64,
    /// KV events handed to the publisher (`take_kv_events`).
    pub kv_events_published: u64,
    // cached pages per tier, pins and utilization now
    pub num_disk_blocks: usize,
    pub num_cached_gpu_blocks: usize,
    pub num_cached_cpu_blocks: usize,
    pub num_cached_disk_blocks: usize,
    pub num_pinned_host_blocks: usize,
    /// Live pinned prefixes (`Scheduler::pin_prefix`) and the distinct device pages they hold.
    pub num_pins: usize,
    pub num_pinned_blocks: usize,
    /// See [`KvUsage`].
    pub reserved_slots: usize,
    pub live_slots: usize,
}

impl Scheduler {
    /// Every counter and KV number in one value: the one place they are gathered.
    pub fn core_stats(&self) -> CoreStats {
        let (kv, s) = (self.kv.as_ref(), &self.stats);
        let bm = kv.block_manager_stats();
        let usage = self.kv_usage();
        let (cached_gpu, cached_cpu, cached_disk) = kv.num_cached_blocks();
        CoreStats {
            num_gpu_blocks: kv.num_blocks(),
            num_free_gpu_blocks: kv.num_free_blocks(),
            num_used_gpu_blocks: kv.num_blocks() - kv.num_free_blocks(),
            num_free_cpu_blocks: kv.num_free_host_blocks(),
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_swapped: self.swapped.len(),
            num_steps: s.num_steps,
            num_preemptions: s.num_swap_preemptions + s.num_recompute_preemptions,
            num_swap_preemptions: s.num_swap_preemptions,
            num_recompute_preemptions: s.num_recompute_preemptions,
            num_deferred_forks: s.num_deferred_forks,
            num_failed_steps: s.num_failed_steps,
            disk_pages_invalidated: bm.disk_pages_invalidated,
            num_prompt_tokens_computed: s.prompt_tokens_computed,
            num_cached_prompt_tokens: s.cached_prompt_tokens,
            num_decode_tokens: s.decode_tokens,
            num_pages_swapped_out: s.pages_swapped_out,
            num_pages_swapped_in: s.pages_swapped_in,
            step_pages_swapped_out: s.last_step_pages_swapped_out,
            step_pages_swapped_in: s.last_step_pages_swapped_in,
            prefix_queries: bm.prefix_queries,
            prefix_hits: bm.prefix_hits,
            evictions: bm.evictions,
            cow_copies: bm.cow_copies,
            swap_out_blocks: bm.swap_out_blocks,
            swap_in_blocks: bm.swap_in_blocks,
            host_cache_hits: bm.host_cache_hits,
            prefix_hits_device: bm.prefix_hits - (bm.host_cache_hits + bm.disk_cache_hits),
            prefix_hits_host: bm.host_cache_hits,
            prefix_hits_disk: bm.disk_cache_hits,
            prefix_misses_never_seen: bm.prefix_misses_never_seen,
            prefix_misses_evicted: bm.prefix_misses_evicted,
            prefix_misses_evicted_disk: bm.prefix_misses_evicted_disk,
            prefix_misses_invalidated: bm.prefix_misses_invalidated,
            window_released_blocks: bm.window_released_blocks,
            host_cache_saves: bm.host_cache_evictions_saved,
            disk_writes: bm.disk_writes,
            kv_events_published: bm.kv_events_published,
            num_disk_blocks: kv.num_disk_blocks(),
            num_cached_gpu_blocks: cached_gpu,
            num_cached_cpu_blocks: cached_cpu,
            num_cached_disk_blocks: cached_disk,
            num_pinned_host_blocks: kv.num_pinned_host_blocks(),
            num_pins: self.pins().len(),
            num_pinned_blocks: kv.num_pinned_prefix_blocks(),
            reserved_slots: usage.reserved_slots,
            live_slots: usage.live_slots,
        }
    }
}
