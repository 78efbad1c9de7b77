//! Exact-outcome tests of the BlockManager: which block ids, which copies, which counters.

use pagedrs::block_manager::{BlockManager, BlockManagerConfig, CoreError, SwapInStatus, Tier};

fn manager(num_gpu_blocks: usize, block_size: usize, num_cpu_blocks: usize) -> BlockManager {
    let mut cfg = BlockManagerConfig::new(num_gpu_blocks, block_size);
    cfg.num_cpu_blocks = num_cpu_blocks;
    BlockManager::new(cfg).unwrap()
}

fn ok(bm: &BlockManager) {
    bm.check_invariants().unwrap();
}

#[test]
fn allocate_takes_blocks_in_order_and_free_returns_them() {
    let mut bm = manager(8, 4, 0);
    assert_eq!(bm.allocate(1, &[1, 2, 3, 4, 5]).unwrap(), 0);
    assert_eq!(bm.block_table(1).unwrap(), &[0, 1]);
    assert_eq!(bm.num_free_gpu_blocks(), 6);
    let mut slots = Vec::new();
    bm.slot_mapping_into(1, 2, 5, &mut slots).unwrap();
    assert_eq!(slots, vec![2, 3, 4]);
    bm.free(1).unwrap();
    assert_eq!(bm.num_free_gpu_blocks(), 8);
    ok(&bm);
    assert_eq!(bm.free(1), Err(CoreError::UnknownSequence(1)));
}

#[test]
fn prefix_hit_needs_commit_and_shares_blocks() {
    let mut bm = manager(8, 4, 0);
    let prompt: Vec<u32> = (0..10).collect();
    assert_eq!(bm.allocate(1, &prompt).unwrap(), 0);
    // Reserved but not committed: no hit.
    assert_eq!(bm.num_blocks_to_allocate(&prompt), 3);
    bm.commit(1, 4).unwrap();
    // Block 0 committed (in use, free cost 0); block 1 is not.
    assert_eq!(bm.num_blocks_to_allocate(&prompt), 2);
    bm.commit(1, 10).unwrap();
    assert_eq!(bm.allocate(2, &prompt).unwrap(), 8);
    assert_eq!(bm.block_table(2).unwrap(), &[0, 1, 3]);
    assert_eq!(bm.gpu_refcount(0), Some(2));
    let s = bm.stats();
    assert_eq!((s.prefix_queries, s.prefix_hits), (4, 2));
    ok(&bm);
}

#[test]
fn last_token_is_always_computed() {
    let mut bm = manager(8, 4, 0);
    let prompt: Vec<u32> = (0..8).collect();
    bm.allocate(1, &prompt).unwrap();
    bm.commit(1, 8).unwrap();
    // Two full blocks, but only (8 - 1) / 4 = 1 can be a hit.
    assert_eq!(bm.allocate(2, &prompt).unwrap(), 4);
    assert_eq!(bm.block_table(2).unwrap(), &[0, 2]);
}

#[test]
fn freed_cached_blocks_are_evicted_lru_tail_first_after_free_ones() {
    let mut bm = manager(4, 2, 0);
    bm.allocate(1, &[1, 2, 3, 4, 5]).unwrap(); // blocks 0 1 2
    bm.commit(1, 5).unwrap(); // caches 0 and 1
    bm.free(1).unwrap();
    assert_eq!(bm.num_free_gpu_blocks(), 4);
    // Never-cached blocks (2, then 3) go first; then the LRU cached block: block 1, the
    // prompt's tail, released first.
    bm.allocate(2, &[9, 9, 9, 9, 9, 9]).unwrap();
    assert_eq!(bm.block_table(2).unwrap(), &[2, 3, 1]);
    assert_eq!(bm.stats().evictions, 1);
    // Block 0 is still a hit.
    bm.free(2).unwrap();
    assert_eq!(bm.allocate(3, &[1, 2, 7]).unwrap(), 2);
    assert_eq!(bm.block_table(3).unwrap()[0], 0);
    ok(&bm);
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut bm = manager(2, 2, 0);
    bm.allocate(1, &[1, 2, 3]).unwrap();
    let before = (bm.stats(), bm.num_free_gpu_blocks());
    let err = bm.allocate(2, &[1, 2, 3, 4, 5]).unwrap_err();
    assert_eq!(err, CoreError::OutOfBlocks { tier: Tier::Gpu, needed: 3, available: 0 });
    assert_eq!((bm.stats(), bm.num_free_gpu_blocks()), before);
    assert!(!bm.contains(2));
    assert!(matches!(bm.append_tokens(1, &[4, 5, 6]), Err(CoreError::OutOfBlocks { .. })));
    assert_eq!(bm.tokens(1).unwrap(), &[1, 2, 3]);
    ok(&bm);
}

