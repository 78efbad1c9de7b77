//! Continuous batching over a paged KV space: which sequences run in the next
//! step, how many tokens each, and which pages move.
//!
//! Each step fills one batch under a token budget and a sequence cap, in this order:
//! 1. running decodes (their sampled token joins the KV space now; a missing page is
//!    taken from the worst paused sequence, else the lowest-priority, latest-arrived
//!    running sequence is preempted: paused, or dropped for recompute);
//! 2. paused (swapped) sequences coming back (none in a step that preempted);
//! 3. prompt chunks of running sequences still in prefill (chunked prefill);
//! 4. new admissions from the waiting queue, while free pages stay above a watermark.
//!
//! With `SchedulerConfig::prefill_first`, a step that can admit a waiting prompt
//! runs phases 3 and 4 alone (the decodes wait one step; never two steps in a row).
//!
//! A prompt's cached prefix is skipped, and a block is committed when it is
//! scheduled, so a later request in the same step already hits it: within one
//! layer every K/V write happens before any attention read. With a sliding window
//! (`SchedulerConfig::sliding_window`), a scheduled sequence's pages wholly before the
//! window of its first query in the step are released right after that commit (see
//! `block_manager::window`), and a prompt is admitted chunk by chunk: its later chunks
//! join the KV space in phase 1, as sampled tokens do, when they are scheduled.
//!
//! The KV memory is a [`KvSpace`] (the paged interface; `paged.rs` puts the
//! `BlockManager` behind it, `contiguous.rs` adapts the baseline to it); what its
//! layout implies for scheduling is fixed at construction as [`KvRules`]. A sequence's
//! life is in `lifecycle`, the counters in `stats`, a step's after `schedule` in `steps`,
//! pinned prefixes in `pins`; draft tokens of speculative decoding in `speculation`.

mod admission;
mod cache_ops;
pub mod config;
pub mod contiguous;
pub mod kv_space;
mod lifecycle;
pub mod output;
mod page_preemption;
mod paged;
pub mod pins;
mod preemption;
mod schedule;
pub mod sequence;
mod speculation;
mod stats;
mod steps;

use crate::block_manager::IdMap;

use crate::block_manager::{BlockManager, BlockManagerConfig, CopyPairs, SeqId, TransferId};
use crate::error::CoreError;
pub use config::{
    AdmissionConfig, AdmissionPolicy, KvConfig, KvLayout, KvRules, PreemptionCost, PreemptionMode, ReservePolicy, SchedulerConfig,
};
pub use contiguous::ContiguousSpace;
pub use kv_space::KvSpace;
pub use output::SchedulerOutput;
use sequence::{SeqStatus, Sequence};
pub use stats::{CoreStats, KvUsage, SchedulerStats};

pub struct Scheduler {
    config: SchedulerConfig,
    /// What the layout implies, derived once at construction (see [`KvRules`]).
    rules: KvRules,
    kv: Box<dyn KvSpace>,
    /// By id; `IdMap` (one multiply a lookup, not SipHash: ids are the core's own, not an
    /// attacker's keys, and a step looks each running sequence up several times).
    seqs: IdMap<SeqId, Sequence>,
    waiting: Vec<SeqId>,
    running: Vec<SeqId>,
    swapped: Vec<SeqId>,
    /// Copies produced between steps (contiguous forks) that the next step must run.
    pending_copies: Vec<(u32, u32)>,
    /// Scratch of the step being planned: swap-out (device→host) and swap-in
    /// (host→device) pairs, handed out as transfers at the end of `schedule`.
    to_host: CopyPairs,
    to_device: CopyPairs,
    stats: SchedulerStats,
    /// Swap preemption moves whole sequences (the baseline) instead of pages on demand.
    whole_sequence_swap: bool,
    /// The expected-growth ratio and what finished sequences taught it.
    admission: admission::AdmissionState,
    /// The last step ran admissions without decodes (`SchedulerConfig::prefill_first`).
    last_step_skipped_decodes: bool,
    /// Steps handed out and not yet reported (see `steps`), oldest first.
    open_steps: std::collections::VecDeque<steps::OpenStep>,
    /// Id of the next step `schedule` plans (ids start at 1 and never repeat).
    next_step_id: u64,
    /// Steps that may be in flight at once; `schedule` reports older ones as done.
    max_steps_in_flight: usize,
    /// Draft tokens proposed for the next step's decodes (see `speculation`).
    proposals: IdMap<SeqId, Vec<crate::block_manager::TokenId>>,
    /// Why a `schedule` failed part-way, leaving the core in no known state: every later
    /// call that plans or records refuses with it (see `steps`).
    broken: Option<String>,
    /// Pinned prefixes, each a hidden sequence of the KV space (see `pins`).
    pins: pins::Pins,
}

