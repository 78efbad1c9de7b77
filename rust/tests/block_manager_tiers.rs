//! The page-cache tiers below the device: pages travel device → host → disk → device
//! with exact transfer lists, per-tier hit counters, miss reasons, the disk tier's
//! seeding (a hash alone is never trusted) and the shutdown flush.

use pagedrs::block_manager::{BlockManager, BlockManagerConfig, DiskPage, Tier, Transfer};

fn tiers(gpu: usize, cpu: usize, disk: usize) -> BlockManager {
    let cfg = BlockManagerConfig {
        num_cpu_blocks: cpu,
        host_cache_evicted: cpu > 0,
        num_disk_blocks: disk,
        ..BlockManagerConfig::new(gpu, 2)
    };
    BlockManager::new(cfg).unwrap()
}

/// One planned transfer: (src, dst, pairs).
type Move = (Tier, Tier, Vec<(u32, u32)>);

/// Every transfer planned since the last call.
fn moves(bm: &mut BlockManager) -> Vec<Move> {
    bm.take_transfers().into_iter().map(|Transfer { src, dst, pairs, .. }| (src, dst, pairs)).collect()
}

/// Allocates, commits everything and frees: the prompt's full blocks stay cached. The
/// transfers stay planned (and their pins held) until the caller takes them.
fn run(bm: &mut BlockManager, seq: u64, prompt: &[u32]) -> usize {
    let cached = bm.allocate(seq, prompt).unwrap();
    bm.commit(seq, prompt.len()).unwrap();
    bm.free(seq).unwrap();
    cached
}

#[test]
fn a_page_travels_device_host_disk_and_back() {
    use Tier::*;
    let mut bm = tiers(2, 1, 2);
    run(&mut bm, 1, &[1, 2, 3]); // caches A = [1, 2] in device block 0
    assert_eq!(moves(&mut bm), vec![]);
    run(&mut bm, 2, &[5, 6, 7]); // evicts A → host 0; caches B = [5, 6] in device block 1
    assert_eq!(moves(&mut bm), vec![(Gpu, Cpu, vec![(0, 0)])]);
    run(&mut bm, 3, &[8, 9, 10]); // evicts B → host 0, whose A goes to disk 0 first
    assert_eq!(moves(&mut bm), vec![(Cpu, Disk, vec![(0, 0)]), (Gpu, Cpu, vec![(1, 0)])]);
    bm.check_invariants().unwrap();

    assert_eq!(bm.allocate(4, &[1, 2, 9]).unwrap(), 2, "A comes back from disk");
    let a = bm.block_table(4).unwrap()[0];
    let m = moves(&mut bm);
    assert_eq!(m.last(), Some(&(Disk, Gpu, vec![(0, a)])));
    // Taking A's blocks pushed C = [8, 9] to the host and B on to disk slot 1.
    bm.free(4).unwrap();
    assert_eq!(bm.allocate(5, &[8, 9, 1]).unwrap(), 2, "C comes back from the host");
    let c = bm.block_table(5).unwrap()[0];
    assert_eq!(moves(&mut bm).last(), Some(&(Cpu, Gpu, vec![(0, c)])));
    bm.free(5).unwrap();
    assert_eq!(bm.allocate(6, &[8, 9, 2]).unwrap(), 2, "and is now a device hit");

    let s = bm.stats();
    assert_eq!((s.prefix_hits, s.host_cache_hits, s.disk_cache_hits), (3, 1, 1));
    assert_eq!((s.host_cache_evictions_saved, s.disk_writes), (3, 2));
    bm.check_invariants().unwrap();
}

#[test]
fn a_host_hit_is_pinned_before_the_evictions_it_causes() {
    // The host holds one page; bringing it back evicts a device page that would reuse
    // the very host block being read, were it not pinned first.
    let mut bm = tiers(2, 1, 0);
    run(&mut bm, 1, &[1, 2, 3]);
    run(&mut bm, 2, &[5, 6, 7]); // A → host 0; B cached on device
    moves(&mut bm);
    bm.allocate(3, &[1, 2, 4]).unwrap(); // A from host 0; B is evicted and cannot take host 0
    let m = moves(&mut bm);
    assert!(m.iter().all(|(src, dst, pairs)| !(*src == Tier::Gpu && *dst == Tier::Cpu && pairs.iter().any(|p| p.1 == 0))), "{m:?}");
    bm.check_invariants().unwrap();
}

