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
        if blocks > self.kv.num_free_host_blocks() {
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
        self.running.retain(|&s| s != id);
        let now = self.stats.num_steps;
        let seq = self.seqs.get_mut(&id).expect("victim is a known sequence");
        if mode == PreemptionMode::Swap {
            let pairs = self.kv.swap_out(&[id])?;
            self.to_host.extend(pairs);
            seq.status = SeqStatus::Swapped;
            self.swapped.push(id);
            self.stats.num_swap_preemptions += 1;
        } else {
            self.kv.free(id)?;
            seq.kv_tokens = 0;
            seq.num_computed = 0;
            seq.status = SeqStatus::Waiting;
            seq.waiting_since = now;
            self.waiting.push(id);
            self.stats.num_recompute_preemptions += 1;
        }
        out.preempted.push(id);
        Ok(())
    }
}
