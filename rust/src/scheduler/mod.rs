//! Continuous batching over a paged KV space: which sequences run in the next
//! step, how many tokens each, and which pages move.
//!
//! Each step fills one batch under a token budget and a sequence cap, in this order:
//! 1. running decodes (their sampled token joins the KV space now; a missing page
//!    preempts the lowest-priority, latest-arrived running sequence);
//! 2. swapped sequences coming back (none in a step that preempted);
//! 3. prompt chunks of running sequences still in prefill (chunked prefill);
//! 4. new admissions from the waiting queue, while free pages stay above a watermark.
//!
//! A prompt's cached prefix is skipped, and a block is committed when it is
//! scheduled, so a later request in the same step already hits it: within one
//! layer every K/V write happens before any attention read.

pub mod config;
pub mod contiguous;
pub mod kv_space;
pub mod output;
mod preemption;
mod schedule;
pub mod sequence;

use std::collections::HashMap;

use crate::block_manager::{BlockManager, BlockManagerConfig, SeqId, TokenId};
use crate::error::CoreError;
pub use config::{PreemptionCost, PreemptionMode, SchedulerConfig};
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
    /// Prompt (and recomputed) tokens actually computed.
    pub prompt_tokens_computed: u64,
    /// Prompt tokens skipped thanks to the prefix cache.
    pub cached_prompt_tokens: u64,
    pub decode_tokens: u64,
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
    stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: Box<dyn KvSpace>) -> Result<Self, CoreError> {
        config.validate()?;
        Ok(Self {
            config,
            kv,
            seqs: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            swapped: Vec::new(),
            pending_copies: Vec::new(),
            stats: SchedulerStats::default(),
        })
    }

    /// A scheduler over a paged [`BlockManager`].
    pub fn paged(config: SchedulerConfig, bm: BlockManagerConfig) -> Result<Self, CoreError> {
        Self::new(config, Box::new(BlockManager::new(bm)?))
    }

    /// A scheduler over the contiguous reservation baseline.
    pub fn contiguous(config: SchedulerConfig, num_blocks: usize, block_size: usize) -> Result<Self, CoreError> {
        Self::new(config, Box::new(ContiguousSpace::new(num_blocks, block_size)?))
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

    /// Whether a sequence of `num_tokens` tokens could run with the whole pool to itself.
    pub fn fits_in_pool(&self, num_tokens: usize, reserve_tokens: usize) -> bool {
        let blocks = num_tokens.max(reserve_tokens).max(1).div_ceil(self.kv.block_size());
        blocks <= self.kv.num_blocks()
    }

    /// Queues a new sequence; it is admitted by a later `schedule`.
    pub fn add_sequence(
        &mut self,
        id: SeqId,
        tokens: Vec<TokenId>,
        priority: i64,
        arrival: u64,
        reserve_tokens: usize,
    ) -> Result<(), CoreError> {
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
        if !self.fits_in_pool(tokens.len(), reserve_tokens) {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} needs {} tokens of KV space; the pool holds {} blocks of {} tokens",
                tokens.len().max(reserve_tokens),
                self.kv.num_blocks(),
                self.kv.block_size()
            )));
        }
        let seq = Sequence {
            id,
            priority,
            arrival,
            tokens,
            kv_tokens: 0,
            num_computed: 0,
            reserve_tokens,
            status: SeqStatus::Waiting,
            waiting_since: self.stats.num_steps,
        };
        self.seqs.insert(id, seq);
        self.waiting.push(id);
        Ok(())
    }

    /// Records a token sampled for a running sequence; its page is taken at the next schedule.
    pub fn append_token(&mut self, id: SeqId, token: TokenId) -> Result<(), CoreError> {
        let seq = self.seqs.get_mut(&id).ok_or(CoreError::UnknownSequence(id))?;
        if seq.tokens.len() >= self.config.max_model_len {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} already has max_model_len = {} tokens",
                self.config.max_model_len
            )));
        }
        seq.tokens.push(token);
        Ok(())
    }

    /// `n > 1` sampling: the child shares every page of a running parent.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CoreError> {
        if self.seqs.contains_key(&child) {
            return Err(CoreError::InvalidArgument(format!("sequence {child} already exists")));
        }
        let parent_seq = self.seqs.get(&parent).ok_or(CoreError::UnknownSequence(parent))?;
        if parent_seq.status != SeqStatus::Running {
            return Err(CoreError::InvalidArgument(format!("sequence {parent} is not running; only a running sequence can fork")));
        }
        let mut child_seq = parent_seq.clone();
        child_seq.id = child;
        let copies = self.kv.fork(parent, child)?;
        self.pending_copies.extend(copies);
        self.seqs.insert(child, child_seq);
        self.running.push(child);
        Ok(())
    }

    /// Ends a sequence (finished or aborted) and gives its pages back.
    pub fn finish(&mut self, id: SeqId) -> Result<(), CoreError> {
        let seq = self.seqs.remove(&id).ok_or(CoreError::UnknownSequence(id))?;
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
                for (i, &block) in table.iter().enumerate() {
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
                seen += 1;
            }
        }
        if seen != self.seqs.len() {
            return Err(format!("{} sequences known but {seen} queued", self.seqs.len()));
        }
        Ok(())
    }
}
