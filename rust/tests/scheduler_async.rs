//! Asynchronous scheduling's placeholders (rust/src/scheduler/lifecycle.rs): a step planned
//! before the previous one's token is sampled computes a placeholder the runner fills; no block
//! holding one is hashed until the token is known, a failed step's placeholders are dropped, and
//! a waiting sequence with one is never admitted.

use pagedrs::block_manager::{BlockManagerConfig, PLACEHOLDER_TOKEN};
use pagedrs::scheduler::{AdmissionConfig, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig};

fn scheduler() -> Scheduler {
    let config = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        preemption_mode: PreemptionMode::Recompute,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        admission: AdmissionConfig::default(),
        sliding_window: None,
        prefill_first: false,
    };
    let mut s = Scheduler::paged(config, BlockManagerConfig::new(16, 4)).unwrap();
    s.set_max_steps_in_flight(2).unwrap();
    s
}



/// A decode is planned on a placeholder; the block it completes is hashed (and is a
/// prefix hit for another sequence) only once the token is known and its step is done.
#[test]
fn a_placeholder_is_scheduled_and_its_block_is_hashed_once_resolved() {
    let mut s = scheduler();
    s.add_sequence(1, vec![10, 11, 12], 0, 0, 8, 1).unwrap();
    let first = s.schedule().unwrap();
    assert_eq!(first.seq_ids, vec![1]);
    s.append_placeholders(&[1]).unwrap();
    let second = s.schedule().unwrap(); // planned while the first is in flight
    assert_eq!(second.input_ids, vec![PLACEHOLDER_TOKEN as i64]);
    s.complete_step(first.step_id, true).unwrap();
    s.complete_step(second.step_id, true).unwrap();
    // not hashed yet: a sequence with the real token as its prompt finds no full block
    s.add_sequence(2, vec![10, 11, 12, 13, 99], 0, 1, 4, 1).unwrap();
    assert_eq!(s.resolve_placeholders(&[(1, 13)]).unwrap(), 1);
    let third = s.schedule().unwrap();
    assert!(third.seq_ids.contains(&2));
    assert_eq!(s.num_cached_tokens_of(2).unwrap(), Some(4), "the resolved block is a prefix hit");
    assert!(s.resolve_placeholders(&[(1, 14)]).is_err(), "no placeholder left to resolve");
    assert_eq!(s.resolve_placeholders(&[(77, 14)]).unwrap(), 0, "a sequence gone meanwhile is skipped");
    assert!(s.resolve_placeholders(&[(1, PLACEHOLDER_TOKEN)]).is_err());
    s.complete_step(third.step_id, true).unwrap();
    s.finish(1).unwrap();
    s.finish(2).unwrap();
    s.check_invariants().unwrap();
}

/// A step that fails resets its sequences; their placeholders are dropped, and a waiting
/// sequence with a placeholder is never admitted (its prefill would compute an unknown token).
#[test]
fn a_failed_step_drops_placeholders_and_a_waiting_placeholder_is_not_admitted() {
    let mut s = scheduler();
    s.add_sequence(1, vec![10, 11, 12], 0, 0, 8, 1).unwrap();
    let first = s.schedule().unwrap();
    s.append_placeholders(&[1]).unwrap();
    let second = s.schedule().unwrap();
    assert_eq!(s.complete_step(first.step_id, false).unwrap(), vec![1]);
    assert!(s.open_steps().is_empty(), "the later step failed with it: {second:?}");
    let again = s.schedule().unwrap();
    assert!(again.seq_ids.is_empty(), "admitted with a placeholder in its prompt: {again:?}");
    s.complete_step(again.step_id, true).unwrap();
    assert_eq!(s.drop_placeholders(&[1]).unwrap(), 1);
    let recompute = s.schedule().unwrap();
    assert_eq!(recompute.input_ids, vec![10, 11, 12]);
    s.complete_step(recompute.step_id, true).unwrap();
    s.finish(1).unwrap();
    s.check_invariants().unwrap();
}
