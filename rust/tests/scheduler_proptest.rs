//! Property test of the scheduler: random configurations (layout, pool sizes, host and
//! disk tiers, prefix caching, sliding window, preemption mode, budgets, admission rule,
//! prefill-first, whole-sequence swap) and random workloads (shared prefixes, `n = 2`
//! forks, priorities, staggered arrivals, aborts), driven to the end by a simulated
//! runner whose memory holds each position's token as its "K/V".
//!
//! Every step the runner does what the Python runner does (tier transfers, then
//! copy-on-write copies, then the forward's writes) and reads every scheduled sequence's
//! context back through its block table, from the first position its window needs.
//! After every step the scheduler's invariants hold. At the end every sequence carries
//! exactly the tokens a deterministic model gives it without any memory pressure (an
//! aborted one a prefix of them), and every page on every tier is free again. KV events
//! are on: after every step the stream alone rebuilds what each tier caches.

use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use std::collections::BTreeMap;

use pagedrs::block_manager::{KvEvent, Tier};
use pagedrs::scheduler::{
    AdmissionConfig, AdmissionPolicy, KvConfig, KvLayout, PreemptionCost, PreemptionMode, ReservePolicy, Scheduler, SchedulerConfig,
    SchedulerOutput,
};

const MAX_MODEL_LEN: usize = 64;

#[derive(Debug, Clone)]
struct Setup {
    layout: KvLayout,
    gpu_blocks: usize,
    block_size: usize,
    cpu_blocks: usize,
    disk_blocks: usize,
    prefix_caching: bool,
    host_cache_evicted: bool,
    watermark: f64,
    mode: PreemptionMode,
    window: Option<usize>,
    budget: usize,
    max_num_seqs: usize,
    policy: AdmissionPolicy,
    prefill_first: bool,
    whole_sequence_swap: bool,
    aging_steps: u64,
}

#[derive(Debug, Clone)]
struct Req {
    /// Leading tokens from a stream every request shares (prefix-cache hits).
    shared: usize,
    own: usize,
    max_tokens: usize,
    /// 2: forks at its first sample (`n = 2`), the samples sharing pages until they diverge.
    samples: usize,
    priority: i64,
    arrive_at: u64,
    /// Aborted this many steps after it arrives, if still running.
    abort_after: Option<u64>,
}

fn setup() -> impl Strategy<Value = Setup> {
    let layout = prop_oneof![
        4 => Just(KvLayout::Paged),
        1 => Just(KvLayout::Contiguous(ReservePolicy::Request)),
        1 => Just(KvLayout::Contiguous(ReservePolicy::MaxModelLen)),
    ];
    let mode = prop_oneof![Just(PreemptionMode::Swap), Just(PreemptionMode::Recompute), Just(PreemptionMode::Auto)];
    let window = prop_oneof![2 => Just(None), 1 => (1usize..12).prop_map(Some)];
    let policy = prop_oneof![Just(AdmissionPolicy::PromptOnly), Just(AdmissionPolicy::ExpectedGrowth)];
    (
        (layout, 12usize..80, 1usize..6, prop_oneof![Just(0usize), 1usize..24], prop_oneof![2 => Just(0usize), 1 => 1usize..16]),
        (any::<bool>(), any::<bool>(), prop_oneof![Just(0.0), Just(0.1)], mode, window),
        (1usize..40, 1usize..6, policy, any::<bool>(), any::<bool>(), prop_oneof![Just(0u64), 1u64..4]),
    )
        .prop_map(|((layout, gpu_tokens, block_size, cpu_blocks, disk_blocks), (prefix_caching, host_cache_evicted, watermark, mode, window), rest)| {
            let (budget, max_num_seqs, policy, prefill_first, whole_sequence_swap, aging_steps) = rest;
            // 12 to 80 tokens of device pages: the longest request (24 + 24 tokens, twice
            // with n = 2) may not fit at all (it is refused), most pools preempt.
            let gpu_blocks = (gpu_tokens / block_size).max(2);
            Setup {
                layout,
                gpu_blocks,
                block_size,
                cpu_blocks,
                disk_blocks,
                prefix_caching,
                host_cache_evicted,
                watermark,
                mode,
                window,
                budget,
                max_num_seqs,
                policy,
                prefill_first,
                whole_sequence_swap,
                aging_steps,
            }
        })
}

fn req() -> impl Strategy<Value = Req> {
    (0usize..13, 1usize..13, 1usize..25, prop_oneof![3 => Just(1usize), 1 => Just(2usize)], 0i64..3, 0u64..12, prop_oneof![3 => Just(None), 1 => (0u64..10).prop_map(Some)])
        .prop_map(|(shared, own, max_tokens, samples, priority, arrive_at, abort_after)| Req { shared, own, max_tokens, samples, priority, arrive_at, abort_after })
}