#[test]
fn fork_then_append_copies_only_a_shared_partial_block() {
    let mut bm = manager(8, 4, 0);
    bm.allocate(1, &[1, 2, 3, 4, 5, 6]).unwrap(); // [0, 1]
    bm.fork(1, 2).unwrap();
    assert_eq!(bm.num_free_gpu_blocks(), 6);
    assert_eq!(bm.num_blocks_to_append(2, 1).unwrap(), 1);
    assert_eq!(bm.append_tokens(2, &[7]).unwrap(), vec![(1, 2)]);
    assert_eq!(bm.block_table(2).unwrap(), &[0, 2]);
    // The parent is now the sole user of block 1: no copy.
    assert_eq!(bm.append_tokens(1, &[8, 9]).unwrap(), vec![]);
    assert_eq!(bm.block_table(1).unwrap(), &[0, 1]);
    // A full shared block is never copied: 4 tokens fill block 0 of a fresh fork pair.
    bm.allocate(3, &[1, 1, 1, 1]).unwrap();
    bm.fork(3, 4).unwrap();
    assert_eq!(bm.append_tokens(4, &[5]).unwrap(), vec![]);
    assert_eq!(bm.stats().cow_copies, 1);
    ok(&bm);
}

#[test]
fn a_pinned_copy_on_write_source_outlives_its_last_user_until_released() {
    let mut bm = manager(8, 4, 4);
    bm.set_pin_cow_sources(true);
    bm.allocate(1, &[1, 2, 3, 4, 5, 6]).unwrap(); // [0, 1]
    bm.fork(1, 2).unwrap();
    assert_eq!(bm.append_tokens(2, &[7]).unwrap(), vec![(1, 2)]);
    assert_eq!((bm.num_cow_pins(), bm.gpu_refcount(1)), (1, Some(2)), "the child's user became the pin");
    ok(&bm);
    // The pin is no user: the parent appends in place, as without it.
    assert_eq!(bm.num_blocks_to_append(1, 1).unwrap(), 0);
    assert_eq!(bm.append_tokens(1, &[8]).unwrap(), vec![]);
    // Its last user leaving does not free the block the copy still has to read.
    assert_eq!(bm.swap_out(&[1]).unwrap().len(), 2);
    assert_eq!(bm.gpu_refcount(1), Some(1));
    assert_eq!(bm.num_free_gpu_blocks(), 5, "blocks 0 and 2 in use by the child, block 1 pinned");
    ok(&bm);
    bm.release_cow_pins();
    assert_eq!((bm.num_cow_pins(), bm.num_free_gpu_blocks()), (0, 6));
    ok(&bm);
}

