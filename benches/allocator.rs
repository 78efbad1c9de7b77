//! Criterion benches of the core allocator. Machine: see the README table (2-core box).
//! Run: `cargo bench --bench allocator -- --noplot`.

use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pagedrs::block_manager::{BlockManager, BlockManagerConfig};
use pagedrs::page_pool::PagePool;

fn take_return(c: &mut Criterion) {
    let pool = PagePool::new(4096);
    let mut out = Vec::with_capacity(64);
    c.bench_function("pool/take+return 1", |b| {
        b.iter(|| {
            let id = pool.take().unwrap();
            pool.put(&[black_box(id)]);
        })
    });
    for k in [16usize, 64] {
        c.bench_function(&format!("pool/take+return batch {k}"), |b| {
            b.iter(|| {
                out.clear();
                assert!(pool.take_into(k, &mut out));
                pool.put(black_box(&out));
            })
        });
    }
}

/// Two threads, started on a Barrier, each doing `iters` take+return of 16 blocks.
fn contended<F: Fn() + Send + Sync + 'static>(iters: u64, op: Arc<F>) -> Duration {
    let barrier = Arc::new(Barrier::new(3));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (barrier, op) = (barrier.clone(), op.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..iters {
                    op();
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    threads.into_iter().for_each(|t| t.join().unwrap());
    start.elapsed()
}

fn contention(c: &mut Criterion) {
    let mut group = c.benchmark_group("2-thread take+return 16");
    let pool = Arc::new(PagePool::new(4096));
    group.bench_function("lock-free PagePool", |b| {
        let pool = pool.clone();
        b.iter_custom(move |iters| {
            let pool = pool.clone();
            contended(iters, Arc::new(move || {
                let mut out = Vec::with_capacity(16);
                assert!(pool.take_into(16, &mut out));
                pool.put(&out);
            }))
        })
    });
    let locked = Arc::new(Mutex::new((0..4096u32).collect::<Vec<_>>()));
    group.bench_function("Mutex<Vec> baseline", |b| {
        let locked = locked.clone();
        b.iter_custom(move |iters| {
            let locked = locked.clone();
            contended(iters, Arc::new(move || {
                let got: Vec<u32> = {
                    let mut free = locked.lock().unwrap();
                    let at = free.len() - 16;
                    free.split_off(at)
                };
                locked.lock().unwrap().extend_from_slice(black_box(&got));
            }))
        })
    });
    group.finish();
}

fn prefix_hit(c: &mut Criterion) {
    let mut bm = BlockManager::new(BlockManagerConfig::new(1024, 16)).unwrap();
    let prompt: Vec<u32> = (0..257).collect();
    bm.allocate(0, &prompt).unwrap();
    bm.commit(0, prompt.len()).unwrap();
    bm.free(0).unwrap();
    c.bench_function("prefix/hit 16 blocks allocate+free", |b| {
        b.iter(|| {
            assert_eq!(bm.allocate(1, black_box(&prompt)).unwrap(), 256);
            bm.free(1).unwrap();
        })
    });
    c.bench_function("prefix/lookup 16 blocks (num_blocks_to_allocate)", |b| {
        b.iter(|| black_box(bm.num_blocks_to_allocate(black_box(&prompt))))
    });
}

fn fork_cow(c: &mut Criterion) {
    let mut bm = BlockManager::new(BlockManagerConfig::new(1024, 16)).unwrap();
    let prompt: Vec<u32> = (0..250).collect();
    bm.allocate(0, &prompt).unwrap();
    c.bench_function("fork + COW append + free", |b| {
        b.iter(|| {
            bm.fork(0, 1).unwrap();
            let copies = bm.append_tokens(1, &[7]).unwrap();
            assert_eq!(copies.len(), 1);
            bm.free(1).unwrap();
        })
    });
}

criterion_group!(benches, take_return, contention, prefix_hit, fork_cow);
criterion_main!(benches);