/// Deterministic pseudo-random numbers (splitmix64).
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The "model": the next token is a function of the whole context; a forked child's
/// tokens are offset so that the two samples diverge (and copy their last page on write).
fn next_token(context: &[u32], child: bool) -> u32 {
    (mix(context.iter().fold(7, |a, &t| a.wrapping_mul(31).wrapping_add(t as u64))) % 1000) as u32 + if child { 1000 } else { 0 }
}

fn prompt(r: usize, req: &Req) -> Vec<u32> {
    let mut p: Vec<u32> = (0..req.shared as u32).map(|i| i % 5).collect();
    p.extend((0..req.own as u32).map(|i| 100 + r as u32 * 20 + i));
    p
}

/// Ids of the extra forks `chaos` makes (above every request's ids).
const EXTRA_CHILDREN: u64 = 10_000;

/// Children generate offset tokens: the `n = 2` second sample (odd id) and extra forks.
fn is_child(seq: u64) -> bool {
    seq % 2 == 1 || seq >= EXTRA_CHILDREN
}

/// What a sample generates with the pool to itself.
fn reference(prompt: &[u32], max_tokens: usize, child: bool) -> Vec<u32> {
    let mut t = prompt.to_vec();
    for _ in 0..max_tokens {
        t.push(next_token(&t, child));
    }
    t
}

/// The runner's memory: one token per slot, per tier.
struct Runner {
    bs: usize,
    gpu: Vec<Option<u32>>,
    cpu: Vec<Option<u32>>,
    disk: Vec<Option<u32>>,
}

impl Runner {
    fn mem(&mut self, tier: Tier) -> &mut Vec<Option<u32>> {
        match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
            Tier::Disk => &mut self.disk,
        }
    }

    fn copy(&mut self, pairs: &[(u32, u32)], src: Tier, dst: Tier) {
        let bs = self.bs;
        for &(s, d) in pairs {
            for off in 0..bs {
                let v = self.mem(src)[s as usize * bs + off];
                self.mem(dst)[d as usize * bs + off] = v;
            }
        }
    }

    /// Transfers, copies, the forward's K/V writes, then every scheduled sequence's reads.
    fn step(&mut self, s: &mut Scheduler, out: &SchedulerOutput, tokens: &BTreeMap<u64, Vec<u32>>, window: Option<usize>) -> Result<(), TestCaseError> {
        for t in &out.transfers {
            self.copy(&t.pairs, t.src, t.dst);
        }
        let ids: Vec<u64> = out.transfers.iter().map(|t| t.id).collect();
        s.complete_transfers(&ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.copy(&out.copies, Tier::Gpu, Tier::Gpu);
        prop_assert_eq!(out.slot_mapping.len(), out.input_ids.len());
        for (&slot, &token) in out.slot_mapping.iter().zip(&out.input_ids) {
            prop_assert!(slot >= 0 && (slot as usize) < self.gpu.len(), "slot {} out of the pool", slot);
            self.gpu[slot as usize] = Some(token as u32);
        }
        for (i, id) in out.seq_ids.iter().enumerate() {
            let row = &out.block_tables[i * out.max_blocks..(i + 1) * out.max_blocks];
            let len = out.seq_lens[i] as usize;
            let first_query = len - out.num_scheduled_tokens[i] as usize;
            let from = window.map_or(0, |w| (first_query + 1).saturating_sub(w));
            let mut read = Vec::with_capacity(len - from);
            for p in from..len {
                let block = row[p / self.bs];
                prop_assert!(block >= 0, "sequence {} reads position {} through a released page", id, p);
                read.push(self.gpu[block as usize * self.bs + p % self.bs]);
            }
            let expected: Vec<Option<u32>> = tokens[id][from..len].iter().map(|&t| Some(t)).collect();
            prop_assert_eq!(read, expected, "sequence {} reads wrong K/V", id);
        }
        Ok(())
    }

    /// A step that fails at `point`: 0 before anything ran (every transfer destination torn),
    /// 1 after the transfers and copies with half of the forward's K/V written as garbage, 2
    /// with only the first transfers done and reported (the rest torn). Reports the step
    /// failed and returns the sequences the core reset.
    fn fail_step(&mut self, s: &mut Scheduler, out: &SchedulerOutput, point: u64) -> Result<Vec<u64>, TestCaseError> {
        const GARBAGE: Option<u32> = Some(u32::MAX);
        let done = match point {
            0 => 0,
            1 => out.transfers.len(),
            _ => out.transfers.len() / 2,
        };
        for (i, t) in out.transfers.iter().enumerate() {
            if i < done {
                self.copy(&t.pairs, t.src, t.dst);
            } else {
                let bs = self.bs;
                for &(_, d) in &t.pairs {
                    self.mem(t.dst)[d as usize * bs..(d as usize + 1) * bs].fill(GARBAGE);
                }
            }
        }
        let ids: Vec<u64> = out.transfers[..done].iter().map(|t| t.id).collect();
        s.complete_transfers(&ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if point == 1 {
            self.copy(&out.copies, Tier::Gpu, Tier::Gpu);
            for &slot in out.slot_mapping.iter().step_by(2) {
                self.gpu[slot as usize] = GARBAGE;
            }
        }
        s.complete_step(out.step_id, false).map_err(|e| TestCaseError::fail(format!("complete_step failed: {e}")))
    }
}

fn build(cfg: &Setup) -> Scheduler {
    let sched = SchedulerConfig {
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.budget,
        max_model_len: MAX_MODEL_LEN,
        preemption_mode: cfg.mode,
        aging_steps: cfg.aging_steps,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 0.3 },
        admission: AdmissionConfig { policy: cfg.policy, ..AdmissionConfig::default() },
        sliding_window: cfg.window.filter(|_| cfg.layout == KvLayout::Paged),
        prefill_first: cfg.prefill_first,
    };
    let kv = KvConfig {
        layout: cfg.layout,
        num_gpu_blocks: cfg.gpu_blocks,
        block_size: cfg.block_size,
        num_cpu_blocks: cfg.cpu_blocks,
        enable_prefix_caching: cfg.prefix_caching,
        host_cache_evicted: cfg.host_cache_evicted,
        num_disk_blocks: cfg.disk_blocks,
        watermark: cfg.watermark,
        eviction_policy: Default::default(),
    };
    let mut s = Scheduler::build(sched, kv).expect("a valid configuration");
    s.set_whole_sequence_swap(cfg.whole_sequence_swap);
    s.enable_kv_events();
    s
}

