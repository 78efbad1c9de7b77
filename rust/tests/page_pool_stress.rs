//! Many threads take and return random batches: no block is ever held by two threads at
//! once, none is lost, and short batches change nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use pagedrs::page_pool::PagePool;

#[test]
fn no_block_handed_out_twice_none_lost() {
    const BLOCKS: usize = 64;
    const THREADS: usize = 4;
    const ROUNDS: usize = 20_000;
    let pool = Arc::new(PagePool::new(BLOCKS));
    let held: Arc<Vec<AtomicBool>> = Arc::new((0..BLOCKS).map(|_| AtomicBool::new(false)).collect());
    let barrier = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, held, barrier) = (pool.clone(), held.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ t as u64; // xorshift, fixed seed per thread
                let mut mine = Vec::new();
                barrier.wait();
                for _ in 0..ROUNDS {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let k = 1 + (rng % 24) as usize;
                    mine.clear();
                    if !pool.take_into(k, &mut mine) {
                        assert!(mine.is_empty(), "a failed take must not hand out blocks");
                        continue;
                    }
                    assert_eq!(mine.len(), k);
                    for &b in &mine {
                        assert!(!held[b as usize].swap(true, Ordering::AcqRel), "block {b} handed out twice");
                    }
                    for &b in &mine {
                        held[b as usize].store(false, Ordering::Release);
                    }
                    pool.put(&mine);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(pool.num_free(), BLOCKS);
    let mut ids = pool.free_ids();
    ids.sort_unstable();
    assert_eq!(ids, (0..BLOCKS as u32).collect::<Vec<_>>());
}
