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

use super::config::{AdmissionConfig, AdmissionPolicy, KvLayout};
use super::sequence::Sequence;
use super::Scheduler;
use crate::block_manager::{BlockId, IdMap, SeqId};
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
    #[cfg(test)]
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
/// (and now) is exact for that model.
///
/// O(n log n) for n sequences: the candidate steps are visited in order, and a sequence
/// leaves the sum once, when the step passes its last token. The sum of its page counts
/// at step `t`, `ceil((len + t) / bs)` each, is `q + t div bs` plus one where the
/// sequence's residue `(len + bs - 1) mod bs` reaches `bs - t mod bs`: a count over the
/// residues (a Fenwick tree of `bs` counters). The rule checks this on every admission
/// against the whole running set, and the direct sum over every (step, sequence) pair
/// made a burst of n admissions cost O(n^3) (1024 prompts at once: ~0.75 s of one step);
/// it is kept as the reference the tests compare with (`peak_extra_pages_direct`).
pub fn peak_extra_pages(seqs: &[Growth], block_size: usize) -> usize {
    let bs = block_size.max(1);
    // i128: the same sums as the direct form, which cannot overflow here for any usize inputs
    // the direct form's own `len + t` accepts.
    let own = |g: &Growth| -> (i128, usize) {
        let a = g.len as i128 + bs as i128 - 1;
        (g.upfront as i128 - g.covered as i128 + a / bs as i128, (a % bs as i128) as usize)
    };
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_unstable_by_key(|&i| seqs[i].remaining);
    let mut residues = ResidueCounts::new(bs);
    let mut base: i128 = 0; // sum over the running ones of (upfront - covered + q)
    for g in seqs {
        let (b, r) = own(g);
        base += b;
        residues.add(r, 1);
    }
    let (mut active, mut freed, mut next) = (seqs.len() as i128, 0i128, 0usize);
    let mut peak = i128::MIN; // (step 0 is always checked: set on the first turn)
    for t in std::iter::once(0).chain(order.iter().map(|&i| seqs[i].remaining)) {
        // a sequence whose last token came before step t has finished and freed its pages
        while next < order.len() && seqs[order[next]].remaining < t {
            let g = &seqs[order[next]];
            let (b, r) = own(g);
            base -= b;
            residues.add(r, -1);
            active -= 1;
            freed += g.held as i128;
            next += 1;
        }
        let tm = t % bs;
        let carried = if tm == 0 { 0 } else { residues.at_least(bs - tm) };
        let need = base + active * (t / bs) as i128 + carried - freed;
        peak = peak.max(need);
    }
    peak.clamp(0, usize::MAX as i128) as usize
}

/// The direct form of `peak_extra_pages`, O(n^2): every candidate step, every sequence.
/// The reference `peak_extra_pages` is tested against.
#[cfg(test)]
pub fn peak_extra_pages_direct(seqs: &[Growth], block_size: usize) -> usize {
    let need_at = |t: usize| -> isize { seqs.iter().map(|g| g.extra_at(t, block_size)).sum() };
    let peak = std::iter::once(0).chain(seqs.iter().map(|g| g.remaining)).map(need_at).max().unwrap_or(0);
    peak.max(0) as usize
}

/// Counts of the residues `0..bs` (a Fenwick tree): how many are at least `k`, in O(log bs).
struct ResidueCounts {
    tree: Vec<i128>,
    total: i128,
}

impl ResidueCounts {
    fn new(bs: usize) -> Self {
        Self { tree: vec![0; bs + 1], total: 0 }
    }

    fn add(&mut self, residue: usize, by: i128) {
        self.total += by;
        let mut i = residue + 1;
        while i < self.tree.len() {
            self.tree[i] += by;
            i += i & i.wrapping_neg();
        }
    }

    /// How many residues are `>= k` (`k >= 1`).
    fn at_least(&self, k: usize) -> i128 {
        let (mut i, mut below) = (k.min(self.tree.len() - 1), 0i128); // residues 0..k
        while i > 0 {
            below += self.tree[i];
            i -= i & i.wrapping_neg();
        }
        self.total - below
    }
}

