//! One step of continuous batching (the order is in the module docs of `scheduler`).

use std::collections::HashSet;

use super::sequence::SeqStatus;
use super::{Scheduler, SchedulerOutput};
use crate::block_manager::{SeqId, SwapInStatus};
use crate::error::CoreError;

/// What is left of this step's limits while the batch fills.
struct Budget {
    tokens: usize,
    seqs: usize,
}

impl Scheduler {
    /// Builds the next step. Sequences it schedules are committed, but the blocks the
    /// step fills become prefix-cache hits for other steps only once the step is reported
    /// with [`complete_step`](Self::complete_step); with one step in flight (the default),
    /// scheduling the next step reports the previous one as done (the caller ran it).
    /// A failure part-way leaves the core in no known state: it is then refused for good
    /// (see `steps`).
    pub fn schedule(&mut self) -> Result<SchedulerOutput, CoreError> {
        self.check_usable()?;
        self.check_no_drafts()?;
        self.complete_steps_beyond_limit();
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        self.kv.begin_step(step_id);
        match self.plan_step() {
            Ok(mut out) => {
                out.step_id = step_id;
                self.open_step(step_id, &out);
                Ok(out)
            }
            Err(e) => {
                self.broken = Some(format!("step {step_id} failed while it was planned: {e}"));
                Err(e)
            }
        }
    }

    fn plan_step(&mut self) -> Result<SchedulerOutput, CoreError> {
        let mut out = SchedulerOutput { copies: std::mem::take(&mut self.pending_copies), ..Default::default() };
        let mut budget = Budget { tokens: self.config.max_num_batched_tokens, seqs: self.config.max_num_seqs };
        let mut scheduled: Vec<(SeqId, usize)> = Vec::new();

        let seqs = &self.seqs;
        self.running.sort_by_key(|id| seqs[id].rank());
        if self.config.prefill_first && !self.last_step_skipped_decodes {
            let skips_decodes = !self.running.is_empty();
            if self.schedule_prefill_step(&mut budget, &mut scheduled)? {
                self.last_step_skipped_decodes = skips_decodes;
                return self.finish_step(scheduled, out);
            }
        }
        self.last_step_skipped_decodes = false;
        self.schedule_decodes(&mut budget, &mut scheduled, &mut out)?;
        // No swap-in in a step that preempted or took pages from paused sequences: it
        // would bring back what the step just sent out.
        if out.preempted.is_empty() && self.to_host.is_empty() {
            self.schedule_swap_ins(&mut budget, &mut scheduled, &mut out)?;
        }
        self.schedule_prefill_chunks(&mut budget, &mut scheduled)?;
        if out.preempted.is_empty() {
            self.schedule_admissions(&mut budget, &mut scheduled, false)?;
        }
        // Paused sequences hold device pages too (page-granular preemption).
        if scheduled.is_empty() && (!self.running.is_empty() || !self.swapped.is_empty()) {
            if let Some((id, swapped, chunk)) = self.make_room_for_blocked(&mut out)? {
                budget.tokens = budget.tokens.min(chunk);
                if swapped {
                    self.swap_in_one(id, &mut budget, &mut scheduled, &mut out)?;
                } else {
                    self.admit(id, &mut budget, &mut scheduled)?;
                }
            }
        }
        self.finish_step(scheduled, out)
    }

    /// `SchedulerConfig::prefill_first`: admits what fits, then the pending prompt chunks,
    /// with no decode. Returns false, with nothing scheduled, when no waiting prompt was
    /// admitted (the step then runs as usual). The running sequences it skips still
    /// count at admission (their expected growth), so the prompt-only rule for an empty
    /// step does not apply here.
    fn schedule_prefill_step(&mut self, budget: &mut Budget, scheduled: &mut Vec<(SeqId, usize)>) -> Result<bool, CoreError> {
        if self.waiting.is_empty() {
            return Ok(false);
        }
        let others = !self.running.is_empty() || !self.swapped.is_empty();
        self.schedule_admissions(budget, scheduled, others)?;
        if scheduled.is_empty() {
            return Ok(false);
        }
        self.schedule_prefill_chunks(budget, scheduled)?;
        Ok(true)
    }

    /// Hands out the step's transfers and fills the runner's arrays.
    fn finish_step(&mut self, scheduled: Vec<(SeqId, usize)>, mut out: SchedulerOutput) -> Result<SchedulerOutput, CoreError> {
        self.proposals.clear(); // a proposal serves the step after it, or none
        let (to_host, to_device) = (std::mem::take(&mut self.to_host), std::mem::take(&mut self.to_device));
        self.stats.last_step_pages_swapped_out = to_host.len() as u64;
        self.stats.last_step_pages_swapped_in = to_device.len() as u64;
        self.stats.pages_swapped_out += to_host.len() as u64;
        self.stats.pages_swapped_in += to_device.len() as u64;
        out.transfers = self.kv.start_transfers(to_host, to_device);
        // Every page of the step is taken: the copies on write no longer need their pins.
        self.kv.release_copy_sources();
        self.fill_batch(&scheduled, &mut out)?;
        self.stats.num_steps += 1;
        Ok(out)
    }

