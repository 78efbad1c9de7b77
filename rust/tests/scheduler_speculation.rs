//! Speculative decoding in the scheduler (rust/src/scheduler/speculation.rs): a decode carries
//! its proposal's drafts, `accept_drafts` keeps the verified ones and cuts the rest from the
//! tokens and the pages, drafts never reach the prefix cache unverified, a failed step drops
//! them, and the pool or the budget being tight means fewer drafts, never a preemption.

use pagedrs::block_manager::BlockManagerConfig;
use pagedrs::scheduler::{AdmissionConfig, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig};

fn scheduler(num_blocks: usize, budget: usize) -> Scheduler {
    let config = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        preemption_mode: PreemptionMode::Recompute,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        admission: AdmissionConfig::default(),
        sliding_window: None,
        prefill_first: false,
    };
    Scheduler::paged(config, BlockManagerConfig::new(num_blocks, 4)).unwrap()
}

/// Prefill [10, 11, 12], then sample 13: the next decode may carry drafts.
fn decoding(s: &mut Scheduler) {
    s.add_sequence(1, vec![10, 11, 12], 0, 0, 16, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 13).unwrap();
}

#[test]
fn drafts_ride_a_decode_and_the_rejected_ones_leave_tokens_and_pages() {
    let mut s = scheduler(16, 64);
    decoding(&mut s);
    let free = s.kv().num_free_blocks();
    s.set_proposal(1, &[14, 15, 16, 17, 18]).unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.input_ids, vec![13, 14, 15, 16, 17, 18]);
    assert_eq!(step.positions, vec![3, 4, 5, 6, 7, 8]);
    assert_eq!(step.num_draft_tokens, vec![5]);
    assert_eq!(step.do_sample, vec![true]);
    assert_eq!(free - s.kv().num_free_blocks(), 2, "positions 4..8 took two pages");
    assert!(s.schedule().is_err(), "no plan while drafts are unverified");
    assert_eq!(s.accept_drafts(1, 2).unwrap(), 3);
    assert_eq!(s.num_tokens(1).unwrap(), 6);
    assert_eq!(free - s.kv().num_free_blocks(), 1, "the page of only rejected drafts went back");
    s.append_token(1, 40).unwrap(); // the correction token
    let next = s.schedule().unwrap();
    assert_eq!((next.input_ids.clone(), next.positions.clone()), (vec![40], vec![6]));
    assert_eq!(next.num_draft_tokens, vec![0], "a proposal serves one step");
    s.check_invariants().unwrap();
    // The verified tokens' page is a prefix hit; the rejected drafts' never was.
    s.append_token(1, 41).unwrap();
    s.schedule().unwrap();
    s.add_sequence(2, vec![10, 11, 12, 13, 14, 15, 40, 41, 1], 0, 1, 2, 1).unwrap();
    s.add_sequence(3, vec![10, 11, 12, 13, 14, 15, 16, 17, 1], 0, 2, 2, 1).unwrap();
    s.append_token(1, 42).unwrap();
    let last = s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens_of(2).unwrap(), Some(8));
    assert_eq!(s.num_cached_tokens_of(3).unwrap(), Some(4), "no page holding a rejected draft is ever a hit");
    s.complete_step(last.step_id, true).unwrap();
    for id in 1..=3 {
        s.finish(id).unwrap();
    }
    s.check_invariants().unwrap();
    assert_eq!(s.kv().num_free_blocks(), 16);
}

