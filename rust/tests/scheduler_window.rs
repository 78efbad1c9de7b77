//! The scheduler with a sliding window: after each step's commit, pages wholly before the
//! window of the step's first query are released, the runner's block tables show them as
//! -1, and no slot of the step falls in one.

use pagedrs::block_manager::BlockManagerConfig;
use pagedrs::scheduler::{
    AdmissionConfig, AdmissionPolicy, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput,
};

fn windowed(window: Option<usize>, blocks: usize, cpu: usize, budget: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        preemption_mode: PreemptionMode::Swap,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        sliding_window: window,
        prefill_first: false,
        // optimistic admission: the swap tests here need pools that preempt
        admission: AdmissionConfig { policy: AdmissionPolicy::PromptOnly, ..AdmissionConfig::default() },
    };
    Scheduler::paged(cfg, BlockManagerConfig { num_cpu_blocks: cpu, ..BlockManagerConfig::new(blocks, 4) }).unwrap()
}

/// Row `row` of the step's block tables, without padding.
fn table(out: &SchedulerOutput, row: usize, num_tokens: usize) -> Vec<i32> {
    out.block_tables[row * out.max_blocks..][..num_tokens.div_ceil(4)].to_vec()
}

/// Reports every step still open as done (`Scheduler::complete_step`): until then the
/// blocks a step filled stay pinned.
fn report_open_steps(s: &mut Scheduler) {
    for step in s.open_steps() {
        s.complete_step(step, true).unwrap();
    }
}

#[test]
fn chunked_prefill_then_decode_releases_what_left_the_window() {
    let mut s = windowed(Some(6), 32, 0, 8);
    s.add_sequence(1, (0..20).collect(), 0, 0, 8, 1).unwrap();
    // Chunks 0..8, 8..16, 16..20, each appended (its pages taken) when it is scheduled:
    // the first query of each reads from 0, 3 and 11.
    for (first, released, recorded) in [(0, 0, 8), (8, 0, 16), (16, 2, 20)] {
        let out = s.schedule().unwrap();
        assert_eq!(out.positions[0], first);
        assert_eq!(out.do_sample, vec![recorded == 20]);
        let row = table(&out, 0, recorded);
        assert!(row[..released].iter().all(|&b| b == -1) && row[released..].iter().all(|&b| b >= 0), "{row:?}");
        assert!(out.slot_mapping.iter().all(|&slot| row.contains(&((slot / 4) as i32))));
        assert_eq!(s.kv().num_held_blocks(1).unwrap(), recorded.div_ceil(4) - released);
        s.check_invariants().unwrap();
    }
    assert_eq!((s.stats().prompt_tokens_computed, s.stats().decode_tokens), (20, 0));
    // Decodes at 20, 21, ...: a page goes each time the window passes its end.
    for (i, pos) in (20..28).enumerate() {
        s.append_token(1, 100 + i as u32).unwrap();
        let out = s.schedule().unwrap();
        assert_eq!(out.positions, vec![pos]);
        let first_needed = pos as usize + 1 - 6;
        let row = table(&out, 0, pos as usize + 1);
        assert_eq!(row.iter().filter(|&&b| b == -1).count(), first_needed / 4, "position {pos}");
        s.check_invariants().unwrap();
    }
    assert_eq!(s.kv().block_manager_stats().window_released_blocks, 5);
    assert_eq!((s.stats().prompt_tokens_computed, s.stats().decode_tokens), (20, 8));
    s.finish(1).unwrap();
    report_open_steps(&mut s); // the last step's blocks are pinned until it is reported
    assert_eq!(s.kv().num_free_blocks(), 32);
}