    /// Running sequences whose sampled tokens must join the KV space, best first.
    /// A missing page preempts from the back of the running order.
    fn schedule_decodes(
        &mut self,
        budget: &mut Budget,
        scheduled: &mut Vec<(SeqId, usize)>,
        out: &mut SchedulerOutput,
    ) -> Result<(), CoreError> {
        let order: Vec<SeqId> = self.running.clone();
        let mut done: HashSet<SeqId> = HashSet::new();
        for id in order {
            if budget.tokens == 0 || budget.seqs == 0 {
                break;
            }
            let seq = &self.seqs[&id];
            if seq.status != SeqStatus::Running || seq.num_computed < seq.kv_tokens || seq.kv_tokens == seq.tokens.len() {
                continue; // preempted above, still in prefill (phase 3), or nothing to do
            }
            let pending = self.num_to_append(seq, budget.tokens);
            let in_prefill = seq.prefill_left > 0;
            let mut preempted_self = false;
            while self.kv.blocks_to_append(id, pending)? > self.kv.num_free_blocks() {
                if self.page_granular() {
                    // Paused sequences give pages first (and the watermark with them, so
                    // the next steps' decodes do not each move one more page).
                    let need = self.kv.blocks_to_append(id, pending)?;
                    self.take_pages_from_paused(need + self.rules.watermark_blocks, None, out)?;
                    if need <= self.kv.num_free_blocks() {
                        break;
                    }
                }
                let victim = self.running.iter().rev().copied().find(|v| *v != id && !done.contains(v));
                match victim {
                    Some(v) => self.preempt(v, out)?,
                    None => {
                        self.preempt(id, out)?;
                        preempted_self = true;
                        break;
                    }
                }
            }
            if preempted_self {
                continue;
            }
            self.append_sampled(id, pending, out)?;
            if !in_prefill {
                self.append_drafts(id, pending, budget.tokens, out)?; // a prompt chunk carries none
            }
            let n = self.take_tokens(id, budget, scheduled)? as u64;
            // A windowed prompt's later chunks come this way too (appended as they go).
            *if in_prefill { &mut self.stats.prompt_tokens_computed } else { &mut self.stats.decode_tokens } += n;
            done.insert(id);
        }
        Ok(())
    }

    /// Swapped sequences come back, best first, while their pages and a new one fit.
    fn schedule_swap_ins(
        &mut self,
        budget: &mut Budget,
        scheduled: &mut Vec<(SeqId, usize)>,
        out: &mut SchedulerOutput,
    ) -> Result<(), CoreError> {
        let seqs = &self.seqs;
        self.swapped.sort_by_key(|id| seqs[id].rank());
        // A sequence with nothing to compute (a beam whose logits row is already taken,
        // swapped out while it waits for its siblings' rows) stays on the host until it
        // is given a token: bringing it back now would schedule an empty row.
        while let Some(id) = self.swapped.iter().copied().find(|id| !self.seqs[id].waits_for_token()) {
            if budget.tokens == 0 || budget.seqs == 0 || self.running.len() >= self.config.max_num_seqs {
                break;
            }
            // Its device pages are still there (page-granular preemption); only the host
            // ones need room, and paused sequences ranked after it may give it.
            let need = self.swap_in_need(id, budget.tokens)? + self.rules.watermark_blocks;
            if self.page_granular() && need > self.kv.num_free_blocks() && need <= self.kv.num_free_blocks() + self.swappable_from_paused(Some(id))? {
                self.take_pages_from_paused(need, Some(id), out)?;
            }
            let fits = need <= self.kv.num_free_blocks();
            if !fits || (self.kv.is_swapped(id)? && self.kv.can_swap_in(&[id])? != SwapInStatus::Ok) {
                break;
            }
            self.swap_in_one(id, budget, scheduled, out)?;
        }
        Ok(())
    }

