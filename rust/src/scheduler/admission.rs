//! Admission by expected growth: a waiting prompt comes in only when the pages the
//! running set is still expected to take, at its peak, leave room for it.
//!
//! Admitting on the prompt's pages alone (plus a watermark) is optimistic: running
//! sequences then grow into the pool and decodes preempt. SGLang instead expects every
//! running request to still generate `ratio x` its remaining `max_tokens` and admits
//! only what fits beside that (its `new_token_ratio`). We keep its adaptive ratio and
//! add two things:
//!
//! * **The peak, not the sum.** Sequences finish at different times and give their
//!   pages back, so the pool is never asked for the sum of every final length at once.
//!   With `r_i` the expected remaining tokens of sequence `i` (each running sequence
//!   gains one token a step), the pages the set holds `t` steps from now are
//!   `sum over i with r_i >= t of pages(len_i + t)`; it peaks just before one of them
//!   finishes, so checking `t = r_k` for every `k` is exact for that model.
//! * **A learned floor.** The ratio each finished sequence actually used (outputs /
//!   the outputs it was allowed), weighted toward recent ones, bounds the ratio from
//!   below: requests that always run to `max_tokens` (benchmarks with `ignore_eos`)
//!   are then expected to, and chat requests that stop at a third of it are not
//!   charged for the rest.
//!
//! The ratio starts at `init_ratio`, decays linearly to `min_ratio` over `decay_steps`
//! steps while nothing is preempted, and each step that preempts halves its distance
//! to 1. Pages are whole: a sequence's partly filled last page absorbs its first tokens
//! for free, so short remainders cost nothing (last-page aware).
//!
//! A page shared by several running sequences (a common prefix, `n > 1` siblings, beams)
//! is freed when the last of them finishes, so it is credited to the holder expected to
//! finish last, and a page something outside the running set also holds (a swapped or
//! parked sequence) to none: crediting each holder with its whole table would count a
//! shared page once per holder and admit into room that never comes.
//!
//! Limits: swapped-out sequences and the future forks of `n > 1` requests are not
//! counted; and the rule trades occupancy for preemptions, which loses steps where a
//! preemption is nearly free (swap on the CPU: `admission_policy = "prompt_only"` keeps the old rule).
//! A step that schedules nothing else still admits on the prompt alone (liveness).

use std::collections::HashMap;

use super::config::{AdmissionConfig, AdmissionPolicy, KvLayout};
use super::sequence::Sequence;
use super::Scheduler;
use crate::block_manager::{BlockId, SeqId};
use crate::error::CoreError;

/// Weight of the history in the learned floor at each finish (about the last 50 count).
const FLOOR_MEMORY: f64 = 0.98;

/// The adaptive part of the rule: the ratio and the learned floor, updated lazily.
#[derive(Clone, Debug)]
pub struct AdmissionState {
    ratio: f64,
    /// Step and total preemptions when `ratio` was last brought up to date.
    seen_step: u64,
    seen_preemptions: u64,
    /// Recent-weighted sums over finished sequences of outputs generated and allowed.
    used: f64,
    allowed: f64,
}

/// One sequence as the peak check sees it, in pages relative to the pool now.
#[derive(Clone, Copy, Debug)]
pub struct Growth {
    /// Tokens it holds now (sampled ones included).
    pub len: usize,
    /// Pages its block table covers now.
    pub covered: usize,
    /// Free pages it takes before its first step: its prompt's new pages for a
    /// candidate, 0 for a running sequence.
    pub upfront: usize,
    /// Pages it gives back when it finishes, counted from now: its table for a running
    /// sequence, 0 for a candidate (it gives back what it took).
    pub held: usize,
    /// Tokens it is expected to still generate.
    pub remaining: usize,
}

impl Growth {
    /// Free pages it needs `t` steps from now beyond today's (negative once it finished).
    fn extra_at(&self, t: usize, block_size: usize) -> isize {
        if t <= self.remaining {
            (self.upfront + (self.len + t).div_ceil(block_size)) as isize - self.covered as isize
        } else {
            -(self.held as isize)
        }
    }
}

