//! The scheduler under page-granular preemption, driven by a simulated runner: device
//! and host memory hold "K/V" (the token itself at each slot), every step runs its
//! transfers, copy-on-write copies and writes exactly as the Python runner does, and
//! then every scheduled sequence's whole context is read back through its block table.
//! A page copied to the wrong place, swapped in after the forward that reads it, or
//! released while a paused sequence still needs it shows up as a wrong token.

use pagedrs::block_manager::{BlockManagerConfig, Tier};
use pagedrs::scheduler::{
    AdmissionConfig, AdmissionPolicy, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput,
};
use std::collections::BTreeMap;

const BS: usize = 4;

struct Runner {
    gpu: Vec<Option<u32>>,
    cpu: Vec<Option<u32>>,
}

impl Runner {
    fn mem(&mut self, tier: Tier) -> &mut Vec<Option<u32>> {
        match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
            Tier::Disk => panic!("no disk tier in this test"),
        }
    }

    fn copy(&mut self, pairs: &[(u32, u32)], src: Tier, dst: Tier) {
        for &(s, d) in pairs {
            for off in 0..BS {
                let v = self.mem(src)[s as usize * BS + off];
                self.mem(dst)[d as usize * BS + off] = v;
            }
        }
    }

    /// Transfers, then copies, then the forward's K/V writes, then every read.
    fn step(&mut self, s: &mut Scheduler, out: &SchedulerOutput, tokens: &BTreeMap<u64, Vec<u32>>) {
        for t in &out.transfers {
            self.copy(&t.pairs, t.src, t.dst);
        }
        let ids: Vec<u64> = out.transfers.iter().map(|t| t.id).collect();
        s.complete_transfers(&ids).unwrap();
        self.copy(&out.copies, Tier::Gpu, Tier::Gpu);
        for (&slot, &token) in out.slot_mapping.iter().zip(&out.input_ids) {
            self.gpu[slot as usize] = Some(token as u32);
        }
        for (i, id) in out.seq_ids.iter().enumerate() {
            let row = &out.block_tables[i * out.max_blocks..(i + 1) * out.max_blocks];
            let len = out.seq_lens[i] as usize;
            let read: Vec<Option<u32>> = (0..len).map(|p| self.gpu[row[p / BS] as usize * BS + p % BS]).collect();
            let expected: Vec<Option<u32>> = tokens[id][..len].iter().map(|&t| Some(t)).collect();
            assert_eq!(read, expected, "sequence {id} reads wrong K/V");
        }
    }
}

/// Deterministic pseudo-random numbers (splitmix64), so the workload is the same per seed.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Outcome {
    outputs: BTreeMap<u64, Vec<u32>>,
    pages_out: u64,
    pages_in: u64,
    swap_preemptions: u64,
    paused_with_both_tiers: bool,
}

