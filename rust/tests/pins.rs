//! Pinned prefixes (`BlockManager::pin_cached`, `Scheduler::pin_prefix`): a property test of
//! random serve / pin / unpin / reset sequences, checking after every call that the
//! invariants hold (a pin is a hidden sequence: refcount = table entries), that every live
//! pin's prefix is still a device hit however much else was served (a pinned page is never
//! evicted), and that a pin only ever holds committed pages; then the scheduler's fit check.

use proptest::prelude::*;

use pagedrs::block_manager::{BlockManager, BlockManagerConfig};
use pagedrs::scheduler::{AdmissionConfig, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig};

const BS: usize = 2;

#[derive(Debug, Clone)]
enum Op {
    /// A prompt of `len` tokens whose first `shared` come from a common stream: allocated,
    /// committed up to `frac / 4` of it, and freed unless `keep`.
    Serve { shared: usize, len: usize, seed: u32, frac: u8, keep: bool },
    /// Pin the first `len` tokens of the common stream.
    Pin { len: usize },
    Unpin { index: usize },
    FreeKept,
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0usize..10, 1usize..12, any::<u32>(), 0u8..=4, any::<bool>())
            .prop_map(|(shared, len, seed, frac, keep)| Op::Serve { shared, len, seed, frac, keep }),
        3 => (0usize..10).prop_map(|len| Op::Pin { len }),
        2 => (0usize..4).prop_map(|index| Op::Unpin { index }),
        1 => Just(Op::FreeKept),
        1 => Just(Op::Reset),
    ]
}

fn common(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + i).collect()
}

fn prompt(shared: usize, len: usize, seed: u32) -> Vec<u32> {
    let mut p = common(shared.min(len));
    p.extend((p.len()..len).map(|i| seed.wrapping_mul(31).wrapping_add(i as u32) % 50));
    p
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn pins_keep_their_pages_and_the_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        let mut bm = BlockManager::new(BlockManagerConfig::new(8, BS)).unwrap();
        let root = bm.root_hash();
        let mut next_seq = 1u64;
        let mut kept: Vec<u64> = Vec::new();
        let mut pins: Vec<(u64, Vec<u32>)> = Vec::new(); // (pin seq, pinned tokens)
        for op in ops {
            match op {
                Op::Serve { shared, len, seed, frac, keep } => {
                    let p = prompt(shared, len, seed);
                    let seq = next_seq;
                    next_seq += 1;
                    if bm.allocate(seq, &p).is_ok() {
                        bm.commit(seq, p.len() * frac as usize / 4).unwrap();
                        if keep { kept.push(seq) } else { bm.free(seq).unwrap() }
                    }
                }
                Op::Pin { len } => {
                    let tokens = common(len);
                    let before = bm.num_cached_tokens(&[tokens.clone(), vec![7]].concat());
                    let seq = 1_000_000 + next_seq;
                    next_seq += 1;
                    let new = bm.num_new_pinned_blocks(&tokens, root);
                    let pinned_before = bm.num_pinned_prefix_blocks();
                    match bm.pin_cached(seq, &tokens, root) {
                        Ok(n) => {
                            // only what was committed and cached on the device: never more
                            prop_assert!(n * BS <= before.max(n * BS) && n * BS <= tokens.len());
                            prop_assert_eq!(n * BS, before.min(tokens.len() / BS * BS));
                            prop_assert!(bm.num_pinned_prefix_blocks() <= pinned_before + new);
                            pins.push((seq, tokens[..n * BS].to_vec()));
                        }
                        Err(_) => prop_assert!(before < BS, "a refused pin had nothing cached"),
                    }
                }
                Op::Unpin { index } => {
                    if index < pins.len() {
                        let (seq, _) = pins.remove(index);
                        bm.free(seq).unwrap();
                    }
                }
                Op::FreeKept => {
                    for seq in kept.drain(..) {
                        bm.free(seq).unwrap();
                    }
                }
                Op::Reset => {
                    let refused = bm.reset_prefix_cache().is_err();
                    prop_assert_eq!(refused, !kept.is_empty(), "a reset runs beside pins, never beside a live sequence");
                }
            }
            bm.check_invariants().map_err(TestCaseError::fail)?;
            for (seq, tokens) in &pins {
                prop_assert!(bm.is_pin(*seq));
                let probe = [tokens.clone(), vec![7]].concat();
                prop_assert!(bm.num_cached_tokens(&probe) >= tokens.len(), "pin {seq}'s prefix was evicted");
            }
        }
        for (seq, _) in pins.drain(..) {
            bm.free(seq).unwrap();
        }
        for seq in kept {
            bm.free(seq).unwrap();
        }
        prop_assert_eq!(bm.num_free_gpu_blocks(), 8);
        prop_assert_eq!(bm.num_pinned_prefix_blocks(), 0);
        bm.check_invariants().map_err(TestCaseError::fail)?;
    }
}