impl Scheduler {
    fn from_parts(config: SchedulerConfig, rules: KvRules, kv: Box<dyn KvSpace>) -> Result<Self, CoreError> {
        config.validate()?;
        Ok(Self {
            kv,
            seqs: IdMap::default(),
            waiting: Vec::new(),
            running: Vec::new(),
            swapped: Vec::new(),
            pending_copies: Vec::new(),
            to_host: Vec::new(),
            to_device: Vec::new(),
            stats: SchedulerStats::default(),
            whole_sequence_swap: false,
            admission: admission::AdmissionState::new(&config.admission),
            last_step_skipped_decodes: false,
            open_steps: Default::default(),
            next_step_id: 1,
            max_steps_in_flight: 1,
            broken: None,
            pins: Default::default(),
            proposals: IdMap::default(),
            rules,
            config,
        })
    }

    /// The one constructor that applies the memory rules of `kv.layout` (see
    /// [`KvLayout`]): the contiguous baseline gets no host tier, no prefix caching,
    /// recompute preemption and no watermark; the paged layout gets what it asks for.
    /// The scheduler's [`KvRules`] are derived here.
    pub fn build(mut sched: SchedulerConfig, kv: KvConfig) -> Result<Self, CoreError> {
        kv.validate()?;
        match kv.layout {
            KvLayout::Paged => {
                let bm = BlockManagerConfig {
                    num_gpu_blocks: kv.num_gpu_blocks,
                    block_size: kv.block_size,
                    num_cpu_blocks: kv.effective_cpu_blocks(),
                    enable_prefix_caching: kv.enable_prefix_caching,
                    host_cache_evicted: kv.host_cache_evicted,
                    num_disk_blocks: kv.effective_disk_blocks(),
                    cache_salt: None,
                    sliding_window: None,
                    eviction_policy: kv.eviction_policy,
                };
                Self::paged_with_watermark(sched, bm, kv.watermark_blocks())
            }
            KvLayout::Contiguous(_) => {
                sched.preemption_mode = PreemptionMode::Recompute;
                Self::from_parts(sched, kv.rules(), Box::new(ContiguousSpace::new(kv.num_gpu_blocks, kv.block_size)?))
            }
        }
    }

    /// A scheduler over a paged [`BlockManager`] (its window is the scheduler's), with no
    /// watermark.
    pub fn paged(config: SchedulerConfig, bm: BlockManagerConfig) -> Result<Self, CoreError> {
        Self::paged_with_watermark(config, bm, 0)
    }

    /// A scheduler over a paged [`BlockManager`] whose admissions leave `watermark_blocks`
    /// device blocks free.
    pub fn paged_with_watermark(config: SchedulerConfig, bm: BlockManagerConfig, watermark_blocks: usize) -> Result<Self, CoreError> {
        let mut manager = BlockManager::new(BlockManagerConfig { sliding_window: config.sliding_window, ..bm })?;
        manager.set_pin_swap_in_sources(true);
        manager.set_pin_cow_sources(true);
        manager.set_defer_publish(true);
        Self::from_parts(config, KvRules { layout: KvLayout::Paged, watermark_blocks }, Box::new(manager))
    }

    /// A scheduler over the contiguous reservation baseline, each region reserving what
    /// `reserve` says. The caller's preemption mode is kept (this layout can only
    /// recompute: a swap mode falls back to it, see `preemption`).
    pub fn contiguous(config: SchedulerConfig, num_blocks: usize, block_size: usize, reserve: ReservePolicy) -> Result<Self, CoreError> {
        let rules = KvRules { layout: KvLayout::Contiguous(reserve), watermark_blocks: 0 };
        Self::from_parts(config, rules, Box::new(ContiguousSpace::new(num_blocks, block_size)?))
    }

