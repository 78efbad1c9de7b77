//! Scheduler scenarios with exact expectations: batch order, chunking, same-step
//! prefix sharing, preemption victims and modes, aging, and the contiguous baseline.

use pagedrs::block_manager::BlockManagerConfig;

/// Page-granular preemption under a simulated runner (its own file: a bigger harness).
#[path = "scheduler_page_preemption.rs"]
mod page_preemption;
use pagedrs::scheduler::{AdmissionConfig, AdmissionPolicy, PreemptionCost, PreemptionMode, ReservePolicy, Scheduler, SchedulerConfig};

fn config(budget: usize, mode: PreemptionMode) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        preemption_mode: mode,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        admission: AdmissionConfig::default(),
        sliding_window: None,
        prefill_first: false,
    }
}

fn paged(blocks: usize, cpu: usize, budget: usize, mode: PreemptionMode) -> Scheduler {
    let bm = BlockManagerConfig { num_cpu_blocks: cpu, ..BlockManagerConfig::new(blocks, 4) };
    Scheduler::paged(config(budget, mode), bm).unwrap()
}

/// Pairs moved out of `src` ("gpu" or "cpu") by the step's transfers.
fn swapped(out: &pagedrs::scheduler::SchedulerOutput, src: &str) -> usize {
    out.transfers.iter().filter(|t| t.src.to_string() == src).map(|t| t.pairs.len()).sum()
}

fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Two 8-token prompts (seq 1 first, seq 2 later) fill a 4-block pool of 4-token blocks
/// exactly; each then samples a token, so the next step needs a fifth block.
fn fill_four_blocks_then_grow(s: &mut Scheduler) {
    s.add_sequence(1, tokens(0, 8), 0, 0, 0, 1).unwrap();
    s.add_sequence(2, tokens(20, 8), 0, 1, 0, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 8).unwrap();
    s.append_token(2, 28).unwrap();
}

/// Appends `tokens` to `seq` one per step (the schedules in between run the decodes);
/// the last one is appended but not scheduled.
fn decode(s: &mut Scheduler, seq: u64, tokens: std::ops::Range<u32>) {
    for (i, t) in tokens.enumerate() {
        if i > 0 {
            s.schedule().unwrap();
        }
        s.append_token(seq, t).unwrap();
    }
}

#[test]
fn chunked_prefill_splits_a_prompt_under_the_budget_and_decodes_go_first() {
    let mut s = paged(32, 0, 6, PreemptionMode::Recompute);
    s.add_sequence(1, tokens(0, 3), 0, 0, 0, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![1]);
    assert_eq!(out.do_sample, vec![true]);
    s.append_token(1, 100).unwrap();
    s.add_sequence(2, tokens(50, 10), 0, 1, 0, 1).unwrap();
    // Step 2: seq 1 decodes one token, then 5 of seq 2's 10 prompt tokens fill the budget.
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![1, 2]);
    assert_eq!(out.num_scheduled_tokens, vec![1, 5]);
    assert_eq!(out.do_sample, vec![true, false]);
    assert_eq!(out.input_ids, vec![100, 50, 51, 52, 53, 54]);
    assert_eq!(out.positions, vec![3, 0, 1, 2, 3, 4]);
    assert_eq!(out.query_start_loc, vec![0, 1, 6]);
    assert_eq!(out.seq_lens, vec![4, 5]);
    s.append_token(1, 101).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![1, 5]);
    assert_eq!(out.do_sample, vec![true, true]);
    assert_eq!(out.positions[1..], [5, 6, 7, 8, 9]);
    s.check_invariants().unwrap();
}

#[test]
fn slot_mapping_follows_block_tables() {
    let mut s = paged(32, 0, 64, PreemptionMode::Recompute);
    s.add_sequence(7, tokens(0, 9), 0, 0, 0, 1).unwrap();
    let out = s.schedule().unwrap();
    let table: Vec<i64> = out.block_tables[..out.max_blocks].iter().map(|&b| b as i64).collect();
    assert_eq!(table.len(), 3);
    let expected: Vec<i64> = (0..9).map(|p| table[p / 4] * 4 + (p % 4) as i64).collect();
    assert_eq!(out.slot_mapping, expected);
}

#[test]
fn requests_in_the_same_step_share_a_prefix() {
    let mut s = paged(32, 0, 64, PreemptionMode::Recompute);
    let shared = tokens(0, 8);
    let mut a = shared.clone();
    a.extend([90, 91]);
    let mut b = shared.clone();
    b.extend([95]);
    s.add_sequence(1, a, 0, 0, 0, 1).unwrap();
    s.add_sequence(2, b, 0, 1, 0, 1).unwrap();
    let out = s.schedule().unwrap();
    // Seq 2 hits seq 1's two full blocks, committed when seq 1 was scheduled: it computes 1 token.
    assert_eq!(out.num_scheduled_tokens, vec![10, 1]);
    let row = |i: usize| out.block_tables[i * out.max_blocks..i * out.max_blocks + 2].to_vec();
    assert_eq!(row(0), row(1));
    assert_eq!(s.stats().cached_prompt_tokens, 8);
}