/// Pages each sequence gives back when it finishes: sequence `i`'s device pages with their
/// reference counts are `pages[ends[i - 1]..ends[i]]` (from 0 for the first), `remaining[i]`
/// the tokens it is expected to still generate. A page goes back when its last holder
/// finishes, so it is credited to the holder with the most remaining (the first of equals); a
/// page with more references than holders listed here is held by something else too and is
/// credited to none. Pages with one reference (all of them without sharing) are counted
/// directly; only shared ones are looked up, so the usual case costs no hashing on this
/// per-admission path.
pub fn pages_freed_at_finish(pages: &[(BlockId, u32)], ends: &[usize], remaining: &[usize]) -> Vec<usize> {
    struct Holder {
        seq: usize,
        remaining: usize,
        holders: u32,
        refs: u32,
    }
    let mut held = vec![0; ends.len()];
    let mut last: IdMap<BlockId, Holder> = IdMap::default();
    let mut start = 0;
    for (i, &end) in ends.iter().enumerate() {
        for &(block, refs) in &pages[start..end] {
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
        start = end;
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
        // every running sequence's device pages in one buffer, `ends[i]` closing sequence i's
        // (one allocation for the set: this runs on every admission)
        let mut pages = Vec::new();
        let mut ends = Vec::with_capacity(self.running.len());
        for rid in &self.running {
            let seq = &self.seqs[rid];
            let covered = self.kv.block_table(*rid)?.len();
            let remaining = self.admission.expected_remaining(seq);
            self.kv.device_pages_with_refs(*rid, &mut pages)?;
            ends.push(pages.len());
            seqs.push(Growth { len: seq.tokens.len(), covered, upfront: 0, held: 0, remaining });
        }
        let remaining: Vec<usize> = seqs.iter().map(|g| g.remaining).collect();
        for (g, held) in seqs.iter_mut().zip(pages_freed_at_finish(&pages, &ends, &remaining)) {
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
    use super::{pages_freed_at_finish, peak_extra_pages, peak_extra_pages_direct, Growth};
    use proptest::prelude::*;

    fn growth() -> impl Strategy<Value = Growth> {
        (0usize..200, 0usize..20, 0usize..6, 0usize..20, prop_oneof![0usize..5, 0usize..300])
            .prop_map(|(len, covered, upfront, held, remaining)| Growth { len, covered, upfront, held, remaining })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        /// The sorted, counted form gives the direct sum's peak for any set (equal remainders,
        /// zero remainders, candidates with upfront pages, sequences covering more than their length).
        #[test]
        fn the_fast_peak_is_the_direct_peak(seqs in proptest::collection::vec(growth(), 0..40),
                                            bs in prop_oneof![Just(1usize), Just(4), Just(16), 1usize..40]) {
            prop_assert_eq!(peak_extra_pages(&seqs, bs), peak_extra_pages_direct(&seqs, bs));
        }
    }

    #[test]
    fn the_peak_of_a_burst_is_quick() {
        // 4096 sequences: the direct form's 16.8M terms, here a sort and a few tree walks each
        let seqs: Vec<Growth> = (0..4096)
            .map(|i| Growth { len: 16 + i % 37, covered: 2 + i % 3, upfront: i % 2, held: 3, remaining: (i * 7919) % 500 })
            .collect();
        assert_eq!(peak_extra_pages(&seqs, 16), peak_extra_pages_direct(&seqs, 16));
    }

    /// `pages_freed_at_finish` of per-sequence lists.
    fn freed(pages: &[Vec<(u32, u32)>], remaining: &[usize]) -> Vec<usize> {
        let flat: Vec<(u32, u32)> = pages.iter().flatten().copied().collect();
        let ends: Vec<usize> = pages.iter().scan(0, |n, p| { *n += p.len(); Some(*n) }).collect();
        pages_freed_at_finish(&flat, &ends, remaining)
    }

    #[test]
    fn a_shared_page_is_credited_once_to_the_holder_that_finishes_last() {
        // 0 and 1 share pages 10 and 11; 1 is expected to run longer, so it frees them.
        let pages = vec![vec![(10, 2), (11, 2), (12, 1)], vec![(10, 2), (11, 2), (13, 1), (14, 1)]];
        assert_eq!(freed(&pages, &[5, 9]), vec![1, 4]);
        assert_eq!(freed(&pages, &[9, 5]), vec![3, 2]);
        // equal remaining: the first holder takes it (they finish together either way)
        assert_eq!(freed(&pages, &[7, 7]), vec![3, 2]);
    }

    #[test]
    fn a_page_someone_outside_the_set_also_holds_is_credited_to_none() {
        // page 20 has 3 references, only 2 of them running sequences (a parked or swapped one holds it)
        let pages = vec![vec![(20, 3), (21, 1)], vec![(20, 3)]];
        assert_eq!(freed(&pages, &[1, 2]), vec![1, 0]);
        assert_eq!(freed(&[], &[]), Vec::<usize>::new());
    }
}
