//! A step's life after `schedule` (rust/src/scheduler/steps.rs): what a step writes is a
//! prefix-cache hit for other steps only once it is reported done, a failed step caches
//! nothing anywhere, and steps are reported in order.

use pagedrs::block_manager::BlockManagerConfig;
use pagedrs::scheduler::{AdmissionConfig, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig};

const BS: usize = 4;

fn scheduler(blocks: usize) -> Scheduler {
    let config = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        preemption_mode: PreemptionMode::Recompute,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        admission: AdmissionConfig::default(),
        sliding_window: None,
        prefill_first: false,
    };
    Scheduler::paged(config, BlockManagerConfig::new(blocks, BS)).unwrap()
}

fn prompt(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

#[test]
fn a_reported_step_publishes_its_blocks_and_the_next_request_hits_them() {
    let mut s = scheduler(16);
    s.add_sequence(1, prompt(9), 0, 0, 4, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(s.kv().num_cached_blocks().0, 0, "nothing is a hit before the step is reported");
    assert_eq!(s.complete_step(out.step_id, true).unwrap(), Vec::<u64>::new());
    assert_eq!(s.kv().num_cached_blocks().0, 2);
    s.add_sequence(2, prompt(9), 0, 1, 4, 1).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens_of(2).unwrap(), Some(8));
}

#[test]
fn two_requests_of_one_step_share_their_prompt() {
    let mut s = scheduler(16);
    s.add_sequence(1, prompt(9), 0, 0, 4, 1).unwrap();
    s.add_sequence(2, prompt(9), 0, 1, 4, 1).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens_of(2).unwrap(), Some(8), "the same step's blocks are hits within it");
    assert_eq!(s.kv().num_free_blocks(), 16 - 4, "2 shared blocks + 2 last pages");
}

#[test]
fn a_failed_step_caches_nothing_and_resets_its_sequences() {
    let mut s = scheduler(16);
    s.add_sequence(1, prompt(9), 0, 0, 4, 1).unwrap();
    s.add_sequence(2, prompt(9), 0, 1, 4, 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(s.complete_step(out.step_id, false).unwrap(), vec![1, 2]);
    assert_eq!(s.kv().num_cached_blocks(), (0, 0, 0));
    assert_eq!(s.kv().num_free_blocks(), 16, "every page is free again");
    assert_eq!((s.num_waiting(), s.num_running()), (2, 0));
    assert_eq!(s.stats().num_failed_steps, 1);
    // Recomputed from the first token, and nothing of the failed step is a hit.
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![9, 1], "the second shares the first's blocks of this step");
    s.check_invariants().unwrap();
}

#[test]
fn a_sequence_aborted_while_its_step_is_in_flight_leaves_no_unwritten_page_behind() {
    for ok in [true, false] {
        let mut s = scheduler(16);
        s.add_sequence(1, prompt(9), 0, 0, 4, 1).unwrap();
        let out = s.schedule().unwrap();
        s.finish(1).unwrap(); // an abort before the step is reported
        // Its full blocks stay pinned: not free, not evictable, not movable to another tier.
        assert_eq!(s.kv().num_free_blocks(), 16 - 2);
        s.check_invariants().unwrap();
        s.complete_step(out.step_id, ok).unwrap();
        assert_eq!(s.kv().num_free_blocks(), 16);
        assert_eq!(s.kv().num_cached_blocks().0, if ok { 2 } else { 0 });
        s.check_invariants().unwrap();
    }
}

#[test]
fn with_two_steps_in_flight_the_second_does_not_hit_the_first_and_fails_with_it() {
    let mut s = scheduler(32);
    s.set_max_steps_in_flight(2).unwrap();
    s.add_sequence(1, prompt(9), 0, 0, 4, 1).unwrap();
    let first = s.schedule().unwrap();
    s.add_sequence(2, prompt(9), 0, 1, 4, 1).unwrap();
    let second = s.schedule().unwrap();
    assert_eq!(s.open_steps(), vec![first.step_id, second.step_id]);
    assert_eq!(s.num_cached_tokens_of(2).unwrap(), Some(0), "step 1 may still fail: its blocks are no hit for step 2");
    let err = s.complete_step(second.step_id, true).unwrap_err().to_string();
    assert!(err.contains("not the oldest step in flight"), "{err}");
    assert_eq!(s.complete_step(first.step_id, false).unwrap(), vec![1, 2], "a later step may read what the failed one did not write");
    assert!(s.open_steps().is_empty());
    assert_eq!(s.kv().num_cached_blocks(), (0, 0, 0));
    assert_eq!(s.kv().num_free_blocks(), 32);
    s.check_invariants().unwrap();
}

#[test]
fn scheduling_the_next_step_reports_the_previous_one_done() {
    let mut s = scheduler(16);
    s.add_sequence(1, prompt(9), 0, 0, 4, 1).unwrap();
    let out = s.schedule().unwrap();
    s.append_token(1, 7).unwrap();
    s.schedule().unwrap();
    assert!(s.complete_step(out.step_id, true).is_err(), "already reported by the second schedule");
    assert_eq!(s.kv().num_cached_blocks().0, 2);
}