fn scheduler(blocks: usize) -> Scheduler {
    let config = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 1024,
        preemption_mode: PreemptionMode::Recompute,
        aging_steps: 0,
        cost: PreemptionCost { swap_cost_per_block: 1.0, recompute_cost_per_token: 1.0 },
        admission: AdmissionConfig::default(),
        sliding_window: None,
        prefill_first: false,
    };
    Scheduler::paged(config, BlockManagerConfig::new(blocks, 4)).unwrap()
}

/// Runs a prompt to its end in the scheduler: admitted, prefilled, finished.
fn serve(s: &mut Scheduler, id: u64, tokens: &[u32]) {
    s.add_sequence(id, tokens.to_vec(), 0, id, 1, 1).unwrap();
    while s.num_cached_tokens_of(id).unwrap().is_none() || s.num_waiting() > 0 {
        s.schedule().unwrap();
    }
    s.schedule().unwrap(); // reports the prefill's step: its pages are published
    s.finish(id).unwrap();
}

#[test]
fn the_scheduler_pins_after_the_prefill_and_its_fit_check_subtracts_the_pins() {
    let mut s = scheduler(8);
    let system: Vec<u32> = (100..116).collect(); // 4 pages of 4
    assert!(s.pin_prefix(&system, None).is_err(), "nothing computed: nothing to pin");
    serve(&mut s, 1, &system);
    let pin = s.pin_prefix(&system, None).unwrap();
    assert_eq!((pin.num_tokens, pin.num_pages, s.num_pinned_blocks(), s.usable_blocks()), (16, 4, 4, 4));
    assert!(s.pin_prefix(&system, Some(b"tenant")).is_err(), "another salt's chain has nothing cached");
    s.check_invariants().unwrap();
    // 5 pages could fit the pool, but not beside the pin: refused up front, naming it
    let err = s.add_sequence(2, (0..17).collect(), 0, 2, 1, 1).unwrap_err().to_string();
    assert!(err.contains("4 of them pinned"), "{err}");
    // ... unless 4 of the 5 are the pinned pages themselves: the prompt shares them
    let longer: Vec<u32> = system.iter().copied().chain(0..3).collect();
    s.add_sequence(2, longer, 0, 2, 1, 1).unwrap();
    s.finish(2).unwrap();
    // pressure: other prompts take every unpinned page, many times over; the pin stays a hit
    for id in 3..10u64 {
        serve(&mut s, id, &((id as u32 * 50)..(id as u32 * 50 + 13)).collect::<Vec<_>>());
    }
    let prompt: Vec<u32> = system.iter().copied().chain([1, 2]).collect();
    s.add_sequence(20, prompt, 0, 20, 1, 1).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens_of(20).unwrap(), Some(16));
    s.finish(20).unwrap();
    for step in s.open_steps() {
        s.complete_step(step, true).unwrap();
    }
    let reset = s.reset_prefix_cache().unwrap();
    assert!(reset.device > 0, "the unpinned pages are cleared");
    assert_eq!(s.kv().num_cached_tokens(&[system.clone(), vec![9]].concat(), s.kv().salted_root(None)), 16, "the pinned ones stay");
    assert!(s.unpin(pin.id).is_ok() && s.unpin(pin.id).is_err());
    assert_eq!((s.num_pinned_blocks(), s.pins().len(), s.kv().num_free_blocks()), (0, 0, 8));
    s.check_invariants().unwrap();
}