/// The most free pages `seqs` are expected to need at once from now on. Each gains a
/// token a step until its `remaining` runs out, then frees its pages, so the need
/// peaks at a step where one of them is at its last token: checking those steps
/// (and now) is exact for that model. O(n^2) for n sequences (n <= max_num_seqs).
pub fn peak_extra_pages(seqs: &[Growth], block_size: usize) -> usize {
    let need_at = |t: usize| -> isize { seqs.iter().map(|g| g.extra_at(t, block_size)).sum() };
    let peak = std::iter::once(0).chain(seqs.iter().map(|g| g.remaining)).map(need_at).max().unwrap_or(0);
    peak.max(0) as usize
}

/// Pages each sequence gives back when it finishes: `pages[i]` are sequence `i`'s device
/// pages with their reference counts, `remaining[i]` the tokens it is expected to still
/// generate. A page goes back when its last holder finishes, so it is credited to the
/// holder with the most remaining (the first of equals); a page with more references than
/// holders listed here is held by something else too and is credited to none. Pages with
/// one reference (all of them without sharing) are counted directly; only shared ones
/// are looked up, so the usual case costs no hashing on this per-admission path.
pub fn pages_freed_at_finish(pages: &[Vec<(BlockId, u32)>], remaining: &[usize]) -> Vec<usize> {
    struct Holder {
        seq: usize,
        remaining: usize,
        holders: u32,
        refs: u32,
    }
    let mut held = vec![0; pages.len()];
    let mut last: HashMap<BlockId, Holder> = HashMap::new();
    for (i, own) in pages.iter().enumerate() {
        for &(block, refs) in own {
            if refs <= 1 {
                held[i] += 1;
                continue;
            }
            let h = last.entry(block).or_insert(Holder { seq: i, remaining: remaining[i], holders: 0, refs });
            if remaining[i] > h.remaining {
                h.seq = i;
                h.remaining = remaining[i];
            }
            h.holders += 1;
        }
    }
    for h in last.values() {
        if h.holders >= h.refs {
            held[h.seq] += 1;
        }
    }
    held
}

impl AdmissionState {
    pub fn new(config: &AdmissionConfig) -> Self {
        Self { ratio: config.init_ratio, seen_step: 0, seen_preemptions: 0, used: 0.0, allowed: 0.0 }
    }

    /// Brings the ratio up to `step`: a rise if anything was preempted since the last
    /// update (the estimate was too low), else the decay of the steps in between.
    pub fn advance(&mut self, config: &AdmissionConfig, step: u64, preemptions: u64) {
        if preemptions > self.seen_preemptions {
            self.ratio = (self.ratio + 1.0) / 2.0;
        } else if config.decay_steps > 0 {
            let per_step = (config.init_ratio - config.min_ratio).max(0.0) / config.decay_steps as f64;
            let steps = step.saturating_sub(self.seen_step) as f64;
            self.ratio = (self.ratio - per_step * steps).max(config.min_ratio);
        }
        self.seen_step = step;
        self.seen_preemptions = preemptions;
    }

    /// Learns from a sequence that ends: the share of its allowed outputs it generated.
    pub fn observe_finish(&mut self, seq: &Sequence) {
        let allowed = seq.max_len.saturating_sub(seq.prompt_len);
        if allowed == 0 || seq.tokens.len() <= seq.prompt_len {
            return; // nothing to learn: no outputs allowed, or it never generated one
        }
        let used = (seq.tokens.len() - seq.prompt_len).min(allowed);
        self.used = self.used * FLOOR_MEMORY + used as f64;
        self.allowed = self.allowed * FLOOR_MEMORY + allowed as f64;
    }

    /// The ratio admission uses now: the decaying one, or the learned floor if higher.
    pub fn ratio(&self) -> f64 {
        let floor = if self.allowed > 0.0 { self.used / self.allowed } else { 0.0 };
        self.ratio.max(floor).min(1.0)
    }

    /// Tokens a sequence is expected to still generate.
    pub fn expected_remaining(&self, seq: &Sequence) -> usize {
        let left = seq.max_len.saturating_sub(seq.tokens.len());
        (left as f64 * self.ratio()).ceil() as usize
    }
}

