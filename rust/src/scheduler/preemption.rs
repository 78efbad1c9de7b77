//! Preemption: choosing the victim's mode and giving its pages back.

use super::sequence::SeqStatus;
use super::{PreemptionMode, Scheduler, SchedulerOutput};
use crate::block_manager::SeqId;
use crate::error::CoreError;

impl Scheduler {
    /// Swap or recompute for this victim (see [`super::PreemptionCost`]).
    ///
    /// A sequence still in prefill always recomputes (only part of its K/V exists),
    /// and so does any victim the host tier cannot take: swapping is never required
    /// for progress, recomputing always works.
    pub(super) fn preemption_mode_for(&self, id: SeqId) -> Result<PreemptionMode, CoreError> {
        let seq = &self.seqs[&id];
        let in_prefill = seq.num_computed < seq.kv_tokens;
        if self.config.preemption_mode == PreemptionMode::Recompute || !self.kv.supports_swap() || in_prefill {
            return Ok(PreemptionMode::Recompute);
        }
        let blocks = self.kv.blocks_to_swap_out(&[id])?;
        // A paused victim moves pages one by one, only as many as needed: it needs
        // room on the host for one page, a whole-sequence swap for all of them.
        let host_needed = if self.page_granular() { blocks.min(1) } else { blocks };
        if host_needed > self.kv.num_free_host_blocks() {
            return Ok(PreemptionMode::Recompute);
        }
        if self.config.preemption_mode == PreemptionMode::Swap {
            return Ok(PreemptionMode::Swap);
        }
        let cost = self.config.cost;
        let swap = 2.0 * blocks as f64 * cost.swap_cost_per_block;
        let recompute = seq.tokens.len() as f64 * cost.recompute_cost_per_token;
        Ok(if swap < recompute { PreemptionMode::Swap } else { PreemptionMode::Recompute })
    }

    /// Takes `id` out of the running set, by swap or by dropping its pages.
    pub(super) fn preempt(&mut self, id: SeqId, out: &mut SchedulerOutput) -> Result<(), CoreError> {
        let mode = self.preemption_mode_for(id)?;
        self.preempt_as(id, mode, out)
    }

    /// Breaks the one stall that sequences with nothing to compute can cause.
    ///
    /// Beam search keeps a beam's logits row until its siblings' rows arrive; meanwhile
    /// the beam is running but idle, holding pages. When a step schedules nothing at
    /// all, every running sequence is such an idle one, and the best sequence that
    /// waits (swapped out, or waiting) cannot come in: nothing would ever change. Idle
    /// ones are then preempted by recompute, from the back of the running order, until
    /// the blocked one fits (recompute, not swap: a prefix hit shares their pages
    /// again when they return, a swap-in would bring back private copies). Returns the
    /// blocked one (whether it is swapped, and the most tokens it may take this step),
    /// to be brought in at once, before the idle ones just preempted (which may rank
    /// before it); None (nothing changed) when nothing waits or it could never fit.
    ///
    /// The same stall follows from a windowed prompt paused mid-prefill (or waiting)
    /// whose next full chunk cannot fit: it then comes in with a 1-token chunk, after
    /// which its window lets its oldest pages go.
    pub(super) fn make_room_for_blocked(&mut self, out: &mut SchedulerOutput) -> Result<Option<(SeqId, bool, usize)>, CoreError> {
        let seqs = &self.seqs;
        let blocked = self.swapped.iter().copied().filter(|id| !seqs[id].waits_for_token()).min_by_key(|id| seqs[id].rank());
        let (now, aging) = (self.stats.num_steps, self.config.aging_steps);
        let first_waiting = || {
            self.waiting.iter().copied().filter(|id| !seqs[id].waits_for_token()).min_by_key(|id| seqs[id].waiting_rank(now, aging))
        };
        let blocked = blocked.map(|id| (id, true)).or_else(|| first_waiting().map(|id| (id, false)));
        let Some((id, swapped)) = blocked else { return Ok(None) };
        // Paused sequences that may give pages: those ranked after a paused blocked one;
        // any for a waiting one (paused beams waiting for its row hold pages it needs).
        let after = swapped.then_some(id);
        // A windowed prompt takes its next chunk's pages before the window lets older
        // ones go: with a full-budget chunk it may never fit where a 1-token chunk does.
        let full = self.config.max_num_batched_tokens;
        let chunk = if self.blocked_need(id, swapped, full)?.1 { 1 } else { full };
        loop {
            let (need, never) = self.blocked_need(id, swapped, chunk)?;
            if never {
                return Ok(None);
            }
            if need <= self.kv.num_free_blocks() && self.running.len() < self.config.max_num_seqs {
                return Ok(Some((id, swapped, chunk)));
            }
            if self.page_granular() && need > self.kv.num_free_blocks() {
                self.take_pages_from_paused(need, after, out)?;
                if need <= self.kv.num_free_blocks() || self.recompute_worst_paused(after, out)? {
                    continue;
                }
            }
            let Some(&victim) = self.running.last() else { return Ok(None) };
            self.preempt_as(victim, PreemptionMode::Recompute, out)?;
        }
    }