#[test]
fn all_drafts_accepted_keep_every_page_and_a_gone_sequence_is_skipped() {
    let mut s = scheduler(16, 64);
    decoding(&mut s);
    s.set_proposal(1, &[14, 15]).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.accept_drafts(1, 2).unwrap(), 0);
    assert_eq!(s.accept_drafts(1, 0).unwrap(), 0, "no drafts: nothing to do");
    assert!(s.accept_drafts(1, 1).is_err(), "more accepted than it holds");
    s.append_token(1, 16).unwrap(); // the bonus token
    assert_eq!(s.num_tokens(1).unwrap(), 7);
    s.finish(1).unwrap();
    assert_eq!(s.accept_drafts(1, 1).unwrap(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn the_budget_max_tokens_and_a_tight_pool_shorten_the_drafts() {
    // budget: 3 tokens a step leaves room for 2 drafts beside the decode
    let mut s = scheduler(16, 3);
    decoding(&mut s);
    s.set_proposal(1, &[14, 15, 16, 17]).unwrap();
    assert_eq!(s.schedule().unwrap().num_draft_tokens, vec![2]);
    s.accept_drafts(1, 0).unwrap();
    // max_tokens: 2 outputs allowed, 1 sampled: one more output, so no draft at all
    let mut s = scheduler(16, 64);
    s.add_sequence(1, vec![10, 11, 12], 0, 0, 2, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 13).unwrap();
    s.set_proposal(1, &[14, 15]).unwrap();
    assert_eq!(s.schedule().unwrap().num_draft_tokens, vec![0]);
    // a tight pool: one page for the prompt and the decode, no page for drafts past it
    let mut s = scheduler(1, 64);
    s.add_sequence(1, vec![10, 11], 0, 0, 2, 1).unwrap();
    s.schedule().unwrap();
    s.append_token(1, 13).unwrap();
    s.set_proposal(1, &[14, 15, 16]).unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.num_draft_tokens, vec![0], "drafts never cost a page the pool lacks");
    assert!(step.preempted.is_empty());
}

#[test]
fn a_failed_step_drops_its_drafts_so_a_recompute_never_prefills_a_guess() {
    let mut s = scheduler(16, 64);
    decoding(&mut s);
    s.set_proposal(1, &[14, 15, 16]).unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(s.complete_step(step.step_id, false).unwrap(), vec![1]);
    assert_eq!(s.num_tokens(1).unwrap(), 4, "back to the verified tokens");
    let again = s.schedule().unwrap();
    assert_eq!(again.input_ids, vec![10, 11, 12, 13]);
    assert_eq!(again.num_draft_tokens, vec![0]);
    s.finish(1).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn set_draft_tokens_replaces_a_reserved_proposal_and_the_kept_ones_are_the_new_tokens() {
    // The draft model guesses after the plan: a proposal of reserved tokens, then the real ones.
    let mut s = scheduler(16, 64);
    decoding(&mut s);
    s.set_proposal(1, &[0, 0, 0]).unwrap();
    s.schedule().unwrap();
    assert!(s.set_draft_tokens(1, &[14, 15]).is_err(), "exactly as many as it holds");
    assert!(s.set_draft_tokens(99, &[14, 15, 16]).is_err(), "an unknown sequence");
    s.set_draft_tokens(1, &[14, 15, 16]).unwrap();
    assert_eq!(s.accept_drafts(1, 2).unwrap(), 1);
    s.append_token(1, 30).unwrap();
    let step = s.schedule().unwrap();
    assert_eq!((step.input_ids.clone(), step.positions.clone()), (vec![30], vec![6]));
    s.append_token(1, 31).unwrap();
    s.schedule().unwrap();
    // The page [13 14 15 30] holds the replaced drafts: a prompt with them hits it, one with the reserved ones does not.
    s.add_sequence(2, vec![10, 11, 12, 13, 14, 15, 30, 31, 1], 0, 1, 2, 1).unwrap();
    s.add_sequence(3, vec![10, 11, 12, 13, 0, 0, 30, 31, 1], 0, 2, 2, 1).unwrap();
    s.append_token(1, 32).unwrap();
    let last = s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens_of(2).unwrap(), Some(8));
    assert_eq!(s.num_cached_tokens_of(3).unwrap(), Some(4));
    s.complete_step(last.step_id, true).unwrap();
    s.check_invariants().unwrap();
    assert!(s.set_draft_tokens(1, &[5]).is_err(), "no drafts held now");
}

/// A verify round cut short after the step was reported done (rounds 0 and 1 accepted d1 d2,
/// then an interrupt): the drafts below the last recorded one are kept, the rest cut, and
/// the last recorded one is computed again by the next decode, which gives its row.
#[test]
fn rewind_keeps_the_recorded_drafts_and_computes_the_last_one_again() {
    let mut s = scheduler(16, 64);
    decoding(&mut s);
    s.set_proposal(1, &[14, 15, 16]).unwrap();
    let step = s.schedule().unwrap();
    assert!(s.rewind(1, 6).is_err(), "a step in flight is reported first");
    s.complete_step(step.step_id, true).unwrap();
    assert!(s.rewind(1, 3).is_err(), "below its last sampled token (4 tokens)");
    assert!(s.rewind(1, 8).is_err(), "above what it holds (7)");
    assert!(s.rewind(1, 6).unwrap());
    assert_eq!(s.num_tokens(1).unwrap(), 6);
    let next = s.schedule().unwrap();
    assert_eq!((next.input_ids.clone(), next.positions.clone()), (vec![15], vec![5]), "d2 computed again");
    assert_eq!(next.do_sample, vec![true]);
    s.complete_step(next.step_id, true).unwrap();
    assert!(!s.rewind(9, 1).unwrap(), "a sequence no longer here is skipped");
    s.check_invariants().unwrap();
    s.finish(1).unwrap();
    assert_eq!(s.kv().num_free_blocks(), 16);
}

/// The round drew a rejection (`accept_drafts` cut the rest) and the interrupt came before the
/// drawn token was appended: every recorded token is computed and none is coming, so the
/// sequence is prefilled again; a consistent sequence is left alone.
#[test]
fn rewind_recomputes_a_sequence_left_waiting_for_a_token_and_leaves_a_consistent_one() {
    let mut s = scheduler(16, 64);
    decoding(&mut s);
    for id in s.open_steps() {
        s.complete_step(id, true).unwrap();
    }
    assert!(!s.rewind(1, 4).unwrap(), "13 is still to compute: consistent");
    s.set_proposal(1, &[14, 15, 16]).unwrap();
    let step = s.schedule().unwrap();
    s.complete_step(step.step_id, true).unwrap();
    s.accept_drafts(1, 1).unwrap();
    assert!(s.rewind(1, 5).unwrap());
    assert_eq!((s.num_running(), s.num_waiting()), (0, 1));
    let next = s.schedule().unwrap();
    // prefilled again up to the last recorded token: its first page (10..13, committed) is a prefix hit
    assert_eq!((next.input_ids.clone(), next.positions.clone()), (vec![14], vec![4]));
    assert_eq!(next.do_sample, vec![true]);
    s.complete_step(next.step_id, true).unwrap();
    s.check_invariants().unwrap();
    s.finish(1).unwrap();
    assert_eq!(s.kv().num_free_blocks(), 16);
}

/// Placeholders (asynchronous scheduling, which never speculates) are refused by name, nothing changed.
#[test]
fn rewind_refuses_a_sequence_with_placeholders() {
    let mut s = scheduler(16, 64);
    s.add_sequence(1, vec![10, 11, 12], 0, 0, 16, 1).unwrap();
    let step = s.schedule().unwrap();
    s.complete_step(step.step_id, true).unwrap();
    s.append_placeholders(&[1]).unwrap();
    let err = s.rewind(1, 3).unwrap_err().to_string();
    assert!(err.contains("placeholders"), "{err}");
    assert_eq!(s.num_tokens(1).unwrap(), 4);
}