impl AdmissionConfig {
    pub fn expects_growth(&self) -> bool {
        self.policy == AdmissionPolicy::ExpectedGrowth
    }
}

impl Scheduler {
    /// Whether admitting waiting sequence `id`, whose prompt takes `needed` free pages,
    /// leaves `watermark` pages free at the expected peak of the running set and itself.
    /// The prompt-only policy and the contiguous layout (whose regions never grow)
    /// check the prompt's pages alone.
    pub(super) fn admission_fits(&self, id: SeqId, needed: usize, watermark: usize) -> Result<bool, CoreError> {
        let free = self.kv.num_free_blocks();
        if !self.config.admission.expects_growth() || self.rules.layout != KvLayout::Paged {
            return Ok(needed + watermark <= free);
        }
        let bs = self.kv.block_size();
        let mut seqs = Vec::with_capacity(self.running.len() + 1);
        let mut pages = Vec::with_capacity(self.running.len());
        for rid in &self.running {
            let seq = &self.seqs[rid];
            let covered = self.kv.block_table(*rid)?.len();
            let remaining = self.admission.expected_remaining(seq);
            let mut own = Vec::new();
            self.kv.device_pages_with_refs(*rid, &mut own)?;
            pages.push(own);
            seqs.push(Growth { len: seq.tokens.len(), covered, upfront: 0, held: 0, remaining });
        }
        let remaining: Vec<usize> = seqs.iter().map(|g| g.remaining).collect();
        for (g, held) in seqs.iter_mut().zip(pages_freed_at_finish(&pages, &remaining)) {
            g.held = held;
        }
        let seq = &self.seqs[&id];
        let remaining = self.admission.expected_remaining(seq);
        seqs.push(Growth { len: seq.tokens.len(), covered: seq.tokens.len().div_ceil(bs), upfront: needed, held: 0, remaining });
        Ok(peak_extra_pages(&seqs, bs).saturating_add(watermark) <= free)
    }

    /// Brings the ratio up to this step (admissions do not run in a step that preempts,
    /// so the rise is applied at the next one that admits).
    pub(super) fn refresh_admission_ratio(&mut self) {
        let preemptions = self.stats.num_swap_preemptions + self.stats.num_recompute_preemptions;
        self.admission.advance(&self.config.admission, self.stats.num_steps, preemptions);
    }

    /// The share of its remaining `max_tokens` each running sequence is expected to
    /// still generate, as the next admission will use it.
    pub fn admission_ratio(&self) -> f64 {
        let mut state = self.admission.clone();
        let preemptions = self.stats.num_swap_preemptions + self.stats.num_recompute_preemptions;
        state.advance(&self.config.admission, self.stats.num_steps, preemptions);
        state.ratio()
    }
}

#[cfg(test)]
mod tests {
    use super::pages_freed_at_finish;

    #[test]
    fn a_shared_page_is_credited_once_to_the_holder_that_finishes_last() {
        // 0 and 1 share pages 10 and 11; 1 is expected to run longer, so it frees them.
        let pages = vec![vec![(10, 2), (11, 2), (12, 1)], vec![(10, 2), (11, 2), (13, 1), (14, 1)]];
        assert_eq!(pages_freed_at_finish(&pages, &[5, 9]), vec![1, 4]);
        assert_eq!(pages_freed_at_finish(&pages, &[9, 5]), vec![3, 2]);
        // equal remaining: the first holder takes it (they finish together either way)
        assert_eq!(pages_freed_at_finish(&pages, &[7, 7]), vec![3, 2]);
    }

    #[test]
    fn a_page_someone_outside_the_set_also_holds_is_credited_to_none() {
        // page 20 has 3 references, only 2 of them running sequences (a parked or swapped one holds it)
        let pages = vec![vec![(20, 3), (21, 1)], vec![(20, 3)]];
        assert_eq!(pages_freed_at_finish(&pages, &[1, 2]), vec![1, 0]);
        assert_eq!(pages_freed_at_finish(&[], &[]), Vec::<usize>::new());
    }
}
