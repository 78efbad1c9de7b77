//! Page-granular preemption: a preempted sequence is *paused* and keeps its device
//! pages; pages leave it only when another sequence needs them, as many as needed.
//!
//! ```text
//!  decode of A needs 2 pages, none free:
//!    paused (worst first):  P3 [d d d d]  P2 [d d h h]       d device page, h host page
//!    take 2 from P3  →      P3 [d d h h]                      2 copies device→host, not 4
//!  still short → pause the worst running sequence (it keeps its pages), take from it
//!  still short → pause A itself
//! ```
//!
//! A paused sequence is `SeqStatus::Swapped` whether or not any of its pages is on the
//! host yet; it runs again after `swap_in` brings its host pages back (none: it simply
//! resumes). A paused victim whose pages the host cannot take is recomputed instead
//! (recompute is the fallback that always works). Whole-sequence swap (vLLM v0's) stays
//! available as the comparison baseline, see [`Scheduler::set_whole_sequence_swap`].

use super::sequence::SeqStatus;
use super::{PreemptionMode, Scheduler, SchedulerOutput};
use crate::block_manager::SeqId;
use crate::error::CoreError;

impl Scheduler {
    /// Whether a swap preemption pauses its victim page by page (the default) instead of
    /// moving every page of it at once.
    pub(super) fn page_granular(&self) -> bool {
        self.config.preemption_mode != PreemptionMode::Recompute && self.kv.supports_swap() && !self.whole_sequence_swap
    }

    /// Baseline switch for benchmarks and tests: swap preemption moves whole sequences
    /// (every page of the victim at once) instead of pausing them page by page.
    pub fn set_whole_sequence_swap(&mut self, on: bool) {
        self.whole_sequence_swap = on;
    }

    /// (device pages, host pages) of a sequence's block table now; (0, 0) while it holds none.
    pub fn page_tiers(&self, id: SeqId) -> Result<(usize, usize), CoreError> {
        let seq = self.seqs.get(&id).ok_or(CoreError::UnknownSequence(id))?;
        if !seq.has_pages() {
            return Ok((0, 0));
        }
        let (total, host) = (self.kv.block_table(id)?.len(), self.kv.num_host_pages(id)?);
        Ok((total - host, host))
    }

    /// Paused sequences ranked after `after` (all of them when None), worst first.
    fn paused_victims(&self, after: Option<SeqId>) -> Vec<SeqId> {
        let seqs = &self.seqs;
        let floor = after.map(|id| seqs[&id].rank());
        let mut victims: Vec<SeqId> = self.swapped.iter().copied().filter(|v| floor.is_none_or(|f| seqs[v].rank() > f)).collect();
        victims.sort_by_key(|v| std::cmp::Reverse(seqs[v].rank()));
        victims
    }

    /// Device pages that paused sequences ranked after `after` could give up now.
    pub(super) fn swappable_from_paused(&self, after: Option<SeqId>) -> Result<usize, CoreError> {
        self.paused_victims(after).iter().map(|&v| self.kv.num_swappable_pages(v)).sum()
    }

    /// Frees device pages until `target` are free, taking them from paused sequences
    /// ranked after `after`, worst first: each gives its exclusive pages to the host, as
    /// many as still missing; one whose pages the host cannot take is recomputed instead
    /// (no copy is wasted on it). Stops short when the paused sequences have nothing
    /// left to give.
    pub(super) fn take_pages_from_paused(&mut self, target: usize, after: Option<SeqId>, out: &mut SchedulerOutput) -> Result<(), CoreError> {
        for victim in self.paused_victims(after) {
            let free = self.kv.num_free_blocks();
            if free >= target {
                break;
            }
            let swappable = self.kv.num_swappable_pages(victim)?;
            if swappable == 0 {
                continue; // every device page it holds is shared: moving it frees nothing
            }
            let want = (target - free).min(swappable);
            if want <= self.kv.num_free_host_blocks() {
                let pairs = self.kv.swap_out_pages(victim, want)?;
                self.to_host.extend(pairs);
            } else {
                // The host cannot take them: recompute is the fallback that always works.
                self.recompute_paused(victim, out)?;
            }
        }
        Ok(())
    }

    /// The worst paused sequence ranked after `after` that still holds device pages, if
    /// any, is dropped for recompute (its pages all shared with other paused sequences,
    /// so no page-by-page move frees them). Returns whether one was.
    pub(super) fn recompute_worst_paused(&mut self, after: Option<SeqId>, out: &mut SchedulerOutput) -> Result<bool, CoreError> {
        for victim in self.paused_victims(after) {
            let table_len = self.kv.block_table(victim)?.len();
            if self.kv.num_host_pages(victim)? < table_len {
                self.recompute_paused(victim, out)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn recompute_paused(&mut self, id: SeqId, out: &mut SchedulerOutput) -> Result<(), CoreError> {
        self.swapped.retain(|&s| s != id);
        self.drop_for_recompute(id)?;
        if !out.preempted.contains(&id) {
            out.preempted.push(id);
        }
        Ok(())
    }

    /// Takes a running sequence out of the running set; it keeps its pages.
    pub(super) fn pause(&mut self, id: SeqId) {
        self.running.retain(|&s| s != id);
        self.seqs.get_mut(&id).expect("victim is a known sequence").status = SeqStatus::Swapped;
        self.swapped.push(id);
        self.stats.num_swap_preemptions += 1;
    }
}
