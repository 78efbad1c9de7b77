//! `Scheduler::core_stats`: the one place the scheduler's and the KV space's counters are
//! gathered (the bindings hand it to Python and build `stats()` from it).

use pagedrs::block_manager::BlockManagerConfig;
use pagedrs::scheduler::{AdmissionConfig, PreemptionCost, PreemptionMode, ReservePolicy, Scheduler, SchedulerConfig};

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        preemption_mode: PreemptionMode::Recompute,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        admission: AdmissionConfig::default(),
        sliding_window: None,
        prefill_first: false,
    }
}

/// Two requests with one 8-token prefix, then a decode step of each.
fn run(s: &mut Scheduler) {
    let prompt: Vec<u32> = (100..109).collect();
    s.add_sequence(1, prompt.clone(), 0, 0, 4, 1).unwrap();
    let out = s.schedule().unwrap();
    s.complete_step(out.step_id, true).unwrap();
    s.add_sequence(2, prompt, 0, 1, 4, 1).unwrap();
    s.append_token(1, 7).unwrap();
    let out = s.schedule().unwrap();
    s.complete_step(out.step_id, true).unwrap();
}

#[test]
fn paged_core_stats_are_the_counters_of_both_parts() {
    let mut s = Scheduler::paged(config(), BlockManagerConfig::new(16, 4)).unwrap();
    run(&mut s);
    let c = s.core_stats();
    let (sched, bm) = (s.stats(), s.kv().block_manager_stats());
    assert_eq!((c.num_steps, c.num_decode_tokens, c.num_prompt_tokens_computed), (2, 1, 9 + 1));
    assert_eq!((c.num_steps, c.num_prompt_tokens_computed), (sched.num_steps, sched.prompt_tokens_computed));
    assert_eq!((c.prefix_queries, c.prefix_hits, c.prefix_hits_device), (4, 2, 2), "the second prompt hit both full blocks");
    assert_eq!((c.prefix_queries, c.prefix_hits, c.evictions), (bm.prefix_queries, bm.prefix_hits, bm.evictions));
    assert_eq!((c.num_running, c.num_waiting, c.num_swapped), (2, 0, 0));
    assert_eq!(c.num_used_gpu_blocks, c.num_gpu_blocks - c.num_free_gpu_blocks);
    assert_eq!((c.num_gpu_blocks, c.num_free_gpu_blocks), (16, 16 - 4), "2 shared blocks + 2 last pages");
    assert_eq!(c.num_cached_gpu_blocks, 2);
    assert_eq!((c.reserved_slots, c.live_slots), (4 * 4, 8 + 2 + 1));
}

#[test]
fn contiguous_core_stats_count_no_cache_and_no_host_tier() {
    let mut s = Scheduler::contiguous(config(), 32, 4, ReservePolicy::Request).unwrap();
    run(&mut s);
    let c = s.core_stats();
    assert_eq!((c.num_steps, c.num_running), (2, 2));
    assert_eq!((c.prefix_queries, c.prefix_hits, c.num_cached_gpu_blocks, c.num_free_cpu_blocks, c.num_disk_blocks), (0, 0, 0, 0, 0));
    assert_eq!(c.num_prompt_tokens_computed, 9 + 9, "nothing is shared: both prompts computed");
    assert_eq!(c.num_free_gpu_blocks, 32 - 2 * 4, "each region reserves prompt + max_tokens = 13 tokens");
}