    /// Device pages a paused sequence needs to come back and record its next tokens: its
    /// pages on the host (those still on the device stay) and one more (a new page or a
    /// copy on write), plus a windowed prompt's next chunk.
    pub(super) fn swap_in_need(&self, id: SeqId, budget_tokens: usize) -> Result<usize, CoreError> {
        let seq = &self.seqs[&id];
        let held = self.kv.num_host_pages(id)?;
        if seq.prefill_left == 0 {
            return Ok(held + 1);
        }
        let (bs, n) = (self.kv.block_size(), self.num_to_append(seq, budget_tokens));
        Ok(held + (seq.kv_tokens + n).div_ceil(bs) - seq.kv_tokens.div_ceil(bs) + 1)
    }

    fn swap_in_one(&mut self, id: SeqId, budget: &mut Budget, scheduled: &mut Vec<(SeqId, usize)>, out: &mut SchedulerOutput) -> Result<(), CoreError> {
        if self.kv.is_swapped(id)? {
            let pairs = self.kv.swap_in(&[id])?;
            self.to_device.extend(pairs);
        }
        self.swapped.retain(|&s| s != id);
        self.seqs.get_mut(&id).expect("swapped sequence").status = SeqStatus::Running;
        self.running.push(id);
        let seq = &self.seqs[&id];
        let (pending, in_prefill) = (self.num_to_append(seq, budget.tokens), seq.prefill_left > 0);
        self.append_sampled(id, pending, out)?;
        let n = self.take_tokens(id, budget, scheduled)? as u64;
        *if in_prefill { &mut self.stats.prompt_tokens_computed } else { &mut self.stats.decode_tokens } += n;
        Ok(())
    }

    /// Next chunks of running sequences whose prompt is not fully computed yet.
    fn schedule_prefill_chunks(&mut self, budget: &mut Budget, scheduled: &mut Vec<(SeqId, usize)>) -> Result<(), CoreError> {
        for id in self.running.clone() {
            if budget.tokens == 0 || budget.seqs == 0 {
                break;
            }
            let seq = &self.seqs[&id];
            if seq.num_computed >= seq.kv_tokens {
                continue;
            }
            self.stats.prompt_tokens_computed += self.take_tokens(id, budget, scheduled)? as u64;
        }
        Ok(())
    }

    /// Admits waiting sequences in (aged) priority order while their prompt, the
    /// expected growth and the watermark fit; stops at the first that does not, so
    /// order holds. `others_wait`: running sequences this step leaves out still hold
    /// and grow their pages (a prefill-first step), so an empty batch is not alone.
    fn schedule_admissions(&mut self, budget: &mut Budget, scheduled: &mut Vec<(SeqId, usize)>, others_wait: bool) -> Result<(), CoreError> {
        let (now, aging) = (self.stats.num_steps, self.config.aging_steps);
        self.refresh_admission_ratio();
        if budget.tokens == 0 || budget.seqs == 0 || self.running.len() >= self.config.max_num_seqs {
            // Nothing can come in (the loop below would stop before its first admission): no
            // sort. The rank ends in the id, a total order, so sorting later gives the order
            // sorting every step would have. (An offline batch of thousands of prompts waits
            // behind a full running set: the sort was most of such a step's schedule.)
            return Ok(());
        }
        let seqs = &self.seqs;
        self.waiting.sort_by_key(|id| seqs[id].waiting_rank(now, aging));
        // Parked sequences (see `Sequence::parked`) stay out until they get a token.
        while let Some(id) = self.waiting.iter().copied().find(|id| !self.seqs[id].parked && self.seqs[id].placeholders == 0) {
            if budget.tokens == 0 || budget.seqs == 0 || self.running.len() >= self.config.max_num_seqs {
                break;
            }
            let seq = &self.seqs[&id];
            let end = self.admission_end(seq, budget.tokens);
            let needed = self.kv.blocks_to_admit(&seq.tokens[..end], seq.reserve_tokens, seq.root);
            // A step that runs nothing else admits on the prompt's pages alone (no watermark,
            // no expected growth), or a large prompt could never start (an idle pool), nor
            // the waiting sibling of beams that wait for its logits row (running, but with
            // nothing to compute). Otherwise the room the running set is expected to grow
            // into is kept too (see `admission`).
            let fits = if needed == usize::MAX {
                false
            } else if scheduled.is_empty() && !others_wait {
                needed <= self.kv.num_free_blocks()
            } else {
                self.admission_fits(id, needed, self.rules.watermark_blocks)?
            };
            if !fits {
                break;
            }
            self.admit(id, budget, scheduled)?;
        }
        Ok(())
    }

    /// Tokens an admission records in the KV space: the whole prompt, or with a sliding
    /// window only its cached prefix and the first chunk the budget allows (the rest is
    /// appended chunk by chunk, its pages taken as it goes, like a decode's).
    pub(super) fn admission_end(&self, seq: &super::sequence::Sequence, budget_tokens: usize) -> usize {
        match self.config.sliding_window {
            Some(_) => (self.kv.num_cached_tokens(&seq.tokens, seq.root) + budget_tokens.max(1)).min(seq.tokens.len()),
            None => seq.tokens.len(),
        }
    }