#[test]
fn swap_out_copies_each_block_once_and_keeps_shared_pages_on_device() {
    let mut bm = manager(8, 2, 8);
    bm.allocate(1, &[1, 2, 3]).unwrap(); // [0, 1]
    bm.fork(1, 2).unwrap();
    bm.fork(1, 3).unwrap();
    assert_eq!(bm.num_blocks_to_swap_out(&[1, 2]).unwrap(), 2);
    assert_eq!(bm.swap_out(&[1, 2]).unwrap(), vec![(0, 0), (1, 1)]);
    assert_eq!(bm.block_table(1).unwrap(), &[0, 1]); // host ids now
    assert!(bm.is_swapped(1).unwrap() && !bm.is_swapped(3).unwrap());
    assert_eq!(bm.gpu_refcount(0), Some(1)); // kept for sequence 3
    assert_eq!(bm.num_free_cpu_blocks(), 6);
    ok(&bm);
    assert!(matches!(bm.swap_out(&[1]), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(bm.append_tokens(1, &[4]), Err(CoreError::InvalidArgument(_))));
    assert_eq!(bm.can_swap_in(&[1, 2]).unwrap(), SwapInStatus::Ok);
    assert_eq!(bm.swap_in(&[1, 2]).unwrap(), vec![(0, 2), (1, 3)]);
    assert_eq!(bm.block_table(2).unwrap(), &[2, 3]);
    assert_eq!(bm.num_free_cpu_blocks(), 8);
    let s = bm.stats();
    assert_eq!((s.swap_out_blocks, s.swap_in_blocks), (2, 2));
    ok(&bm);
}

#[test]
fn can_swap_in_answers_later_and_never() {
    let mut bm = manager(3, 2, 4);
    bm.allocate(1, &[1, 2, 3, 4, 5]).unwrap(); // 3 blocks
    bm.swap_out(&[1]).unwrap();
    bm.allocate(2, &[7]).unwrap();
    assert_eq!(bm.can_swap_in(&[1]).unwrap(), SwapInStatus::Later);
    assert!(matches!(bm.swap_in(&[1]), Err(CoreError::OutOfBlocks { tier: Tier::Gpu, .. })));
    assert!(bm.is_swapped(1).unwrap());
    bm.free(2).unwrap();
    bm.fork(1, 3).unwrap();
    assert_eq!(bm.can_swap_in(&[1, 3]).unwrap(), SwapInStatus::Ok);
    let mut big = manager(2, 2, 4);
    big.allocate(1, &[1, 2]).unwrap();
    big.swap_out(&[1]).unwrap();
    big.append_tokens(1, &[3]).unwrap_err();
    assert_eq!(big.can_swap_in(&[1]).unwrap(), SwapInStatus::Ok);
    ok(&bm);
}

#[test]
fn host_cache_keeps_evicted_blocks_and_hits_them() {
    let mut cfg = BlockManagerConfig::new(2, 2);
    cfg.num_cpu_blocks = 2;
    cfg.host_cache_evicted = true;
    let mut bm = BlockManager::new(cfg).unwrap();
    bm.allocate(1, &[1, 2, 3]).unwrap(); // [0, 1]
    bm.commit(1, 3).unwrap(); // caches block 0
    bm.free(1).unwrap();
    bm.allocate(2, &[8, 8, 8, 8]).unwrap(); // takes 1, then evicts 0 → host block 0
    assert_eq!(bm.block_table(2).unwrap(), &[1, 0]);
    assert_eq!(bm.take_pending_host_copies(), (vec![(0, 0)], vec![]));
    bm.free(2).unwrap();
    // [1, 2] is no longer on the device but comes back from the host.
    assert_eq!(bm.allocate(3, &[1, 2, 5]).unwrap(), 2);
    let table = bm.block_table(3).unwrap().to_vec();
    assert_eq!(bm.take_pending_host_copies(), (vec![], vec![(0, table[0])]));
    let s = bm.stats();
    assert_eq!((s.host_cache_hits, s.host_cache_evictions_saved, s.prefix_hits), (1, 1, 1));
    ok(&bm);
}

#[test]
fn salted_manager_still_shares_its_own_prompts() {
    let prompt = [1, 2, 3, 4, 5];
    let mut cfg = BlockManagerConfig::new(8, 2);
    cfg.cache_salt = Some(7);
    let mut salted = BlockManager::new(cfg).unwrap();
    salted.allocate(1, &prompt).unwrap();
    salted.commit(1, 5).unwrap();
    assert_eq!(salted.allocate(2, &prompt).unwrap(), 4);
}

#[test]
fn errors_name_the_value_and_what_is_allowed() {
    assert_eq!(
        BlockManager::new(BlockManagerConfig::new(4, 0)).err().unwrap().to_string(),
        "block_size must be at least 1, got 0"
    );
    let mut bm = manager(4, 2, 0);
    bm.allocate(1, &[1]).unwrap();
    let dup = bm.allocate(1, &[1]).unwrap_err().to_string();
    assert!(dup.contains("sequence id 1 is already allocated"), "{dup}");
    let e = bm.commit(1, 5).unwrap_err().to_string();
    assert!(e.contains("num_computed_tokens = 5") && e.contains("1 tokens"), "{e}");
    assert!(bm.allocate(2, &[]).unwrap_err().to_string().contains("at least one token"));
    assert!(bm.fork(1, 1).is_err() && bm.fork(9, 2) == Err(CoreError::UnknownSequence(9)));
    let mut out = Vec::new();
    assert!(bm.slot_mapping_into(1, 0, 2, &mut out).unwrap_err().to_string().contains("num_tokens = 1"));
}
