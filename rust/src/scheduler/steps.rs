//! A step's life after `schedule`: reported done (what it wrote becomes a prefix-cache
//! hit) or failed (nothing it wrote is ever served), and a core whose planning failed.
//!
//! ```text
//!   schedule() ─► step s open ─► runner: transfers, copies, forward
//!                                   │ ok                     │ failed
//!                 complete_step(s, true)            complete_step(s, false)
//!                 its blocks are published          its blocks are forgotten, its transfers
//!                                                   still in flight fail (their pages leave
//!                                                   every tier), and every sequence it ran
//!                                                   or whose pages it left unwritten goes
//!                                                   back to waiting, to be recomputed
//! ```
//! Steps are reported in order. A failed step fails the steps planned after it too (they
//! may read what it did not write), so with two steps in flight both are given back.
//! The failed sequences are returned: the caller recomputes them (a lost page: a disk
//! read that failed its checksum) or ends them (a forward that raised).
//!
//! A failure inside `schedule` itself is different: it may stop between two changes of
//! state (a page taken, a sequence not yet moved), and no rollback of a whole step is
//! kept. The scheduler then refuses every later `schedule` and `add_sequence` with the
//! reason, and the engine declares itself dead (`EngineDeadError`): a clear stop instead
//! of a core that may hand out wrong pages.

use super::sequence::SeqStatus;
use super::{Scheduler, SchedulerOutput};
use crate::block_manager::{BlockId, SeqId, TransferId};
use crate::error::CoreError;

/// A step handed out and not yet reported.
#[derive(Debug, Clone)]
pub(super) struct OpenStep {
    id: u64,
    /// The sequences it runs.
    seqs: Vec<SeqId>,
    /// Its transfers (some may have completed already).
    transfers: Vec<TransferId>,
    /// Device blocks it writes: its forward's slots and its device copies' destinations
    /// (copy on write, a contiguous fork's region). A failed step may have left any of
    /// them half written, including a page it shares with a sequence it did not run (a
    /// fork taken mid-prefill recomputes positions into its parent's pages).
    written: Vec<BlockId>,
}

impl Scheduler {
    /// Refuses when an earlier `schedule` failed part-way (see the module docs).
    pub(super) fn check_usable(&self) -> Result<(), CoreError> {
        match &self.broken {
            Some(why) => Err(CoreError::InvalidArgument(format!("the scheduler is unusable: {why}; build a new one"))),
            None => Ok(()),
        }
    }

    /// Why the scheduler refuses to plan, if it does.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// How many steps may be in flight at once (1: the default, a step is run before the
    /// next is planned; 2: asynchronous scheduling). Older open steps are reported done
    /// by `schedule` when a new one would exceed it.
    pub fn set_max_steps_in_flight(&mut self, n: usize) -> Result<(), CoreError> {
        if n == 0 {
            return Err(CoreError::InvalidArgument("max_steps_in_flight must be at least 1, got 0".into()));
        }
        self.max_steps_in_flight = n;
        Ok(())
    }

    /// Ids of the steps handed out and not yet reported, oldest first.
    pub fn open_steps(&self) -> Vec<u64> {
        self.open_steps.iter().map(|s| s.id).collect()
    }

    pub(super) fn complete_steps_beyond_limit(&mut self) {
        while self.open_steps.len() >= self.max_steps_in_flight {
            let id = self.open_steps.front().expect("non-empty").id;
            self.complete_step(id, true).expect("the oldest open step can always be reported");
        }
    }

    pub(super) fn open_step(&mut self, id: u64, out: &SchedulerOutput) {
        let transfers = out.transfers.iter().map(|t| t.id).collect();
        let bs = self.kv.block_size() as i64;
        let mut written: Vec<BlockId> = out.slot_mapping.iter().map(|&slot| (slot / bs) as BlockId).collect();
        written.extend(out.copies.iter().map(|&(_, dst)| dst));
        written.sort_unstable();
        written.dedup();
        self.open_steps.push_back(OpenStep { id, seqs: out.seq_ids.clone(), transfers, written });
    }