    /// Tokens past `kv_tokens` to record now: every sampled one, or the next prompt chunk
    /// of a windowed prompt admitted in part (at most the budget).
    pub(super) fn num_to_append(&self, seq: &super::sequence::Sequence, budget_tokens: usize) -> usize {
        let pending = seq.tokens.len() - seq.kv_tokens;
        if seq.prefill_left > 0 {
            pending.min(budget_tokens)
        } else {
            pending
        }
    }

    fn admit(&mut self, id: SeqId, budget: &mut Budget, scheduled: &mut Vec<(SeqId, usize)>) -> Result<(), CoreError> {
        let seq = &self.seqs[&id];
        let end = self.admission_end(seq, budget.tokens);
        let cached = self.kv.admit(id, &seq.tokens[..end], seq.reserve_tokens, seq.root)?;
        self.waiting.retain(|&s| s != id);
        let seq = self.seqs.get_mut(&id).expect("waiting sequence");
        seq.cached_tokens.get_or_insert(cached);
        seq.kv_tokens = end;
        seq.prefill_left = seq.tokens.len() - end;
        seq.num_computed = cached;
        seq.status = SeqStatus::Running;
        self.running.push(id);
        self.stats.cached_prompt_tokens += cached as u64;
        self.stats.prompt_tokens_computed += self.take_tokens(id, budget, scheduled)? as u64;
        Ok(())
    }

    /// Records a running sequence's next `n` tokens (sampled ones, or a windowed prompt's
    /// next chunk) in the KV space: pages are taken (and a shared, partly filled last page
    /// copied on write) only now.
    fn append_sampled(&mut self, id: SeqId, n: usize, out: &mut SchedulerOutput) -> Result<(), CoreError> {
        let seq = self.seqs.get_mut(&id).expect("known sequence");
        out.copies.extend(self.kv.append(id, &seq.tokens[seq.kv_tokens..seq.kv_tokens + n])?);
        seq.kv_tokens += n;
        seq.prefill_left = seq.prefill_left.saturating_sub(n);
        Ok(())
    }

    /// Schedules the sequence's next uncomputed tokens that fit the budget and commits
    /// them (their K/V is written this step, before any read); returns how many.
    fn take_tokens(&mut self, id: SeqId, budget: &mut Budget, scheduled: &mut Vec<(SeqId, usize)>) -> Result<usize, CoreError> {
        let seq = self.seqs.get_mut(&id).expect("known sequence");
        let n = (seq.kv_tokens - seq.num_computed).min(budget.tokens);
        let first_query = seq.num_computed;
        seq.num_computed += n;
        self.kv.commit(id, seq.num_computed)?;
        if let Some(window) = self.config.sliding_window {
            // No query of this step or a later one reads before the window of this step's first.
            self.kv.release_outside_window(id, crate::block_manager::window::first_needed_pos(first_query, window))?;
        }
        budget.tokens -= n;
        budget.seqs -= 1;
        scheduled.push((id, n));
        Ok(n)
    }

    /// Flattens the scheduled sequences into the runner's arrays. Block tables are
    /// read last, after every allocation and copy-on-write of the step.
    fn fill_batch(&self, scheduled: &[(SeqId, usize)], out: &mut SchedulerOutput) -> Result<(), CoreError> {
        let max_blocks = scheduled.iter().map(|(id, _)| self.kv.block_table(*id).map(|t| t.len())).try_fold(0, |m, l| l.map(|l| m.max(l)))?;
        out.max_blocks = max_blocks;
        out.query_start_loc.push(0);
        for &(id, n) in scheduled {
            let seq = &self.seqs[&id];
            let end = seq.num_computed;
            let start = end - n;
            out.seq_ids.push(id);
            out.num_scheduled_tokens.push(n as i32);
            out.do_sample.push(end == seq.tokens.len());
            out.num_draft_tokens.push(seq.drafts as i32);
            out.input_ids.extend(seq.tokens[start..end].iter().map(|&t| t as i64));
            out.positions.extend((start..end).map(|p| p as i64));
            self.kv.slot_mapping_into(id, start, end, &mut out.slot_mapping)?;
            out.query_start_loc.push(out.input_ids.len() as i32);
            out.seq_lens.push(end as i32);
            let table = self.kv.block_table(id)?;
            out.block_tables.extend(table.iter().map(|&b| b as i32));
            out.block_tables.extend(std::iter::repeat_n(0, max_blocks - table.len()));
        }
        Ok(())
    }
}