/// A router's view of the cache from the KV events alone: the page hashes on each tier.
#[derive(Default)]
struct EventMirror(BTreeMap<Tier, std::collections::BTreeSet<u64>>);

impl EventMirror {
    /// Applies what the scheduler logged since the last call, then compares with its tiers.
    fn sync(&mut self, s: &mut Scheduler, when: &str) -> Result<(), TestCaseError> {
        for e in s.take_kv_events() {
            match e {
                KvEvent::Stored { tier, hashes, .. } => {
                    for h in hashes {
                        prop_assert!(self.0.entry(tier).or_default().insert(h), "{}: page {} stored twice on {}", when, h, tier);
                    }
                }
                KvEvent::Removed { tier, hashes } => {
                    for h in hashes {
                        prop_assert!(self.0.entry(tier).or_default().remove(&h), "{}: page {} left {} unannounced", when, h, tier);
                    }
                }
                KvEvent::AllCleared => self.0.clear(),
            }
        }
        for tier in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
            let mine: Vec<u64> = self.0.get(&tier).map(|set| set.iter().copied().collect()).unwrap_or_default();
            prop_assert_eq!(mine, s.cached_hashes(tier), "{}: the event stream disagrees with tier {}", when, tier);
        }
        Ok(())
    }
}

/// Runs the workload to the end; returns how many forks had to wait for a region.
///
/// `chaos` drives what a beam-search engine does besides: a sampled token handed over a
/// few steps late (the sequence idles meanwhile, running, paused or parked), and extra
/// forks of a live sequence in whatever state it is.
fn run(cfg: Setup, reqs: Vec<Req>, chaos: Option<u64>) -> Result<u64, TestCaseError> {
    run_failing(cfg, reqs, chaos, None)
}

/// [`run`], where `failures` (a seed) makes about one step in eight fail at a random point
/// (see `Runner::fail_step`), at most four in a run (a failure restarts its sequences, so
/// a tiny budget with more would never finish); every step is reported with `complete_step`, explicitly or
/// (every other one) by the next `schedule`. A failed step's sequences start again from
/// their first token, so the outputs must still be the model's.
fn run_failing(cfg: Setup, reqs: Vec<Req>, chaos: Option<u64>, failures: Option<u64>) -> Result<u64, TestCaseError> {
    run_speculating(cfg, reqs, chaos, failures, None)
}

