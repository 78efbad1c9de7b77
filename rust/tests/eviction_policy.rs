//! The eviction policies seen through the BlockManager: a prefix hit often survives a
//! scan of one-off prompts under LFU with aging, and is the first to go under LRU; the
//! order of a whole evictable set, exactly, for each policy.

use pagedrs::block_manager::{BlockManager, BlockManagerConfig, EvictionPolicyKind};

fn manager(policy: EvictionPolicyKind) -> BlockManager {
    BlockManager::new(BlockManagerConfig { eviction_policy: policy, ..BlockManagerConfig::new(4, 2) }).unwrap()
}

/// allocate + commit + free; returns the tokens found cached.
fn serve(bm: &mut BlockManager, seq: u64, prompt: &[u32]) -> usize {
    let cached = bm.allocate(seq, prompt).unwrap();
    bm.commit(seq, prompt.len()).unwrap();
    bm.free(seq).unwrap();
    bm.check_invariants().unwrap();
    cached
}

/// A hot prompt served three times, then three one-off prompts, then the hot one again.
fn hot_prefix_after_scan(policy: EvictionPolicyKind) -> usize {
    let mut bm = manager(policy);
    let hot = [1, 2, 3, 4, 5]; // two full blocks and a partial one
    assert_eq!(serve(&mut bm, 1, &hot), 0);
    assert_eq!(serve(&mut bm, 2, &hot), 4);
    assert_eq!(serve(&mut bm, 3, &hot), 4);
    for (i, t) in [10u32, 11, 12].into_iter().enumerate() {
        assert_eq!(serve(&mut bm, 10 + i as u64, &[t, t, t]), 0);
    }
    serve(&mut bm, 20, &hot)
}

#[test]
fn lfu_keeps_a_hot_prefix_through_a_scan_lru_does_not() {
    assert_eq!(hot_prefix_after_scan(EvictionPolicyKind::Lfu), 4, "LFU: both hot blocks still cached");
    assert_eq!(hot_prefix_after_scan(EvictionPolicyKind::Lru), 0, "LRU: the scan evicted them, tail first");
}

#[test]
fn lru_is_the_default() {
    assert_eq!(BlockManagerConfig::new(4, 2).eviction_policy, EvictionPolicyKind::Lru);
}

#[test]
fn exact_eviction_order_per_policy() {
    // Six blocks of 2 tokens. Four one-block prompts (plus a partial block each, freed
    // again), served in the order 3, 2, 1, 0; then prompt p is hit p more times. Two
    // 5-token prompts of new tokens then take 3 blocks each: 3 cached pages are evicted.
    let kept = |policy: EvictionPolicyKind| -> Vec<bool> {
        let mut bm = BlockManager::new(BlockManagerConfig { eviction_policy: policy, ..BlockManagerConfig::new(6, 2) }).unwrap();
        let prompts: Vec<[u32; 3]> = (0..4u32).map(|p| [p + 1, p + 1, 99]).collect();
        let mut seq = 0;
        for p in [3, 2, 1, 0] {
            seq += 1;
            assert_eq!(serve(&mut bm, seq, &prompts[p]), 0);
        }
        for (p, prompt) in prompts.iter().enumerate() {
            for _ in 0..p {
                seq += 1;
                assert_eq!(serve(&mut bm, seq, prompt), 2);
            }
        }
        serve(&mut bm, 100, &[50, 50, 51, 51, 52]);
        serve(&mut bm, 101, &[60, 60, 61, 61, 62]);
        prompts.iter().map(|p| bm.num_cached_tokens(p) == 2).collect()
    };
    // LRU: the hits re-released prompts 1, 2, 3 after 0, in that order: 0, 1, 2 go first.
    assert_eq!(kept(EvictionPolicyKind::Lru), vec![false, false, false, true]);
    // LFU-DA: keys 1 + uses = 1, 2, 3, 4. The first new prompt evicts prompt 0 (age 1) and
    // its own pages enter with key 2; then prompt 1 (key 2, released before them) and one
    // of the new prompt's pages go. Prompts 2 and 3 stay.
    assert_eq!(kept(EvictionPolicyKind::Lfu), vec![false, false, true, true]);
}