#[test]
fn every_miss_has_a_reason() {
    let mut bm = tiers(2, 0, 1);
    for (seq, prompt) in [[1, 2, 3], [5, 6, 7], [8, 9, 10], [11, 12, 13]].iter().enumerate() {
        run(&mut bm, seq as u64, prompt); // each evicts the previous page to disk, which drops the one before
        moves(&mut bm); // the copy completes: its disk slot is no longer pinned
    }
    bm.allocate(5, &[1, 2, 3]).unwrap(); // A: evicted from disk
    bm.free(5).unwrap();
    bm.allocate(6, &[20, 21, 3]).unwrap(); // never seen
    let s = bm.stats();
    assert_eq!((s.prefix_misses_evicted_disk, s.prefix_misses_never_seen), (1, 5));
    bm.free(6).unwrap();

    let mut no_lower = tiers(2, 0, 0);
    run(&mut no_lower, 1, &[1, 2, 3]);
    run(&mut no_lower, 2, &[5, 6, 7]);
    run(&mut no_lower, 3, &[8, 9, 10]); // A left the device with nowhere to go
    no_lower.allocate(4, &[1, 2, 3]).unwrap();
    assert_eq!(no_lower.stats().prefix_misses_evicted, 1);

    let mut seeded = tiers(2, 0, 2);
    let stale = DiskPage { slot: 0, hash: 0xdead, parent: 0, tokens: vec![1, 2] };
    assert_eq!(seeded.seed_disk(&[stale], &[hash_of_first_block(&[1, 2])]).unwrap(), 0, "a wrong hash is never trusted");
    seeded.allocate(1, &[1, 2, 3]).unwrap();
    assert_eq!(seeded.stats().prefix_misses_invalidated, 1);
    for bm in [&bm, &no_lower, &seeded] {
        let s = bm.stats();
        let sum = s.prefix_misses_never_seen + s.prefix_misses_evicted + s.prefix_misses_evicted_disk + s.prefix_misses_invalidated;
        assert_eq!(sum, s.prefix_queries - s.prefix_hits);
    }
}

/// The hash a first block gets, read back from a manager that cached it.
fn hash_of_first_block(tokens: &[u32]) -> u64 {
    let mut bm = tiers(2, 0, 1);
    run(&mut bm, 1, &[tokens[0], tokens[1], 0]);
    bm.flush_to_disk();
    let page = disk_pages(&bm);
    page[0].hash
}

/// What a store would persist: the disk tier's pages (read through a flush of a twin).
fn disk_pages(bm: &BlockManager) -> Vec<DiskPage> {
    bm.disk_pages()
}

#[test]
fn seeded_pages_are_hits_after_a_restart() {
    let mut before = tiers(4, 0, 4);
    run(&mut before, 1, &[1, 2, 3, 4, 5]); // caches [1, 2], [3, 4]
    let flushed = before.flush_to_disk();
    assert_eq!(flushed.len(), 1);
    assert_eq!((flushed[0].src, flushed[0].dst, flushed[0].pairs.len()), (Tier::Gpu, Tier::Disk, 2));
    let pages = disk_pages(&before);
    assert_eq!(pages.len(), 2);

    let mut after = tiers(4, 0, 4);
    let mut forged = pages[1].clone();
    forged.tokens = vec![9, 9]; // same hash, other tokens: skipped
    forged.slot = 3;
    assert_eq!(after.seed_disk(&[pages[0].clone(), pages[1].clone(), forged], &[]).unwrap(), 2);
    after.check_invariants().unwrap();
    assert_eq!(after.allocate(1, &[1, 2, 3, 4, 5]).unwrap(), 4);
    assert_eq!(after.stats().disk_cache_hits, 2);
    let err = after.seed_disk(&[], &[]).unwrap_err().to_string();
    assert!(err.contains("needs an unused disk tier"), "{err}");
    after.free(1).unwrap();
    after.take_transfers();
    after.check_invariants().unwrap();
}

#[test]
fn flush_keeps_the_most_recently_used_pages_when_the_disk_is_small() {
    let mut bm = tiers(4, 0, 1);
    run(&mut bm, 1, &[1, 2, 3]); // A, released first
    run(&mut bm, 2, &[5, 6, 7]); // B, most recently used
    let t = bm.flush_to_disk();
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].pairs.len(), 1);
    let b_block = t[0].pairs[0].0;
    assert_eq!(bm.disk_pages()[0].tokens, vec![5, 6]);
    assert_ne!(b_block, 0, "A's device block is not the one flushed");
    bm.complete_transfers(&[t[0].id]).unwrap();
    bm.check_invariants().unwrap();
}