/// [`run_failing`], where `speculate` (a seed) gives every live sequence a proposal before each
/// step (speculative decoding): 0..4 drafts, a random number of them the model's own next
/// tokens and the rest wrong. After the step each sequence keeps the drafts the model agrees
/// with (`accept_drafts`), then appends its next token as usual; or, now and then, is rewound as
/// after an interrupt (`rewind`: the accepted drafts recorded, the last one computed again, no
/// token appended). Outputs, reads and pages must be exactly those of a run without drafts.
fn run_speculating(cfg: Setup, reqs: Vec<Req>, chaos: Option<u64>, failures: Option<u64>, speculate: Option<u64>) -> Result<u64, TestCaseError> {
    let fail_roll = |step: u64, salt: u64, n: u64| failures.map(|f| mix(f ^ step.wrapping_mul(0x9E37_79B9) ^ salt) % n);
    let mut draws = 0u64;
    let mut roll = |n: u64| -> u64 {
        draws += 1;
        chaos.map_or(n, |c| mix(c ^ draws.wrapping_mul(0x2545_F491_4F6C_DD1D)) % n)
    };
    let mut s = build(&cfg);
    let mut mirror = EventMirror::default();
    let window = s.config().sliding_window;
    let bs = cfg.block_size;
    let mut runner = Runner {
        bs,
        gpu: vec![None; cfg.gpu_blocks * bs],
        cpu: vec![None; s.kv().num_free_host_blocks() * bs],
        disk: vec![None; s.kv().num_disk_blocks() * bs],
    };
    let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut remaining: BTreeMap<u64, usize> = BTreeMap::new();
    let mut forks: BTreeMap<u64, u64> = BTreeMap::new(); // parent → child id, forked at its first sample
    let mut aborts: BTreeMap<u64, Vec<u64>> = BTreeMap::new(); // step → request ids
    let mut expected: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut ended: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut held: BTreeMap<u64, (u64, u32)> = BTreeMap::new(); // seq → (step it is handed over, token)
    let mut next_child = EXTRA_CHILDREN;
    let mut num_failed = 0;
    let last_arrival = reqs.iter().map(|r| r.arrive_at).max().unwrap_or(0);
    // PAGEDRS_TRACE=1 prints each step (run one case with it to see a failure unfold).
    let trace = std::env::var("PAGEDRS_TRACE").is_ok_and(|v| v == "1");
    for step in 0..4_000u64 {
        for (r, req) in reqs.iter().enumerate().filter(|(_, q)| q.arrive_at == step) {
            let id = r as u64 * 2;
            let p = prompt(r, req);
            match s.add_sequence(id, p.clone(), req.priority, r as u64, req.max_tokens, req.samples) {
                Ok(()) => {}
                Err(e) => {
                    // Only a request that could never fit is refused, and the error says why.
                    let needed = s.worst_case_blocks(p.len(), req.max_tokens, req.samples);
                    prop_assert!(needed > s.kv().num_blocks(), "request {} refused: {}", r, e);
                    prop_assert!(e.to_string().contains("needs up to"), "{}", e);
                    continue;
                }
            }
            expected.insert(id, reference(&p, req.max_tokens, false));
            if req.samples == 2 {
                forks.insert(id, id + 1);
                expected.insert(id + 1, reference(&p, req.max_tokens, true));
            }
            tokens.insert(id, p);
            remaining.insert(id, req.max_tokens);
            if let Some(after) = req.abort_after {
                aborts.entry(step + after).or_default().push(id);
            }
        }
        if !s.has_unfinished() && step > last_arrival {
            break;
        }
        if let Some(seed) = speculate {
            for (&seq, context) in tokens.iter().filter(|(seq, _)| !held.contains_key(seq)) {
                let roll = mix(seed ^ step.wrapping_mul(0x9E37_79B9) ^ seq.wrapping_mul(0x2545_F491));
                let (k, good) = ((roll % 5) as usize, ((roll >> 8) % 5) as usize);
                let mut ctx = context.clone();
                let mut drafts = Vec::new();
                for j in 0..k {
                    let next = next_token(&ctx, is_child(seq));
                    ctx.push(next);
                    drafts.push(if j < good { next } else { next + 3000 });
                }
                s.set_proposal(seq, &drafts).map_err(|e| TestCaseError::fail(format!("proposal for {seq}: {e}")))?;
            }
        }
        let out = s.schedule().map_err(|e| TestCaseError::fail(format!("schedule at step {step}: {e}")))?;
        // What each sequence reads this step: its tokens, and the drafts it computes.
        let mut reads = tokens.clone();
        for (i, &id) in out.seq_ids.iter().enumerate() {
            let (k, end) = (out.num_draft_tokens[i] as usize, out.query_start_loc[i + 1] as usize);
            reads.get_mut(&id).unwrap().extend(out.input_ids[end - k..end].iter().map(|&t| t as u32));
        }
        if trace {
            let moved: Vec<_> = out.transfers.iter().map(|t| (t.src, t.dst, t.pairs.clone())).collect();
            eprintln!(
                "step {step}: scheduled {:?} tokens {:?} preempted {:?} waiting/running/paused {}/{}/{} free {} transfers {moved:?}",
                out.seq_ids, out.num_scheduled_tokens, out.preempted, s.num_waiting(), s.num_running(), s.num_swapped(), s.kv().num_free_blocks()
            );
        }
        if trace {
            for id in tokens.keys() {
                eprintln!("   seq {id}: {} tokens, held {:?}, tiers {:?}, table {:?}", s.num_tokens(*id).unwrap(), held.get(id), s.page_tiers(*id).ok(), s.kv().block_table(*id).ok());
            }
        }
        let failed = num_failed < 4 && fail_roll(step, 1, 8) == Some(0);
        if failed {
            num_failed += 1;
            let point = fail_roll(step, 2, 3).expect("failures are on");
            let reset = runner.fail_step(&mut s, &out, point)?;
            if trace {
                eprintln!("   step {step} failed at point {point}; reset {reset:?}");
            }
            for id in &out.seq_ids {
                prop_assert!(reset.contains(id), "sequence {} of the failed step {} was not reset: {:?}", id, step, reset);
            }
        } else {
            runner.step(&mut s, &out, &reads, window)?;
            if failures.is_none() || fail_roll(step, 3, 2) == Some(0) {
                s.complete_step(out.step_id, true).map_err(|e| TestCaseError::fail(format!("complete_step: {e}")))?;
            }
        }
        s.check_invariants().map_err(|e| TestCaseError::fail(format!("after step {step}: {e}")))?;
        mirror.sync(&mut s, &format!("after step {step}"))?;
        for (i, &id) in out.seq_ids.iter().enumerate() {
            if failed || !out.do_sample[i] {
                continue;
            }
            let (k, end) = (out.num_draft_tokens[i] as usize, out.query_start_loc[i + 1] as usize);
            if k > 0 {
                // Accepted: the leading drafts the model agrees with, each an output (one is
                // always left for the token appended below).
                let mut accepted = 0;
                while accepted < k && remaining[&id] > 1 && out.input_ids[end - k + accepted] as u32 == next_token(&tokens[&id], is_child(id)) {
                    tokens.get_mut(&id).unwrap().push(out.input_ids[end - k + accepted] as u32);
                    *remaining.get_mut(&id).unwrap() -= 1;
                    accepted += 1;
                }
                // Now and then an interrupt cuts the verify short once the step is reported done:
                // the sequence is rewound to the tokens recorded so far (its last one computed
                // again), and the token below is not drawn; the next steps must give it.
                let interrupt = speculate.is_some_and(|seed| mix(seed ^ 0x5EED ^ step.wrapping_mul(0x9E37_79B9) ^ id) % 4 == 0);
                if interrupt && s.open_steps().is_empty() && !forks.contains_key(&id) {
                    let changed = s.rewind(id, tokens[&id].len()).map_err(|e| TestCaseError::fail(format!("rewind of {id}: {e}")))?;
                    prop_assert!(changed, "sequence {} held drafts: the rewind must change it", id);
                    continue;
                }
                s.accept_drafts(id, accepted).map_err(|e| TestCaseError::fail(format!("accept_drafts of {id}: {e}")))?;
            }
            let mut samples = vec![id];
            if let Some(child) = forks.remove(&id) {
                s.fork(id, child).map_err(|e| TestCaseError::fail(e.to_string()))?;
                tokens.insert(child, tokens[&id].clone());
                remaining.insert(child, remaining[&id]);
                samples.push(child);
            }
            for seq in samples {
                let next = next_token(&tokens[&seq], is_child(seq));
                tokens.get_mut(&seq).unwrap().push(next);
                let left = remaining.get_mut(&seq).unwrap();
                *left -= 1;
                if *left == 0 {
                    s.finish(seq).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    ended.insert(seq, tokens.remove(&seq).unwrap());
                } else if roll(4) == 0 {
                    held.insert(seq, (step + 1 + roll(3), next));
                } else {
                    s.append_token(seq, next).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
        }
        // Tokens handed over late.
        let due: Vec<u64> = held.iter().filter(|(_, (at, _))| *at <= step).map(|(&seq, _)| seq).collect();
        for seq in due {
            let (_, token) = held.remove(&seq).expect("listed above");
            s.append_token(seq, token).map_err(|e| TestCaseError::fail(format!("late token of {seq}: {e}")))?;
        }
        // An extra fork of a live sequence (not one idling for its token), in any state.
        if next_child < EXTRA_CHILDREN + 4 && roll(8) == 0 {
            let live: Vec<u64> = tokens.keys().copied().filter(|id| !held.contains_key(id)).collect();
            if !live.is_empty() {
                let parent = live[roll(live.len() as u64) as usize];
                s.fork(parent, next_child).map_err(|e| TestCaseError::fail(format!("fork of {parent}: {e}")))?;
                tokens.insert(next_child, tokens[&parent].clone());
                remaining.insert(next_child, remaining[&parent]);
                next_child += 1;
            }
        }
        // Aborts: the request and its child, in whatever state they are.
        for id in aborts.remove(&step).unwrap_or_default() {
            for seq in [id, id + 1] {
                held.remove(&seq);
                if let Some(t) = tokens.remove(&seq) {
                    s.finish(seq).map_err(|e| TestCaseError::fail(format!("abort of {seq}: {e}")))?;
                    ended.insert(seq, t);
                }
            }
            forks.remove(&id);
        }
        s.check_invariants().map_err(|e| TestCaseError::fail(format!("after the appends of step {step}: {e}")))?;
    }
    prop_assert!(!s.has_unfinished(), "the workload did not finish in 4,000 steps");
    for (id, got) in ended.iter().filter(|(id, _)| **id < EXTRA_CHILDREN) {
        let want = &expected[id];
        prop_assert!(want.starts_with(got), "sequence {} generated {:?}, the model gives {:?}", id, got, want);
    }
    let aborted: Vec<u64> = reqs.iter().enumerate().filter(|(_, q)| q.abort_after.is_some()).map(|(r, _)| r as u64 * 2).collect();
    for (id, want) in &expected {
        if !aborted.contains(&(id & !1)) {
            prop_assert_eq!(ended.get(id), Some(want), "sequence {} did not finish with the model's tokens", id);
        }
    }
    // The last step is reported; a clean shutdown's flush to disk; then every page is
    // free on every tier.
    for step in s.open_steps() {
        s.complete_step(step, true).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    for t in s.flush_to_disk() {
        runner.copy(&t.pairs, t.src, t.dst);
        s.complete_transfers(&[t.id]).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    prop_assert_eq!(s.kv().num_free_blocks(), cfg.gpu_blocks, "device pages leaked");
    prop_assert_eq!(s.kv().num_free_host_blocks(), runner.cpu.len() / bs, "host pages leaked");
    prop_assert_eq!(s.kv().num_pinned_host_blocks(), 0);
    s.check_invariants().map_err(TestCaseError::fail)?;
    mirror.sync(&mut s, "after the flush to disk")?;
    Ok(s.stats().num_deferred_forks)
}

/// `make test` replays a fixed seed (16,384 cases, about 2 s), so a CI run passes or fails
/// on the code alone; `make fuzz` sets `PAGEDRS_FUZZ_RANDOM=1` and `PROPTEST_CASES` to
/// search afresh. A failure found there is saved to `scheduler_proptest.proptest-regressions`, which every
/// run replays first; commit it with the fix.
fn fuzz_config() -> ProptestConfig {
    let random = std::env::var("PAGEDRS_FUZZ_RANDOM").is_ok_and(|v| v == "1");
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(16384);
    let rng_seed = if random { RngSeed::Random } else { RngSeed::Fixed(0x7363_6865_6475_6c65) };
    ProptestConfig { cases, rng_seed, ..ProptestConfig::default() }
}

/// Found by this test: a windowed prompt paused mid-prefill (page-granular swap) was
/// judged never to fit again because the watermark was added to what it needs, though
/// nothing else ran; every later step was empty.
#[test]
fn a_paused_windowed_prompt_comes_back_when_only_the_watermark_stood_in_its_way() {
    let cfg = Setup { layout: KvLayout::Paged, gpu_blocks: 22, block_size: 1, cpu_blocks: 10, disk_blocks: 0, prefix_caching: false, host_cache_evicted: false, watermark: 0.1, mode: PreemptionMode::Swap, window: Some(5), budget: 10, max_num_seqs: 2, policy: AdmissionPolicy::PromptOnly, prefill_first: true, whole_sequence_swap: false, aging_steps: 0 };
    let reqs = vec![
        Req { shared: 8, own: 12, max_tokens: 1, samples: 1, priority: 1, arrive_at: 0, abort_after: None },
        Req { shared: 0, own: 3, max_tokens: 2, samples: 1, priority: 0, arrive_at: 1, abort_after: None },
    ];
    run(cfg, reqs, None).unwrap();
}

/// Found by this test: a windowed prompt paused before its next chunk, whose full-budget
/// chunk would take its pages before its window lets the oldest go, was judged never to
/// fit; it now comes back with a 1-token chunk.
#[test]
fn a_paused_windowed_prompt_comes_back_with_a_smaller_chunk() {
    let cfg = Setup { layout: KvLayout::Paged, gpu_blocks: 3, block_size: 5, cpu_blocks: 1, disk_blocks: 0, prefix_caching: false, host_cache_evicted: false, watermark: 0.0, mode: PreemptionMode::Swap, window: Some(2), budget: 8, max_num_seqs: 2, policy: AdmissionPolicy::PromptOnly, prefill_first: false, whole_sequence_swap: false, aging_steps: 0 };
    let reqs = vec![
        Req { shared: 1, own: 2, max_tokens: 2, samples: 1, priority: 0, arrive_at: 10, abort_after: None },
        Req { shared: 2, own: 9, max_tokens: 1, samples: 1, priority: 0, arrive_at: 10, abort_after: None },
    ];
    run(cfg, reqs, None).unwrap();
}

/// Found by this test: on the contiguous layout an `n = 2` fork copies the parent's region
/// into a new one, which a full pool cannot give; the fork failed. The child now waits and
/// is prefilled when admitted.
#[test]
fn a_contiguous_fork_into_a_full_pool_waits_for_its_region() {
    let cfg = Setup { layout: KvLayout::Contiguous(ReservePolicy::Request), gpu_blocks: 65, block_size: 1, cpu_blocks: 0, disk_blocks: 0, prefix_caching: false, host_cache_evicted: false, watermark: 0.0, mode: PreemptionMode::Swap, window: None, budget: 1, max_num_seqs: 2, policy: AdmissionPolicy::PromptOnly, prefill_first: true, whole_sequence_swap: false, aging_steps: 0 };
    let reqs = vec![
        Req { shared: 3, own: 7, max_tokens: 10, samples: 2, priority: 0, arrive_at: 0, abort_after: None },
        Req { shared: 6, own: 11, max_tokens: 9, samples: 1, priority: 0, arrive_at: 0, abort_after: None },
    ];
    let deferred = run(cfg, reqs, None).unwrap();
    assert_eq!(deferred, 1, "the fork found the pool full");
}

/// Found by this test: a sequence forked while paused, both sharing a partly filled last
/// page that fills the pool; each needs a copy on write to go on, so the blocked one was
/// judged never to fit. The sharer is now recomputed and the other goes on in its page.
#[test]
fn paused_forks_sharing_a_full_pool_make_way_for_each_other() {
    let cfg = Setup { layout: KvLayout::Paged, gpu_blocks: 4, block_size: 4, cpu_blocks: 1, disk_blocks: 0, prefix_caching: false, host_cache_evicted: false, watermark: 0.0, mode: PreemptionMode::Swap, window: None, budget: 13, max_num_seqs: 2, policy: AdmissionPolicy::PromptOnly, prefill_first: true, whole_sequence_swap: false, aging_steps: 0 };
    let r = |shared, own, max_tokens, arrive_at| Req { shared, own, max_tokens, samples: 1, priority: 0, arrive_at, abort_after: None };
    let reqs = vec![r(0, 1, 4, 2), r(0, 1, 2, 2), r(0, 1, 2, 1), r(5, 1, 7, 2), r(3, 3, 9, 2)];
    run(cfg, reqs, Some(17512109942349086490)).unwrap();
}

proptest! {
    #![proptest_config(fuzz_config())]

    #[test]
    fn random_workloads_read_back_every_token_and_free_every_page(
        cfg in setup(),
        reqs in proptest::collection::vec(req(), 1..16),
        chaos in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        failures in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
    ) {
        run_failing(cfg, reqs, chaos, failures)?;
    }

    #[test]
    fn random_workloads_with_drafts_read_back_every_token_and_free_every_page(
        cfg in setup(),
        reqs in proptest::collection::vec(req(), 1..16),
        chaos in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        failures in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        speculate in any::<u64>(),
    ) {
        run_speculating(cfg, reqs, chaos, failures, Some(speculate))?;
    }
}
/// Found by this test: a copy on write reads its source page after the step's swap-ins
/// have run. The source's other user, a paused fork, gave that page to the host in the
/// same step, and a swap-in took the freed block: the copy read another sequence's K/V.
/// Copy-on-write sources are now pinned until the step is planned.
#[test]
fn a_copy_on_write_source_is_not_refilled_by_a_swap_in_of_the_same_step() {
    let cfg = Setup { layout: KvLayout::Paged, gpu_blocks: 7, block_size: 5, cpu_blocks: 4, disk_blocks: 0, prefix_caching: false, host_cache_evicted: false, watermark: 0.0, mode: PreemptionMode::Swap, window: None, budget: 15, max_num_seqs: 3, policy: AdmissionPolicy::PromptOnly, prefill_first: true, whole_sequence_swap: false, aging_steps: 1, };
    let reqs = vec![ Req { shared: 11, own: 10, max_tokens: 1, samples: 1, priority: 2, arrive_at: 8, abort_after: None, }, Req { shared: 10, own: 3, max_tokens: 7, samples: 2, priority: 0, arrive_at: 1, abort_after: None, }, Req { shared: 7, own: 4, max_tokens: 7, samples: 2, priority: 0, arrive_at: 5, abort_after: None, }, Req { shared: 0, own: 1, max_tokens: 2, samples: 1, priority: 0, arrive_at: 7, abort_after: None, }, Req { shared: 11, own: 5, max_tokens: 2, samples: 1, priority: 0, arrive_at: 7, abort_after: None, }, Req { shared: 1, own: 10, max_tokens: 6, samples: 1, priority: 0, arrive_at: 5, abort_after: None, }, Req { shared: 8, own: 1, max_tokens: 5, samples: 1, priority: 0, arrive_at: 0, abort_after: None, }, Req { shared: 5, own: 2, max_tokens: 10, samples: 1, priority: 0, arrive_at: 1, abort_after: None, }, Req { shared: 8, own: 3, max_tokens: 2, samples: 1, priority: 0, arrive_at: 0, abort_after: None, }, Req { shared: 0, own: 1, max_tokens: 1, samples: 1, priority: 0, arrive_at: 10, abort_after: None, }, ];
    run(cfg, reqs, Some(3501864999417049494)).unwrap();
}

/// Found by this test with failed steps: a fork taken mid-prefill recomputes positions into
/// pages it shares with its parent; a step that failed half way through such a write left
/// garbage in a page that was already a prefix hit, and a later admission read it. Every
/// page a failed step writes now leaves the cache, and every holder starts again.
#[test]
fn a_failed_step_that_half_wrote_a_shared_page_is_never_served() {
    let cfg = Setup { layout: KvLayout::Paged, gpu_blocks: 12, block_size: 1, cpu_blocks: 0, disk_blocks: 0, prefix_caching: true, host_cache_evicted: false, watermark: 0.0, mode: PreemptionMode::Swap, window: None, budget: 1, max_num_seqs: 1, policy: AdmissionPolicy::PromptOnly, prefill_first: false, whole_sequence_swap: false, aging_steps: 0 };
    let reqs = vec![Req { shared: 3, own: 2, max_tokens: 2, samples: 1, priority: 0, arrive_at: 0, abort_after: None }];
    run_failing(cfg, reqs, Some(7765531575336454908), Some(6226915633237141005)).unwrap();
}

/// Found by `make fuzz` (docs/open_fuzz_case.md): sequence 4 read wrong K/V at positions
/// 0..3 (a sliding window, host and disk tiers, whole-sequence swap).
#[test]
fn the_open_fuzz_case_of_issue_23_reads_back_every_token() {
    let cfg = Setup { layout: KvLayout::Paged, gpu_blocks: 8, block_size: 4, cpu_blocks: 7, disk_blocks: 5, prefix_caching: true, host_cache_evicted: false, watermark: 0.0, mode: PreemptionMode::Swap, window: Some(7), budget: 12, max_num_seqs: 3, policy: AdmissionPolicy::ExpectedGrowth, prefill_first: false, whole_sequence_swap: true, aging_steps: 0 };
    let r = |shared, own, max_tokens, priority, abort_after| Req { shared, own, max_tokens, samples: 1, priority, arrive_at: 4, abort_after };
    let reqs = vec![
        r(0, 1, 1, 1, Some(8)), r(4, 9, 2, 1, None), r(9, 3, 1, 2, None), r(0, 1, 1, 1, None), r(0, 1, 1, 1, None),
        r(3, 2, 20, 0, None), r(0, 1, 1, 1, None), r(2, 4, 10, 1, None), r(0, 5, 20, 0, None), r(5, 4, 11, 0, None),
    ];
    run(cfg, reqs, Some(4810555787701495631)).unwrap();
}