    /// Reports step `step_id` (the oldest open one): `ok` when the runner ran it, so the
    /// blocks it filled become prefix-cache hits; otherwise nothing it wrote is ever
    /// served (see the module docs) and the affected sequences are reset to be
    /// recomputed from their first token. Report the transfers that did finish with
    /// `complete_transfers` first: the rest of the step's fail here. Returns the reset
    /// sequences (empty when `ok`), sorted.
    pub fn complete_step(&mut self, step_id: u64, ok: bool) -> Result<Vec<SeqId>, CoreError> {
        match self.open_steps.front() {
            Some(s) if s.id == step_id => {}
            _ => {
                return Err(CoreError::InvalidArgument(format!(
                    "step {step_id} is not the oldest step in flight; in flight: {:?} (report steps once, in order)",
                    self.open_steps()
                )))
            }
        }
        if ok {
            self.open_steps.pop_front();
            self.kv.complete_step(step_id, true);
            return Ok(Vec::new());
        }
        // This step and every later one: they may read what it did not write.
        let failed: Vec<OpenStep> = self.open_steps.drain(..).collect();
        let in_flight = self.kv.transfers_in_flight();
        let mut lost_transfers: Vec<TransferId> = failed.iter().flat_map(|s| s.transfers.iter().copied()).filter(|t| in_flight.contains(t)).collect();
        lost_transfers.sort_unstable();
        let ran: std::collections::HashSet<SeqId> = failed.iter().flat_map(|s| s.seqs.iter().copied()).collect();
        let mut affected: Vec<SeqId> = ran.iter().copied().collect();
        affected.extend(self.kv.fail_transfers(&lost_transfers)?);
        // Every device page the step wrote may hold anything now: it leaves the device
        // cache, and every sequence holding it starts again.
        let written: std::collections::HashSet<BlockId> = failed.iter().flat_map(|s| s.written.iter().copied()).collect();
        if !written.is_empty() {
            let blocks: Vec<BlockId> = written.iter().copied().collect();
            self.kv.forget_device_pages(&blocks);
            for (&id, seq) in &self.seqs {
                if seq.has_pages() && self.kv.device_block_table_contains(id, &written)? {
                    affected.push(id);
                }
            }
        }
        for s in &failed {
            self.kv.complete_step(s.id, false);
        }
        affected.sort_unstable();
        affected.dedup();
        affected.retain(|id| self.seqs.contains_key(id));
        for &id in &affected {
            self.reset_after_failure(id, ran.contains(&id))?;
        }
        self.stats.num_failed_steps += failed.len() as u64;
        Ok(affected)
    }

    /// Back to waiting with no pages (from whatever queue it is in), prefilled again later.
    /// `ran`: it was in the failed step, so the row it was to produce never came and it
    /// is admitted again at once; one that only lost pages keeps waiting for a token if it
    /// did (see `Sequence::parked`).
    pub(super) fn reset_after_failure(&mut self, id: SeqId, ran: bool) -> Result<(), CoreError> {
        let now = self.stats.num_steps;
        let seq = self.seqs.get_mut(&id).expect("checked by the caller");
        if seq.has_pages() {
            self.kv.free(id)?;
        }
        let was = seq.status;
        seq.reset_for_recompute(now);
        if ran {
            seq.parked = false;
        }
        match was {
            SeqStatus::Running => self.running.retain(|&s| s != id),
            SeqStatus::Swapped => self.swapped.retain(|&s| s != id),
            SeqStatus::Waiting => self.waiting.retain(|&s| s != id),
        }
        self.waiting.push(id);
        Ok(())
    }

    /// Disk slots whose page was lost (a write that failed, a page that failed its
    /// checksum): they leave the disk tier at once. Returns how many were dropped.
    pub fn invalidate_disk_slots(&mut self, slots: &[BlockId]) -> usize {
        self.kv.invalidate_disk_slots(slots)
    }

    /// Prompt tokens whose K/V the sequence's first admission found cached (None until
    /// it is admitted): what a client is told was reused (`cached_tokens`).
    pub fn num_cached_tokens_of(&self, id: SeqId) -> Result<Option<usize>, CoreError> {
        self.seqs.get(&id).map(|s| s.cached_tokens).ok_or(CoreError::UnknownSequence(id))
    }
}