#[test]
fn a_missing_page_pauses_the_latest_arrival_and_moves_only_the_page_needed() {
    // 4 blocks of 4 tokens: two 8-token sequences fill the pool exactly.
    let mut s = paged(4, 8, 64, PreemptionMode::Swap);
    fill_four_blocks_then_grow(&mut s);
    let table2 = s.kv().block_table(2).unwrap().to_vec();
    let out = s.schedule().unwrap();
    // Seq 1 needs a fifth block: seq 2 (later arrival) is paused and gives exactly one
    // page, its last; its first stays on the device.
    assert_eq!(out.preempted, vec![2]);
    let moved: Vec<(u32, u32)> = out.transfers.iter().filter(|t| t.src.to_string() == "gpu").flat_map(|t| t.pairs.clone()).collect();
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].0, table2[1]);
    assert_eq!(s.kv().block_table(2).unwrap()[0], table2[0]);
    assert_eq!(s.kv().num_host_pages(2).unwrap(), 1);
    assert_eq!(out.seq_ids, vec![1]);
    assert_eq!(s.num_swapped(), 1);
    assert_eq!((s.stats().pages_swapped_out, s.stats().last_step_pages_swapped_out), (1, 1));
    s.check_invariants().unwrap();
    // Seq 1 grows into a sixth block: seq 2 gives its other page.
    decode(&mut s, 1, 9..13);
    let out = s.schedule().unwrap();
    assert_eq!(swapped(&out, "gpu"), 1);
    assert_eq!(s.kv().num_host_pages(2).unwrap(), 2);
    s.finish(1).unwrap();
    let out = s.schedule().unwrap();
    // Both host pages come back before the forward that reads them.
    assert_eq!(swapped(&out, "cpu"), 2);
    assert_eq!(out.seq_ids, vec![2]);
    assert_eq!(out.input_ids, vec![28]);
    assert_eq!((s.stats().pages_swapped_out, s.stats().pages_swapped_in, s.stats().last_step_pages_swapped_in), (2, 2, 2));
    assert_eq!(s.kv().num_host_pages(2).unwrap(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn a_paused_sequence_with_no_host_pages_resumes_without_copies() {
    let mut s = paged(4, 8, 64, PreemptionMode::Swap);
    fill_four_blocks_then_grow(&mut s);
    s.schedule().unwrap(); // seq 2 paused, one page moved
    s.append_token(1, 9).unwrap();
    // Seq 1 ends: seq 2 needs its one host page back plus room for its new token.
    s.finish(1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(swapped(&out, "gpu"), 0);
    assert_eq!(swapped(&out, "cpu"), 1);
    assert_eq!(out.seq_ids, vec![2]);
    s.check_invariants().unwrap();
}

#[test]
fn whole_sequence_swap_moves_every_page_and_swap_brings_it_back() {
    // 4 blocks of 4 tokens: two 8-token sequences fill the pool exactly. No prefix
    // caching: a swapped page still cached on the device would come back without a copy.
    let bm = BlockManagerConfig { num_cpu_blocks: 8, enable_prefix_caching: false, ..BlockManagerConfig::new(4, 4) };
    let mut s = Scheduler::paged(config(64, PreemptionMode::Swap), bm).unwrap();
    s.set_whole_sequence_swap(true);
    fill_four_blocks_then_grow(&mut s);
    let out = s.schedule().unwrap();
    // Seq 1 needs a fifth block: seq 2 (later arrival) is swapped out, its 2 blocks move.
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(swapped(&out, "gpu"), 2);
    assert_eq!(out.seq_ids, vec![1]);
    assert_eq!(s.num_swapped(), 1);
    s.finish(1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(swapped(&out, "cpu"), 2);
    assert_eq!(out.seq_ids, vec![2]);
    assert_eq!(out.input_ids, vec![28]);
    assert_eq!(out.positions, vec![8]);
    s.finish(2).unwrap();
    assert_eq!(s.kv().num_free_blocks(), 4);
    // The swap-in's host sources stay pinned until the runner reports the copy done.
    assert_eq!(s.kv().num_free_host_blocks(), 6);
    s.check_invariants().unwrap();
    let ids: Vec<u64> = out.transfers.iter().map(|t| t.id).collect();
    assert!(s.complete_transfers(&[ids[0], ids[0]]).is_err(), "an id twice changes nothing");
    assert_eq!(s.kv().num_free_host_blocks(), 6);
    s.complete_transfers(&ids).unwrap();
    assert_eq!(s.kv().num_free_host_blocks(), 8);
    assert!(s.complete_transfers(&ids).is_err(), "completed twice");
    s.check_invariants().unwrap();
}

#[test]
fn a_swapped_page_still_cached_on_the_device_comes_back_without_a_copy() {
    for whole in [true, false] {
        let mut s = paged(4, 8, 64, PreemptionMode::Swap);
        s.set_whole_sequence_swap(whole);
        fill_four_blocks_then_grow(&mut s);
        let table2 = s.kv().block_table(2).unwrap().to_vec();
        s.schedule().unwrap();
        // Whole: both committed pages of seq 2 went out and stayed cached on the device;
        // seq 1's fifth block evicted the least recently released one (its first).
        // Page-granular: only its last page went out, and seq 1 took the free block it left.
        s.finish(1).unwrap();
        let out = s.schedule().unwrap();
        assert_eq!(out.seq_ids, vec![2]);
        let table = s.kv().block_table(2).unwrap().to_vec();
        if whole {
            assert_eq!(swapped(&out, "cpu"), 1, "the page still cached comes back by reference");
            assert_eq!(table[1], table2[1]);
        } else {
            assert_eq!(table[0], table2[0], "the page that never left");
            assert_eq!(swapped(&out, "cpu"), 1);
        }
        s.check_invariants().unwrap();
    }
}

#[test]
fn append_tokens_is_all_or_nothing() {
    let mut s = paged(8, 0, 64, PreemptionMode::Recompute);
    s.add_sequence(1, tokens(0, 3), 0, 0, 4, 1).unwrap();
    s.add_sequence(2, tokens(10, 3), 0, 1, 4, 1).unwrap();
    s.schedule().unwrap();
    // A failure in the middle of the list (unknown id 99, then a repeated id) changes no sequence.
    assert!(s.append_tokens(&[(1, 7), (99, 7), (2, 7)]).is_err());
    assert!(s.append_tokens(&[(1, 7), (2, 7), (1, 8)]).is_err());
    assert_eq!((s.num_tokens(1).unwrap(), s.num_tokens(2).unwrap()), (3, 3));
    s.append_tokens(&[(1, 7), (2, 8)]).unwrap();
    assert_eq!((s.num_tokens(1).unwrap(), s.num_tokens(2).unwrap()), (4, 4));
}

#[test]
fn a_request_is_refused_unless_all_its_samples_fit_at_worst() {
    // 8 blocks of 4 tokens. A 6-token prompt growing by 10 (16 tokens) with n samples needs
    // its one full prompt block once plus 3 private blocks per sample: n = 2 fits (7), n = 3 (10) not.
    let mut s = paged(8, 0, 64, PreemptionMode::Recompute);
    assert_eq!(s.worst_case_blocks(6, 10, 2), 7);
    s.add_sequence(1, tokens(0, 6), 0, 0, 10, 2).unwrap();
    let err = s.add_sequence(2, tokens(0, 6), 0, 1, 10, 3).unwrap_err().to_string();
    assert!(err.contains("10 blocks") && err.contains("n = 3"), "{err}");
    assert!(!s.contains(2));
    // Overflowing arguments saturate instead of wrapping around into a small number.
    assert!(s.add_sequence(3, tokens(0, 6), 0, 2, usize::MAX, usize::MAX).is_err());
}

#[test]
fn recompute_drops_pages_and_prefills_everything_again() {
    let mut s = paged(4, 0, 64, PreemptionMode::Recompute);
    fill_four_blocks_then_grow(&mut s);
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![2]);
    assert!(swapped(&out, "gpu") == 0);
    assert_eq!(s.num_waiting(), 1);
    s.finish(1).unwrap();
    let out = s.schedule().unwrap();
    // Prompt and the sampled token come back as one prefill (the prefix cache may skip full blocks).
    let n = out.num_scheduled_tokens[0] as usize;
    assert_eq!(out.input_ids[..], (20..29).map(|t| t as i64).collect::<Vec<_>>()[9 - n..]);
    assert_eq!(out.do_sample, vec![true]);
    s.check_invariants().unwrap();
}

#[test]
fn auto_mode_weighs_swap_against_recompute() {
    let run = |swap_cost: f64| {
        let mut cfg = config(64, PreemptionMode::Auto);
        cfg.cost = PreemptionCost { swap_cost_per_block: swap_cost, recompute_cost_per_token: 1.0 };
        let bm = BlockManagerConfig { num_cpu_blocks: 8, ..BlockManagerConfig::new(4, 4) };
        let mut s = Scheduler::paged(cfg, bm).unwrap();
        fill_four_blocks_then_grow(&mut s);
        let out = s.schedule().unwrap();
        (swapped(&out, "gpu"), s.stats().num_swap_preemptions, s.stats().num_recompute_preemptions)
    };
    // Victim: 9 tokens, 2 blocks. Swap = 2 x 2 x cost; recompute = 9. A swap pauses the
    // victim and moves the one page the step needs.
    assert_eq!(run(1.0), (1, 1, 0));
    assert_eq!(run(5.0), (0, 0, 1));
}

#[test]
fn a_full_host_tier_falls_back_to_recompute() {
    // Whole-sequence swap needs 2 host blocks for the victim; there is 1.
    let mut s = paged(4, 1, 64, PreemptionMode::Swap);
    s.set_whole_sequence_swap(true);
    fill_four_blocks_then_grow(&mut s);
    s.schedule().unwrap();
    assert_eq!(s.stats().num_recompute_preemptions, 1);
    assert_eq!(s.num_waiting(), 1);
    // Page-granular: one host block is enough for the one page a decode needs...
    let mut s = paged(4, 1, 64, PreemptionMode::Swap);
    fill_four_blocks_then_grow(&mut s);
    s.schedule().unwrap();
    assert_eq!((s.stats().num_swap_preemptions, s.stats().num_recompute_preemptions), (1, 0));
    // ...and when seq 1 grows into its fourth block the host is full: the paused
    // victim is recomputed, and no page is copied for it.
    decode(&mut s, 1, 8..12);
    let out = s.schedule().unwrap();
    assert_eq!(swapped(&out, "gpu"), 0);
    assert_eq!(out.preempted, vec![2]);
    assert_eq!((s.stats().num_swap_preemptions, s.stats().num_recompute_preemptions), (1, 1));
    assert_eq!(s.num_waiting(), 1);
    s.check_invariants().unwrap();
}

#[test]
fn priority_then_arrival_and_aging_prevents_starvation() {
    let mut cfg = config(64, PreemptionMode::Recompute);
    cfg.max_num_seqs = 1;
    cfg.aging_steps = 2;
    let mut s = Scheduler::paged(cfg, BlockManagerConfig::new(64, 4)).unwrap();
    s.add_sequence(1, tokens(0, 2), 3, 0, 0, 1).unwrap(); // low priority, first to arrive
    s.add_sequence(2, tokens(0, 2), 0, 1, 0, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![2]);
    // Seq 2 keeps running; newcomers of priority 1 keep arriving, yet seq 1 ages past them.
    let mut admitted_1_at = None;
    for step in 0..20 {
        if s.contains(2) {
            s.finish(2).unwrap();
        }
        s.add_sequence(10 + step, tokens(0, 2), 1, 100 + step, 0, 1).unwrap();
        let out = s.schedule().unwrap();
        if out.seq_ids == vec![1] {
            admitted_1_at = Some(step);
            break;
        }
        s.finish(out.seq_ids[0]).unwrap();
    }
    // Waiting since step 0, one level per 2 steps: at the 4th schedule (loop step 3) it has
    // gained 2 levels, ties the newcomers' priority 1 and wins on earlier arrival.
    assert_eq!(admitted_1_at, Some(3));
}

#[test]
fn contiguous_layout_reserves_up_front_and_never_preempts() {
    let mut s = Scheduler::contiguous(config(64, PreemptionMode::Recompute), 8, 4, ReservePolicy::Request).unwrap();
    s.add_sequence(1, tokens(0, 3), 0, 0, 13, 1).unwrap();
    s.add_sequence(2, tokens(0, 3), 0, 1, 13, 1).unwrap();
    s.add_sequence(3, tokens(0, 3), 0, 2, 13, 1).unwrap();
    let out = s.schedule().unwrap();
    // 16 reserved tokens = 4 blocks each: only two fit in 8 blocks, and their tables are runs.
    assert_eq!(out.seq_ids, vec![1, 2]);
    assert_eq!(out.block_tables, vec![0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(s.num_waiting(), 1);
    assert!(s.kv_usage().reserved_slots == 32 && s.kv_usage().live_slots == 6);
    assert!(s.add_sequence(4, tokens(0, 3), 0, 3, 37, 1).is_err()); // can never fit
}

#[test]
fn bad_sequences_are_rejected_without_change() {
    let mut s = paged(4, 0, 64, PreemptionMode::Recompute);
    assert!(s.add_sequence(1, vec![], 0, 0, 0, 1).is_err());
    assert!(s.add_sequence(1, tokens(0, 17), 0, 0, 0, 1).is_err()); // 5 blocks > 4
    s.add_sequence(1, tokens(0, 3), 0, 0, 0, 1).unwrap();
    assert!(s.add_sequence(1, tokens(0, 3), 0, 0, 0, 1).is_err());
    assert!(s.append_token(99, 1).is_err());
    assert!(s.fork(1, 1).is_err()); // the child id exists
    assert!(s.fork(99, 2).is_err()); // unknown parent
    assert_eq!(s.num_waiting(), 1);
    s.check_invariants().unwrap();
}

#[test]
fn a_waiting_parent_forks_into_a_waiting_child_that_prefills_its_own_tokens() {
    // Seq 2 is preempted by recompute (no pages), then forked: the child waits too, and
    // each comes back as one prefill of its own tokens (prompt, shared token, its token).
    let mut s = paged(4, 0, 64, PreemptionMode::Recompute);
    fill_four_blocks_then_grow(&mut s);
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![2]);
    s.fork(2, 3).unwrap();
    assert_eq!((s.num_waiting(), s.num_tokens(3).unwrap()), (2, 9));
    s.check_invariants().unwrap();
    s.append_tokens(&[(2, 100), (3, 101)]).unwrap();
    s.finish(1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![2, 3]);
    assert_eq!(out.do_sample, vec![true, true]);
    let last: Vec<i64> = (1..=2).map(|i| out.input_ids[out.query_start_loc[i] as usize - 1]).collect();
    assert_eq!(last, vec![100, 101]);
    assert_eq!(out.seq_lens, vec![10, 10]);
    s.check_invariants().unwrap();
}

#[test]
fn a_swapped_parent_forks_into_a_swapped_child_sharing_its_host_pages() {
    let mut s = paged(4, 8, 64, PreemptionMode::Swap);
    fill_four_blocks_then_grow(&mut s);
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![2]);
    let host_free = s.kv().num_free_host_blocks();
    s.fork(2, 3).unwrap();
    assert_eq!(s.num_swapped(), 2);
    assert_eq!(s.kv().num_free_host_blocks(), host_free, "the child shares the parent's host pages");
    s.check_invariants().unwrap();
    s.append_tokens(&[(2, 100), (3, 101)]).unwrap();
    s.finish(1).unwrap();
    // One at a time (each needs 3 of the 4 blocks): each computes the shared token 28 and its own.
    let mut transfers = Vec::new();
    for (id, token) in [(2, 100), (3, 101)] {
        let out = s.schedule().unwrap();
        assert_eq!(out.seq_ids, vec![id]);
        assert_eq!(out.input_ids, vec![28, token]);
        assert_eq!(out.positions, vec![8, 9]);
        s.finish(id).unwrap();
        transfers.extend(out.transfers.iter().map(|t| t.id));
    }
    s.complete_transfers(&transfers).unwrap();
    assert_eq!((s.kv().num_free_blocks(), s.kv().num_free_host_blocks()), (4, 8));
    s.check_invariants().unwrap();
}

#[test]
fn a_swapped_sequence_with_nothing_to_compute_stays_on_the_host_until_it_gets_a_token() {
    // Seq 2's sampled token (28) is computed, then it is swapped out while idle (a beam
    // waiting for its siblings): swap-in must not schedule an empty row for it.
    let mut s = paged(4, 8, 64, PreemptionMode::Swap);
    fill_four_blocks_then_grow(&mut s);
    s.finish(1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![2]);
    s.add_sequence(5, tokens(40, 4), 0, 0, 4, 1).unwrap(); // earlier arrival: ranks first
    s.schedule().unwrap(); // admits 5 (the last free block); 2 is idle
    s.append_token(5, 52).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![2], "5 needs a second block");
    s.finish(5).unwrap();
    let out = s.schedule().unwrap();
    assert!(out.seq_ids.is_empty() && s.num_swapped() == 1, "nothing to compute: it stays swapped");
    s.complete_transfers(&out.transfers.iter().map(|t| t.id).collect::<Vec<_>>()).unwrap();
    s.append_token(2, 29).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!((out.seq_ids.clone(), out.input_ids.clone(), out.positions.clone()), (vec![2], vec![29], vec![9]));
    s.finish(2).unwrap();
    s.complete_transfers(&out.transfers.iter().map(|t| t.id).collect::<Vec<_>>()).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn a_step_that_would_run_nothing_recomputes_idle_sequences_to_let_a_blocked_one_in() {
    // Seq 1 (9 tokens, 3 of 4 blocks) is idle: its row is taken and no token follows yet
    // (a beam waiting for its siblings). Seq 2 needs 2 blocks: without room made, no
    // step would ever run anything again.
    let mut s = paged(4, 8, 64, PreemptionMode::Swap);
    s.add_sequence(1, tokens(0, 8), 0, 0, 4, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 8).unwrap();
    s.schedule().unwrap();
    s.add_sequence(2, tokens(20, 8), 0, 1, 0, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![1]);
    assert_eq!(swapped(&out, "gpu"), 0, "recompute, not swap: a prefix hit shares its pages again");
    assert_eq!(out.seq_ids, vec![2]);
    assert_eq!(s.num_waiting(), 1);
    s.check_invariants().unwrap();
    // A sequence that waits but can never fit is not a reason to preempt anyone.
    let mut s = paged(4, 0, 64, PreemptionMode::Recompute);
    s.add_sequence(1, tokens(0, 8), 0, 0, 4, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 8).unwrap();
    s.schedule().unwrap();
    s.fork(1, 3).unwrap();
    s.append_tokens(&[(3, 9)]).unwrap(); // 3 has work, 1 stays idle
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![3]);
    assert!(out.preempted.is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn a_sequence_preempted_while_idle_is_parked_until_it_gets_a_token() {
    // As above: seq 1 is idle, seq 2 blocked; 1 is recomputed out to let 2 in. Then 2 is
    // idle too, and 1 has nothing to compute: neither may push the other out again (they
    // would take turns forever, each recomputing a row it already gave).
    let mut s = paged(4, 0, 64, PreemptionMode::Recompute);
    s.add_sequence(1, tokens(0, 8), 0, 0, 4, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 8).unwrap();
    s.schedule().unwrap();
    s.add_sequence(2, tokens(20, 8), 0, 1, 4, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!((out.preempted.clone(), out.seq_ids.clone()), (vec![1], vec![2]));
    let out = s.schedule().unwrap();
    assert!(out.seq_ids.is_empty() && out.preempted.is_empty(), "1 is parked: nothing to do");
    // A token for 1 ends its parking: now 2 (idle) makes room for it.
    s.append_token(1, 9).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(out.seq_ids, vec![1]);
    assert_eq!(*out.input_ids.last().unwrap(), 9);
    assert_eq!(out.do_sample, vec![true]);
    s.check_invariants().unwrap();
}

fn with_admission(blocks: usize, admission: AdmissionConfig) -> Scheduler {
    let bm = BlockManagerConfig { num_cpu_blocks: 64, ..BlockManagerConfig::new(blocks, 4) };
    Scheduler::paged(SchedulerConfig { admission, ..config(64, PreemptionMode::Swap) }, bm).unwrap()
}

/// Runs every sequence to its `(id, prompt, max_tokens)` length, each step's sampled
/// tokens appended (a sequence ends at max_tokens, like `ignore_eos`); returns the steps.
fn run_to_completion(s: &mut Scheduler, requests: &[(u64, u32, usize)]) -> u64 {
    for &(id, prompt, max_tokens) in requests {
        s.add_sequence(id, tokens(100 * id as u32, prompt), 0, id, max_tokens, 1).unwrap();
    }
    let target: std::collections::HashMap<u64, usize> = requests.iter().map(|&(id, p, m)| (id, p as usize + m)).collect();
    step_to_targets(s, &target)
}

/// Steps until every sequence has its `target` number of tokens (appending each step's
/// sampled token and finishing a sequence at its target); returns the steps.
fn step_to_targets(s: &mut Scheduler, target: &std::collections::HashMap<u64, usize>) -> u64 {
    let mut steps = 0;
    while s.has_unfinished() {
        let out = s.schedule().unwrap();
        let ids: Vec<u64> = out.transfers.iter().map(|t| t.id).collect();
        s.complete_transfers(&ids).unwrap();
        s.check_invariants().unwrap();
        for (i, &id) in out.seq_ids.iter().enumerate() {
            if out.do_sample[i] {
                s.append_token(id, 7).unwrap();
                if s.num_tokens(id).unwrap() >= target[&id] {
                    s.finish(id).unwrap();
                }
            }
        }
        steps += 1;
        assert!(steps < 1000, "the workload must finish");
    }
    steps
}

#[test]
fn expected_growth_holds_back_the_prompt_that_prompt_only_admission_preempts_for() {
    // 8 blocks of 4 tokens; three 4-token prompts that each grow to 16 tokens (4 blocks).
    // Prompt-only admission lets all three in (3 blocks) and decodes then preempt; the
    // expected growth (ratio 0.7: 9 of 12 tokens, 4 blocks each) fits two, and the
    // third starts when one of them has finished.
    let requests = [(1, 4, 12), (2, 4, 12), (3, 4, 12)];
    let prompt_only = AdmissionConfig { policy: AdmissionPolicy::PromptOnly, ..AdmissionConfig::default() };
    let mut old = with_admission(8, prompt_only);
    run_to_completion(&mut old, &requests);
    let old_stats = old.stats();
    assert!(old_stats.num_swap_preemptions + old_stats.num_recompute_preemptions > 0, "the old rule preempts here");

    let mut new = with_admission(8, AdmissionConfig::default());
    new.add_sequence(1, tokens(100, 4), 0, 1, 12, 1).unwrap();
    new.add_sequence(2, tokens(200, 4), 0, 2, 12, 1).unwrap();
    new.add_sequence(3, tokens(300, 4), 0, 3, 12, 1).unwrap();
    let out = new.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![1, 2], "the third prompt waits for room to grow");
    for id in [1, 2, 3] {
        new.finish(id).unwrap();
    }
    let mut new = with_admission(8, AdmissionConfig::default());
    run_to_completion(&mut new, &requests);
    let stats = new.stats();
    assert_eq!(stats.num_swap_preemptions + stats.num_recompute_preemptions, 0);
    assert_eq!(new.kv().num_free_blocks(), 8);
}

#[test]
fn a_lone_request_that_needs_the_whole_pool_still_runs() {
    // 8 blocks of 4 tokens, 1 kept free by the watermark: a request growing to 32 tokens
    // never fits beside its expected growth and the watermark, but it runs alone, and
    // also after a smaller one ahead of it has finished.
    let bm = BlockManagerConfig::new(8, 4);
    let mut s = Scheduler::paged_with_watermark(config(64, PreemptionMode::Recompute), bm, 1).unwrap();
    run_to_completion(&mut s, &[(1, 4, 28)]);
    run_to_completion(&mut s, &[(2, 4, 8), (3, 8, 24)]);
    let stats = s.stats();
    assert_eq!(stats.num_swap_preemptions + stats.num_recompute_preemptions, 0);
    // Every token but each sequence's last (sampled, never fed back) is computed once.
    assert_eq!(stats.decode_tokens + stats.prompt_tokens_computed, (32 - 1) + (12 - 1) + (32 - 1));
    assert_eq!(s.kv().num_free_blocks(), 8);
}

#[test]
fn the_ratio_decays_without_preemption_rises_after_one_and_learns_from_finished_sequences() {
    let admission = AdmissionConfig { decay_steps: 10, ..AdmissionConfig::default() };
    let mut s = with_admission(4, admission);
    assert_eq!(s.admission_ratio(), 0.7);
    for _ in 0..5 {
        s.schedule().unwrap();
    }
    assert!((s.admission_ratio() - 0.4).abs() < 1e-9, "0.7 - 5 x 0.06, got {}", s.admission_ratio());
    for _ in 0..20 {
        s.schedule().unwrap();
    }
    assert!((s.admission_ratio() - 0.1).abs() < 1e-9, "floored at min_ratio, got {}", s.admission_ratio());
    fill_four_blocks_then_grow(&mut s); // one more step
    s.schedule().unwrap(); // preempts
    assert!((s.admission_ratio() - 0.55).abs() < 1e-9, "halfway from 0.1 to 1, got {}", s.admission_ratio());
    s.finish(1).unwrap();
    s.finish(2).unwrap();
    // Finished sequences that used about half their max_tokens set the floor near 0.5.
    run_to_completion(&mut s, &[(3, 4, 4)]);
    s.add_sequence(4, tokens(0, 4), 0, 4, 8, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(4, 7).unwrap();
    s.schedule().unwrap();
    s.append_token(4, 7).unwrap();
    s.finish(4).unwrap(); // 2 of 8 outputs; with 4 of 4 before: 6 of 12
    for _ in 0..100 {
        s.schedule().unwrap();
    }
    // Recent finishes weigh more: the earlier one's counts are scaled by 0.98.
    let floor = (4.0 * 0.98 + 2.0) / (4.0 * 0.98 + 8.0);
    assert!((s.admission_ratio() - floor).abs() < 1e-9, "about 6 / 12 outputs used, got {}", s.admission_ratio());
}

fn prefill_first(blocks: usize, on: bool) -> Scheduler {
    let bm = BlockManagerConfig { num_cpu_blocks: 64, ..BlockManagerConfig::new(blocks, 4) };
    Scheduler::paged(SchedulerConfig { prefill_first: on, ..config(64, PreemptionMode::Swap) }, bm).unwrap()
}

#[test]
fn prefill_first_runs_arriving_prompts_without_the_decodes_but_never_two_steps_in_a_row() {
    for on in [true, false] {
        let mut s = prefill_first(64, on);
        s.add_sequence(1, tokens(100, 8), 0, 1, 32, 1).unwrap();
        s.add_sequence(2, tokens(200, 8), 0, 2, 32, 1).unwrap();
        assert_eq!(s.schedule().unwrap().seq_ids, vec![1, 2]);
        s.append_token(1, 7).unwrap();
        s.append_token(2, 7).unwrap();
        // Two prompts arrive while 1 and 2 decode.
        s.add_sequence(3, tokens(300, 8), 0, 3, 32, 1).unwrap();
        s.add_sequence(4, tokens(400, 8), 0, 4, 32, 1).unwrap();
        let out = s.schedule().unwrap();
        if on {
            assert_eq!((out.seq_ids.clone(), out.num_scheduled_tokens.clone()), (vec![3, 4], vec![8, 8]), "the prompts alone");
        } else {
            assert_eq!((out.seq_ids.clone(), out.num_scheduled_tokens.clone()), (vec![1, 2, 3, 4], vec![1, 1, 8, 8]));
            continue;
        }
        s.append_token(3, 7).unwrap();
        s.append_token(4, 7).unwrap();
        // One more arrives at once: the decodes skipped last step run now, the prompt beside them.
        s.add_sequence(5, tokens(500, 8), 0, 5, 32, 1).unwrap();
        let out = s.schedule().unwrap();
        assert_eq!((out.seq_ids.clone(), out.num_scheduled_tokens.clone()), (vec![1, 2, 3, 4, 5], vec![1, 1, 1, 1, 8]));
        for id in [1, 2, 3, 4, 5] {
            s.append_token(id, 7).unwrap();
        }
        // A step with nothing waiting is a plain decode step; the next arrival runs alone again.
        assert_eq!(s.schedule().unwrap().seq_ids, vec![1, 2, 3, 4, 5]);
        for id in [1, 2, 3, 4, 5] {
            s.append_token(id, 7).unwrap();
        }
        s.add_sequence(6, tokens(600, 8), 0, 6, 32, 1).unwrap();
        assert_eq!(s.schedule().unwrap().seq_ids, vec![6]);
        s.check_invariants().unwrap();
        for id in 1..=6 {
            s.finish(id).unwrap();
        }
    }
}

#[test]
fn a_prefill_first_step_keeps_the_expected_growth_of_the_decodes_it_skips() {
    // 8 blocks of 4 tokens; 4-token prompts that grow to 16 tokens (4 blocks each): two
    // fit beside their growth, a third does not. The step it arrives in must not treat
    // its empty batch as "alone" (the prompt-only rule): the decodes run, it waits.
    let mut s = prefill_first(8, true);
    s.add_sequence(1, tokens(100, 4), 0, 1, 12, 1).unwrap();
    s.add_sequence(2, tokens(200, 4), 0, 2, 12, 1).unwrap();
    assert_eq!(s.schedule().unwrap().seq_ids, vec![1, 2]);
    s.append_token(1, 7).unwrap();
    s.append_token(2, 7).unwrap();
    s.add_sequence(3, tokens(300, 4), 0, 3, 12, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.seq_ids, vec![1, 2]);
    assert_eq!(s.num_waiting(), 1);
    for id in [1, 2, 3] {
        s.finish(id).unwrap();
    }
    s.check_invariants().unwrap();
}

#[test]
fn shared_prefix_pages_are_not_credited_once_per_holder() {
    // 4-token blocks, 12 device blocks, a 16-token prefix (4 pages) shared by every
    // prompt, exact growth (ratio 1). Crediting each finishing sequence with its whole
    // table counts the shared pages once per holder, admits into room that never comes
    // and preempts; crediting each page to its last holder admits only what fits.
    let exact = AdmissionConfig { init_ratio: 1.0, min_ratio: 1.0, ..AdmissionConfig::default() };
    let mut s = with_admission(12, exact);
    let prefix: Vec<u32> = (500..516).collect();
    let max_tokens = [6usize, 14, 10, 18, 4, 12];
    for (i, &m) in max_tokens.iter().enumerate() {
        let id = i as u64 + 1;
        let mut prompt = prefix.clone();
        prompt.push(900 + id as u32);
        s.add_sequence(id, prompt, 0, id, m, 1).unwrap();
    }
    let target: std::collections::HashMap<u64, usize> =
        max_tokens.iter().enumerate().map(|(i, &m)| (i as u64 + 1, 17 + m)).collect();
    step_to_targets(&mut s, &target);
    let stats = s.stats();
    assert_eq!(stats.num_swap_preemptions + stats.num_recompute_preemptions, 0);
    assert!(stats.cached_prompt_tokens > 0, "the prompts shared their prefix pages");
}
