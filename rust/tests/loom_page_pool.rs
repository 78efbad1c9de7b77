//! Loom models of the lock-free page pool: every interleaving of 2–3 threads on a tiny pool.
//! Run with `RUSTFLAGS="--cfg loom" cargo test --release --test loom_page_pool`.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use pagedrs::page_pool::PagePool;

fn sorted(mut v: Vec<u32>) -> Vec<u32> {
    v.sort_unstable();
    v
}

#[test]
fn concurrent_single_takes_and_puts() {
    loom::model(|| {
        let pool = Arc::new(PagePool::new(2));
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let b = pool.take().expect("one block each");
                    pool.put(&[b]);
                    b
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(pool.num_free(), 2);
        assert_eq!(sorted(pool.free_ids()), vec![0, 1]);
    });
}

#[test]
fn batches_are_all_or_nothing_and_disjoint() {
    loom::model(|| {
        let pool = Arc::new(PagePool::new(3));
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let mut got = Vec::new();
                    let ok = pool.take_into(2, &mut got);
                    assert_eq!(got.len(), if ok { 2 } else { 0 });
                    got
                })
            })
            .collect();
        let got: Vec<Vec<u32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // 3 blocks cannot serve two batches of 2: exactly one succeeds.
        assert_eq!(got.iter().filter(|g| !g.is_empty()).count(), 1);
        let taken: Vec<u32> = got.concat();
        assert_eq!(pool.num_free(), 1);
        let mut all = taken.clone();
        all.extend(pool.free_ids());
        assert_eq!(sorted(all), vec![0, 1, 2]);
    });
}

#[test]
fn three_threads_take_return_batches_aba() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(PagePool::new(3));
        let handles: Vec<_> = (0..3)
            .map(|t| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let k = if t == 0 { 2 } else { 1 };
                    let mut got = Vec::new();
                    if pool.take_into(k, &mut got) {
                        pool.put(&got);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(pool.num_free(), 3);
        assert_eq!(sorted(pool.free_ids()), vec![0, 1, 2]);
    });
}