    pub fn kv(&self) -> &dyn KvSpace {
        self.kv.as_ref()
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The layout's rules this scheduler applies (derived at construction).
    pub fn rules(&self) -> KvRules {
        self.rules
    }

    /// Seeds the persistent disk tier at startup (see [`BlockManager::seed_disk`]).
    pub fn seed_disk(&mut self, pages: &[crate::block_manager::DiskPage], invalidated: &[u64]) -> Result<usize, CoreError> {
        self.kv.seed_disk(pages, invalidated)
    }

    /// Clean shutdown: the cached pages' copies to the disk tier, handed out as transfers
    /// (report them with `complete_transfers` like a step's).
    pub fn flush_to_disk(&mut self) -> Vec<crate::block_manager::Transfer> {
        self.kv.flush_to_disk()
    }

    /// The runner finished these transfers (see [`crate::block_manager::Transfer`]).
    pub fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError> {
        self.kv.complete_transfers(ids)
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// What the layout reserves up front for a sequence of `prompt_len` tokens that may
    /// grow to `longest` (0 for the paged layout, which takes pages on demand).
    pub fn reserve_tokens(&self, longest: usize) -> usize {
        match self.rules.layout {
            KvLayout::Paged => 0,
            KvLayout::Contiguous(ReservePolicy::Request) => longest,
            KvLayout::Contiguous(ReservePolicy::MaxModelLen) => self.config.max_model_len,
        }
    }

    /// Device blocks a request of `num_samples` samples needs at worst, with the pool to
    /// itself: the prompt's full blocks once (shared by forks), and for every sample the
    /// rest of its longest possible sequence (its partly filled last prompt page is
    /// copied on write). The contiguous layout copies whole regions per sample.
    pub fn worst_case_blocks(&self, prompt_len: usize, max_tokens: usize, num_samples: usize) -> usize {
        let bs = self.kv.block_size();
        let longest = prompt_len.saturating_add(max_tokens).min(self.config.max_model_len).max(prompt_len).max(1);
        let samples = num_samples.max(1);
        match self.rules.layout {
            KvLayout::Paged => {
                let shared = prompt_len / bs;
                let all = shared.saturating_add(samples.saturating_mul(longest.div_ceil(bs) - shared));
                // A windowed sequence holds at most its window plus two steps' chunks (the
                // last one before its release, the new one), prompt chunks included.
                let window = self.config.sliding_window.map(|w| {
                    samples.saturating_mul((w.saturating_add(2 * self.config.max_num_batched_tokens)).div_ceil(bs) + 2)
                });
                window.map_or(all, |w| w.min(all))
            }
            KvLayout::Contiguous(_) => samples.saturating_mul(longest.max(self.reserve_tokens(longest)).div_ceil(bs)),
        }
    }

    /// Tokens recorded for a sequence (prompt + appended outputs).
    pub fn num_tokens(&self, id: SeqId) -> Result<usize, CoreError> {
        self.seqs.get(&id).map(|s| s.tokens.len()).ok_or(CoreError::UnknownSequence(id))
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Checks the KV space's invariants plus the scheduler's own: every sequence is
    /// in exactly the queue its status names, and running ones hold their pages.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        self.check_pins()?;
        let queues = [(&self.waiting, SeqStatus::Waiting), (&self.running, SeqStatus::Running), (&self.swapped, SeqStatus::Swapped)];
        let mut seen = 0;
        for (queue, status) in queues {
            for id in queue {
                let seq = self.seqs.get(id).ok_or_else(|| format!("queued sequence {id} is unknown"))?;
                if seq.status != status {
                    return Err(format!("sequence {id} is queued as {status:?} but has status {:?}", seq.status));
                }
                if status == SeqStatus::Running && !seq.has_pages() {
                    return Err(format!("running sequence {id} holds no pages"));
                }
                if status != SeqStatus::Swapped && seq.has_pages() && self.kv.num_host_pages(*id).map_err(|e| e.to_string())? > 0 {
                    return Err(format!("sequence {id} is {status:?} but has pages on the host; only paused ones may"));
                }
                if status == SeqStatus::Swapped && !seq.has_pages() {
                    return Err(format!("paused sequence {id} holds no pages"));
                }
                seen += 1;
            }
        }
        if seen != self.seqs.len() {
            return Err(format!("{} sequences known but {seen} queued", self.seqs.len()));
        }
        Ok(())
    }
}