#[test]
fn a_windowed_prompt_longer_than_the_pool_runs_in_its_window() {
    // 6 pages of 4 tokens hold 24 tokens; a window of 6 with 4-token chunks needs at most
    // ceil((6 + 2 * 4) / 4) + 2 = 6 pages at any time, so a 40-token prompt is admitted.
    let mut full = windowed(None, 6, 0, 4);
    let err = full.add_sequence(1, (0..40).collect(), 0, 0, 8, 1).unwrap_err().to_string();
    assert!(err.contains("needs up to 12 blocks"), "{err}");
    let mut s = windowed(Some(6), 6, 0, 4);
    assert_eq!(s.worst_case_blocks(40, 8, 1), 6);
    s.add_sequence(1, (0..40).collect(), 0, 0, 8, 1).unwrap();
    let mut computed = Vec::new();
    for _ in 0..100 {
        if s.num_tokens(1).unwrap() == 48 {
            break;
        }
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        assert!(s.kv().num_held_blocks(1).unwrap() <= 4, "a chunk and the window before it");
        computed.extend(out.positions.iter().copied());
        if out.do_sample == [true] {
            s.append_token(1, 1000).unwrap();
        }
    }
    assert_eq!(s.num_tokens(1).unwrap(), 48);
    assert_eq!(computed, (0..47).collect::<Vec<i64>>(), "every token computed once, in order");
    assert_eq!(s.stats().num_recompute_preemptions, 0);
    s.finish(1).unwrap();
    assert_eq!(s.kv().num_free_blocks(), 6);
}

#[test]
fn without_a_window_every_page_stays() {
    let mut s = windowed(None, 32, 0, 64);
    s.add_sequence(1, (0..20).collect(), 0, 0, 8, 1).unwrap();
    s.schedule().unwrap();
    for t in 0..8 {
        s.append_token(1, t).unwrap();
        s.schedule().unwrap();
    }
    assert_eq!(s.kv().num_held_blocks(1).unwrap(), 7);
    assert_eq!(s.kv().block_manager_stats().window_released_blocks, 0);
    s.finish(1).unwrap();
}

#[test]
fn a_windowed_sequence_swaps_only_its_held_pages_and_comes_back() {
    // 9 pages of 4 tokens, window 4. Seq 1 (26-token prompt) decodes down to one held page
    // of its 7-entry table; seq 2 (32 tokens, higher priority) then takes the other 8, and
    // its first decode needs a ninth: seq 1, last in the running order, is swapped out.
    let mut s = windowed(Some(4), 9, 16, 64);
    s.add_sequence(1, (0..26).collect(), 0, 0, 8, 1).unwrap();
    s.schedule().unwrap();
    for t in [100, 101] {
        s.append_token(1, t).unwrap();
        s.schedule().unwrap();
        if t == 100 {
            s.add_sequence(2, (200..232).collect(), -1, 1, 4, 1).unwrap();
        }
    }
    assert_eq!(s.kv().num_held_blocks(1).unwrap(), 1, "positions 24..28 of 28 tokens");
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.kv().num_free_blocks(), 0);
    s.append_token(1, 102).unwrap();
    s.append_token(2, 300).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![1]);
    let to_host: Vec<_> = out.transfers.iter().filter(|t| t.src.to_string() == "gpu").flat_map(|t| t.pairs.clone()).collect();
    assert_eq!(to_host.len(), 1, "only the held page is copied: {to_host:?}");
    s.complete_transfers(&out.transfers.iter().map(|t| t.id).collect::<Vec<_>>()).unwrap();
    s.check_invariants().unwrap();
    // Seq 2's decode released its own pages: seq 1 comes back at the next step with one page.
    s.append_token(2, 301).unwrap();
    let out = s.schedule().unwrap();
    let to_device: usize = out.transfers.iter().filter(|t| t.dst.to_string() == "gpu").map(|t| t.pairs.len()).sum();
    assert_eq!(to_device, 1);
    assert_eq!(out.seq_ids, vec![2, 1]);
    assert_eq!(out.positions, vec![33, 28], "seq 1 decodes the token it had before the swap");
    s.complete_transfers(&out.transfers.iter().map(|t| t.id).collect::<Vec<_>>()).unwrap();
    s.check_invariants().unwrap();
    s.finish(1).unwrap();
    s.finish(2).unwrap();
    report_open_steps(&mut s);
    s.check_invariants().unwrap();
    assert_eq!(s.kv().num_free_blocks(), 9);
}