/// Runs a seeded workload (some requests fork into 2 samples that share pages) to the
/// end on a pool far too small for it; checks invariants after every step.
fn run(seed: u64, whole_sequence_swap: bool, prefix_caching: bool, host_blocks: usize) -> Outcome {
    let config = SchedulerConfig {
        max_num_seqs: 8,
        // Small budgets chunk prefills (and a watermark below makes paused sequences give extra pages).
        max_num_batched_tokens: if seed % 3 == 0 { 8 } else { 32 },
        max_model_len: 256,
        preemption_mode: PreemptionMode::Swap,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        sliding_window: None,
        prefill_first: false,
        // the optimistic rule: this harness is about what preemption does, so it must happen
        admission: AdmissionConfig { policy: AdmissionPolicy::PromptOnly, ..AdmissionConfig::default() },
    };
    let gpu_blocks = 14;
    let bm = BlockManagerConfig {
        num_cpu_blocks: host_blocks,
        enable_prefix_caching: prefix_caching,
        ..BlockManagerConfig::new(gpu_blocks, BS)
    };
    let mut s = Scheduler::paged_with_watermark(config, bm, (seed % 2) as usize).unwrap();
    s.set_whole_sequence_swap(whole_sequence_swap);
    let mut runner = Runner { gpu: vec![None; gpu_blocks * BS], cpu: vec![None; host_blocks * BS] };
    let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut remaining: BTreeMap<u64, usize> = BTreeMap::new();
    let mut forks: BTreeMap<u64, u64> = BTreeMap::new(); // parent → child id, forked at its first sample
    let shared: Vec<u32> = (0..8).collect();
    for r in 0..8u64 {
        let h = mix(seed ^ r);
        let mut prompt = if h % 2 == 0 { shared.clone() } else { Vec::new() };
        prompt.extend((0..3 + h % 9).map(|i| (100 + r * 50 + i) as u32));
        let max_tokens = 6 + (h >> 8) as usize % 10;
        let id = r * 2;
        let samples = if (h >> 16) % 3 == 0 { 2 } else { 1 };
        // Mixed priorities: better-ranked paused sequences take pages from worse ones.
        let priority = ((h >> 24) % 3) as i64;
        s.add_sequence(id, prompt.clone(), priority, r, max_tokens, samples).unwrap();
        if samples == 2 {
            forks.insert(id, id + 1);
        }
        tokens.insert(id, prompt);
        remaining.insert(id, max_tokens);
    }
    let mut outputs = BTreeMap::new();
    let mut paused_with_both_tiers = false;
    for _ in 0..2_000 {
        if !s.has_unfinished() {
            break;
        }
        let out = s.schedule().unwrap();
        runner.step(&mut s, &out, &tokens);
        s.complete_step(out.step_id, true).unwrap();
        s.check_invariants().unwrap();
        for &id in tokens.keys() {
            if let Ok((device, host)) = s.page_tiers(id) {
                paused_with_both_tiers |= device > 0 && host > 0;
            }
        }
        for (i, &id) in out.seq_ids.iter().enumerate() {
            if !out.do_sample[i] {
                continue;
            }
            // A 2-sample request forks at its first sample, before the step's tokens are
            // appended; both samples then get a token from the same row.
            let mut samples = vec![id];
            if let Some(child) = forks.remove(&id) {
                s.fork(id, child).unwrap();
                tokens.insert(child, tokens[&id].clone());
                remaining.insert(child, remaining[&id]);
                samples.push(child);
            }
            for seq in samples {
                // The "model": the next token is a function of the context (children offset,
                // so that the samples diverge and their last pages are copied on write).
                let ctx = &tokens[&seq];
                let next = (mix(ctx.iter().fold(seed, |a, &t| a.wrapping_mul(31).wrapping_add(t as u64))) % 1000) as u32
                    + if seq % 2 == 1 { 1000 } else { 0 };
                tokens.get_mut(&seq).unwrap().push(next);
                let left = remaining.get_mut(&seq).unwrap();
                *left -= 1;
                if *left == 0 {
                    s.finish(seq).unwrap();
                    outputs.insert(seq, tokens[&seq].clone());
                } else {
                    s.append_token(seq, next).unwrap();
                }
            }
        }
    }
    assert!(!s.has_unfinished(), "the workload did not finish");
    assert_eq!(s.kv().num_free_blocks(), gpu_blocks);
    assert_eq!(s.kv().num_free_host_blocks(), host_blocks);
    let st = s.stats();
    Outcome {
        outputs,
        pages_out: st.pages_swapped_out,
        pages_in: st.pages_swapped_in,
        swap_preemptions: st.num_swap_preemptions,
        paused_with_both_tiers,
    }
}

#[test]
fn paused_sequences_read_back_every_token_and_move_fewer_pages_than_whole_sequence_swap() {
    let (mut page_total, mut whole_total) = (0, 0);
    let (mut mixed, mut preemptions) = (false, 0);
    for seed in 0..24 {
        for prefix_caching in [false, true] {
            let page = run(seed, false, prefix_caching, 64);
            let whole = run(seed, true, prefix_caching, 64);
            // The simulated model is deterministic: how a sequence was interrupted must not matter.
            assert_eq!(page.outputs, whole.outputs, "seed {seed}");
            preemptions += page.swap_preemptions.min(whole.swap_preemptions);
            page_total += page.pages_out + page.pages_in;
            whole_total += whole.pages_out + whole.pages_in;
            mixed |= page.paused_with_both_tiers;
            assert!(!whole.paused_with_both_tiers, "whole-sequence swap never splits a table");
        }
    }
    assert!(preemptions >= 24, "the pool must be too small: {preemptions} swap preemptions");
    assert!(mixed, "some paused sequence must hold device and host pages at once");
    assert!(page_total < whole_total, "page-granular moved {page_total} pages, whole-sequence {whole_total}");
}

#[test]
fn a_small_host_tier_falls_back_to_recompute_and_still_reads_back_every_token() {
    for seed in 0..12 {
        let small = run(seed, false, true, 2);
        let roomy = run(seed, false, true, 64);
        assert_eq!(small.outputs, roomy.outputs, "seed {seed}");
    }
}