    /// (free pages the blocked sequence needs to come in with a chunk of at most `chunk`
    /// tokens, whether it could never fit). A swapped one needs room for its host pages
    /// (its device pages are still there) and its next tokens' pages. No watermark: nothing else runs this step (as for an
    /// admission into an idle step); with it, a request `add_sequence` accepted could
    /// need more than the pool, never come back, and leave every later step empty.
    fn blocked_need(&self, id: SeqId, swapped: bool, chunk: usize) -> Result<(usize, bool), CoreError> {
        if swapped {
            // Exact (no slack page): a paused sequence whose next token fits in its own
            // last page needs nothing more, even when its pages fill the pool. It could
            // never fit only if its pages alone would exceed the pool: a copy on write of
            // a last page shared with other paused sequences goes once they give way.
            let seq = &self.seqs[&id];
            let n = self.num_to_append(seq, chunk);
            let need = self.kv.blocks_to_resume(id, n)?;
            let released = self.kv.block_table(id)?.len() - self.kv.num_held_blocks(id)?;
            let alone = (seq.kv_tokens + n).div_ceil(self.kv.block_size()) - released;
            Ok((need, alone > self.usable_blocks_for(&seq.tokens, seq.root)))
        } else {
            let seq = &self.seqs[&id];
            let end = self.admission_end(seq, chunk);
            let need = self.kv.blocks_to_admit(&seq.tokens[..end], seq.reserve_tokens, seq.root);
            Ok((need, need == usize::MAX || need > self.usable_blocks_for(&seq.tokens[..end], seq.root)))
        }
    }

    fn preempt_as(&mut self, id: SeqId, mode: PreemptionMode, out: &mut SchedulerOutput) -> Result<(), CoreError> {
        if mode == PreemptionMode::Swap && self.page_granular() {
            self.pause(id);
        } else if mode == PreemptionMode::Swap {
            self.running.retain(|&s| s != id);
            let pairs = self.kv.swap_out(&[id])?;
            self.to_host.extend(pairs);
            self.seqs.get_mut(&id).expect("victim is a known sequence").status = SeqStatus::Swapped;
            self.swapped.push(id);
            self.stats.num_swap_preemptions += 1;
        } else {
            self.running.retain(|&s| s != id);
            self.drop_for_recompute(id)?;
        }
        out.preempted.push(id);
        Ok(())
    }

    /// Frees every page of `id` (out of every queue already) and queues it to be
    /// prefilled again.
    pub(super) fn drop_for_recompute(&mut self, id: SeqId) -> Result<(), CoreError> {
        let now = self.stats.num_steps;
        let seq = self.seqs.get_mut(&id).expect("victim is a known sequence");
        self.kv.free(id)?;
        seq.reset_for_recompute(now);
        self.waiting.push(id);
        self.stats.num_recompute_preemptions += 1;
        Ok(())
    }
}
