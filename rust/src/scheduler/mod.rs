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

mod admission;
pub mod config;
pub mod contiguous;
pub mod kv_space;
pub mod output;
mod page_preemption;
mod preemption;
mod schedule;
pub mod sequence;
mod steps;

use std::collections::HashMap;

use crate::block_manager::{BlockManager, BlockManagerConfig, CopyPairs, SeqId, TokenId, TransferId};
use crate::error::CoreError;
pub use config::{AdmissionConfig, AdmissionPolicy, KvConfig, KvLayout, PreemptionCost, PreemptionMode, ReservePolicy, SchedulerConfig};
pub use contiguous::ContiguousSpace;
pub use kv_space::KvSpace;
pub use output::SchedulerOutput;
use sequence::{SeqStatus, Sequence};

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
}

/// Snapshot of memory use for utilization reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvUsage {
    /// Token slots held by live sequences' pages (or reserved regions).
    pub reserved_slots: usize,
    /// Of those, slots holding a live token (a page shared by several sequences counts once).
    pub live_slots: usize,
}

pub struct Scheduler {
    config: SchedulerConfig,
    kv: Box<dyn KvSpace>,
    seqs: HashMap<SeqId, Sequence>,
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
    /// Why a `schedule` failed part-way, leaving the core in no known state: every later
    /// call that plans or records refuses with it (see `steps`).
    broken: Option<String>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: Box<dyn KvSpace>) -> Result<Self, CoreError> {
        config.validate()?;
        Ok(Self {
            kv,
            seqs: HashMap::new(),
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
            config,
        })
    }

    /// The one constructor that applies the memory rules of `kv.layout` (see
    /// [`KvLayout`]): the contiguous baseline gets no host tier, no prefix caching,
    /// recompute preemption and no watermark; the paged layout gets what it asks for.
    /// `sched.layout` and `sched.watermark_blocks` are derived here.
    pub fn build(mut sched: SchedulerConfig, kv: KvConfig) -> Result<Self, CoreError> {
        kv.validate()?;
        sched.layout = kv.layout;
        sched.watermark_blocks = kv.watermark_blocks();
        match kv.layout {
            KvLayout::Paged => {
                let mut bm = BlockManager::new(BlockManagerConfig {
                    num_gpu_blocks: kv.num_gpu_blocks,
                    block_size: kv.block_size,
                    num_cpu_blocks: kv.effective_cpu_blocks(),
                    enable_prefix_caching: kv.enable_prefix_caching,
                    host_cache_evicted: kv.host_cache_evicted,
                    num_disk_blocks: kv.effective_disk_blocks(),
                    cache_salt: None,
                    sliding_window: sched.sliding_window,
                })?;
                bm.set_pin_swap_in_sources(true);
                bm.set_pin_cow_sources(true);
                bm.set_defer_publish(true);
                Self::new(sched, Box::new(bm))
            }
            KvLayout::Contiguous(_) => {
                sched.preemption_mode = PreemptionMode::Recompute;
                Self::new(sched, Box::new(ContiguousSpace::new(kv.num_gpu_blocks, kv.block_size)?))
            }
        }
    }

    /// A scheduler over a paged [`BlockManager`] (its window is the scheduler's).
    pub fn paged(config: SchedulerConfig, bm: BlockManagerConfig) -> Result<Self, CoreError> {
        let mut manager = BlockManager::new(BlockManagerConfig { sliding_window: config.sliding_window, ..bm })?;
        manager.set_pin_swap_in_sources(true);
        manager.set_pin_cow_sources(true);
        manager.set_defer_publish(true);
        Self::new(SchedulerConfig { layout: KvLayout::Paged, ..config }, Box::new(manager))
    }

    /// A scheduler over the contiguous reservation baseline.
    pub fn contiguous(config: SchedulerConfig, num_blocks: usize, block_size: usize) -> Result<Self, CoreError> {
        let layout = match config.layout {
            KvLayout::Contiguous(policy) => KvLayout::Contiguous(policy),
            KvLayout::Paged => KvLayout::Contiguous(ReservePolicy::MaxModelLen),
        };
        Self::new(SchedulerConfig { layout, ..config }, Box::new(ContiguousSpace::new(num_blocks, block_size)?))
    }

    pub fn kv(&self) -> &dyn KvSpace {
        self.kv.as_ref()
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// What the layout reserves up front for a sequence of `prompt_len` tokens that may
    /// grow to `longest` (0 for the paged layout, which takes pages on demand).
    pub fn reserve_tokens(&self, longest: usize) -> usize {
        match self.config.layout {
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
        match self.config.layout {
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

    /// Queues a new sequence; it is admitted by a later `schedule`. It must be able to
    /// run to `max_tokens` outputs with all of its `num_samples` samples (forked later)
    /// holding their own pages, with the pool to itself; otherwise it is refused here,
    /// so that no admitted request can wait forever.
    pub fn add_sequence(
        &mut self,
        id: SeqId,
        tokens: Vec<TokenId>,
        priority: i64,
        arrival: u64,
        max_tokens: usize,
        num_samples: usize,
    ) -> Result<(), CoreError> {
        self.add_salted_sequence(id, tokens, priority, arrival, max_tokens, num_samples, None)
    }

    /// [`add_sequence`](Self::add_sequence) with a cache salt (vLLM's `cache_salt`): the
    /// salt seeds the sequence's prefix-hash chain, so it shares pages only with sequences
    /// of the same salt, on every tier and across restarts (the disk tier keys by it).
    #[allow(clippy::too_many_arguments)]
    pub fn add_salted_sequence(
        &mut self,
        id: SeqId,
        tokens: Vec<TokenId>,
        priority: i64,
        arrival: u64,
        max_tokens: usize,
        num_samples: usize,
        cache_salt: Option<&[u8]>,
    ) -> Result<(), CoreError> {
        self.check_usable()?;
        if self.seqs.contains_key(&id) {
            return Err(CoreError::InvalidArgument(format!("sequence {id} already exists")));
        }
        if tokens.is_empty() {
            return Err(CoreError::InvalidArgument(format!("sequence {id} has no tokens; at least 1 is needed")));
        }
        if tokens.len() > self.config.max_model_len {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} has {} tokens; max_model_len is {}",
                tokens.len(),
                self.config.max_model_len
            )));
        }
        let needed = self.worst_case_blocks(tokens.len(), max_tokens, num_samples);
        if needed > self.kv.num_blocks() {
            let longest = tokens.len().saturating_add(max_tokens).min(self.config.max_model_len);
            return Err(CoreError::InvalidArgument(format!(
                "the request needs up to {needed} blocks of KV cache (prompt {} + max_tokens {max_tokens} = {longest} tokens \
                 x n = {num_samples} samples); the pool holds {} blocks of {} tokens",
                tokens.len(),
                self.kv.num_blocks(),
                self.kv.block_size()
            )));
        }
        let longest = tokens.len().saturating_add(max_tokens).min(self.config.max_model_len);
        let seq = Sequence {
            id,
            priority,
            arrival,
            reserve_tokens: self.reserve_tokens(longest),
            prompt_len: tokens.len(),
            max_len: longest.max(tokens.len()),
            tokens,
            kv_tokens: 0,
            prefill_left: 0,
            num_computed: 0,
            status: SeqStatus::Waiting,
            waiting_since: self.stats.num_steps,
            parked: false,
            root: self.kv.salted_root(cache_salt),
            cached_tokens: None,
        };
        self.seqs.insert(id, seq);
        self.waiting.push(id);
        Ok(())
    }

    /// Records a token sampled for a running sequence; its page is taken at the next schedule.
    pub fn append_token(&mut self, id: SeqId, token: TokenId) -> Result<(), CoreError> {
        self.append_tokens(&[(id, token)])
    }

    /// Records one sampled token per sequence, all or nothing: every id must be known,
    /// listed once and below `max_model_len`, or no sequence changes.
    pub fn append_tokens(&mut self, items: &[(SeqId, TokenId)]) -> Result<(), CoreError> {
        let mut seen = std::collections::HashSet::with_capacity(items.len());
        for &(id, _) in items {
            let seq = self.seqs.get(&id).ok_or(CoreError::UnknownSequence(id))?;
            if !seen.insert(id) {
                return Err(CoreError::InvalidArgument(format!("sequence {id} is listed twice; one token per sequence per call")));
            }
            if seq.tokens.len() >= self.config.max_model_len {
                return Err(CoreError::InvalidArgument(format!(
                    "sequence {id} already has max_model_len = {} tokens",
                    self.config.max_model_len
                )));
            }
        }
        for &(id, token) in items {
            let seq = self.seqs.get_mut(&id).expect("checked above");
            seq.tokens.push(token);
            seq.parked = false;
        }
        Ok(())
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

    /// `n > 1` sampling and beam search: the child continues the parent's tokens and
    /// shares its pages (copy-on-write later), in whatever state the parent is in:
    ///
    /// - running: the child runs too, on the parent's pages;
    /// - swapped out: the child shares its host pages and comes back with a later swap-in;
    /// - waiting (never admitted, or preempted by recompute): it holds no pages, so the
    ///   child is a waiting copy that is prefilled on admission (a prefix hit on the
    ///   parent's cached blocks where there are any).
    ///
    /// Beam search needs the last two: a beam whose logits row is buffered until its
    /// siblings' rows arrive may be preempted meanwhile and still be the parent of the
    /// next beams.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CoreError> {
        if self.seqs.contains_key(&child) {
            return Err(CoreError::InvalidArgument(format!("sequence {child} already exists")));
        }
        let parent_seq = self.seqs.get(&parent).ok_or(CoreError::UnknownSequence(parent))?;
        let mut child_seq = parent_seq.clone();
        child_seq.id = child;
        if parent_seq.has_pages() {
            match self.kv.fork(parent, child) {
                Ok(copies) => self.pending_copies.extend(copies),
                // The contiguous layout copies the parent's region into a new one, which
                // a full pool cannot give now: the child waits and is prefilled when
                // admitted, as a sequence preempted by recompute would be. A paged fork
                // only shares pages and never takes one.
                Err(CoreError::OutOfBlocks { .. }) => {
                    child_seq.reset_for_recompute(self.stats.num_steps);
                    self.stats.num_deferred_forks += 1;
                }
                Err(e) => return Err(e),
            }
        }
        let queue = match child_seq.status {
            SeqStatus::Waiting => &mut self.waiting,
            SeqStatus::Running => &mut self.running,
            SeqStatus::Swapped => &mut self.swapped,
        };
        queue.push(child);
        self.seqs.insert(child, child_seq);
        Ok(())
    }

    /// Ends a sequence (finished or aborted) and gives its pages back.
    pub fn finish(&mut self, id: SeqId) -> Result<(), CoreError> {
        let seq = self.seqs.remove(&id).ok_or(CoreError::UnknownSequence(id))?;
        self.admission.observe_finish(&seq);
        if seq.has_pages() {
            self.kv.free(id)?;
        }
        let queue = match seq.status {
            SeqStatus::Waiting => &mut self.waiting,
            SeqStatus::Running => &mut self.running,
            SeqStatus::Swapped => &mut self.swapped,
        };
        queue.retain(|&s| s != id);
        Ok(())
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

    /// Reserved versus live token slots of the device pool right now.
    pub fn kv_usage(&self) -> KvUsage {
        let block_size = self.kv.block_size();
        // Live slots per physical block: the longest fill any sequence has in it.
        let mut fill: HashMap<u32, usize> = HashMap::new();
        for id in &self.running {
            let seq = &self.seqs[id];
            if let Ok(table) = self.kv.block_table(*id) {
                for (i, &block) in table.iter().enumerate().filter(|(_, &b)| b != crate::block_manager::NULL_BLOCK) {
                    let filled = seq.kv_tokens.saturating_sub(i * block_size).min(block_size);
                    let entry = fill.entry(block).or_insert(0);
                    *entry = (*entry).max(filled);
                }
            }
        }
        KvUsage { reserved_slots: self.kv.reserved_slots(), live_slots: fill.values().sum() }
    }

    /// Checks the KV space's invariants plus the scheduler's own: every sequence is
    /// in exactly the queue its status names, and running ones hold their pages.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
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
