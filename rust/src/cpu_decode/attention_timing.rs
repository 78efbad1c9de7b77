//! Timings of [`super::attention`], run by hand (`--ignored`): what the numbers in its docs came from.

/// A block table of `blocks` pages in ascending order, and the slot of key `keys - 1` (one row's).
fn ascending(keys: usize, blocks: usize) -> (Vec<i32>, i64) {
    let tables: Vec<i32> = (0..blocks as i32).collect();
    let slot = tables[(keys - 1) / 16] as i64 * 16 + ((keys - 1) % 16) as i64;
    (tables, slot)
}

mod timing {
    use super::super::attention::*;
    use crate::cpu_decode::kv_cache::Planes;
    use crate::cpu_decode::step::{KvGeometry, StepLayout, StepMeta};

    /// `cargo test --release --lib attention_speed -- --ignored --nocapture`: SmolLM2's geometry, 160 keys,
    /// on 1 and 2 threads. 2026-12-05, Intel Xeon: pages in the L2 11.7-12.0 us a layer on 1 thread, 8.3-8.5
    /// on 2; from the L3 19.4-21.0 and 13.6-16.4: the 9 heads split 5 : 4, and both cores read the L3 at
    /// once. Claiming them as 2 chunks of consecutive heads (shared KV pages) instead of one by one was
    /// measured and made no difference. 2026-12-06, the three heads of a KV head in one pass over its keys
    /// (one item a KV head), run back to back with the one-head-a-pass build: in the L2 12.1 -> 8.5 us a
    /// layer on 1 thread, 8.8 -> 7.2 on 2; from the L3 20.9 -> 16.4 and 14.7 -> 12.7 (2 threads split 3
    /// items 2 : 1).
    #[test]
    #[ignore]
    fn attention_speed() {
        let kv = KvGeometry { layers: 1, num_blocks: 16, block_size: 16, kv_heads: 3, head_dim: 64 };
        let k_plane: Vec<f32> = (0..kv.plane()).map(|i| (i as f32 * 0.001).sin()).collect();
        let v_plane = k_plane.clone();
        let tables: Vec<i32> = (0..16).rev().collect();
        let keys = 160usize;
        let slot = tables[(keys - 1) / 16] as i64 * 16 + ((keys - 1) % 16) as i64;
        let seq_lens = [keys as i32];
        let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables, table_width: 16 };
        let step = StepLayout::new(meta, 1, &kv).unwrap();
        let qkv: Vec<f32> = (0..15 * 64).map(|i| (i as f32 * 0.01).cos()).collect();
        let layer = LayerAttention { planes: Planes::F32 { k: &k_plane, v: &v_plane }, heads: 9, scale: 0.125, sliding_window: None };
        let mut out = vec![0f32; 9 * 64];
        for (simd, threads) in [(Simd::best(), 1), (Simd::Portable, 1), (Simd::best(), 2)] {
            let t = std::time::Instant::now();
            for _ in 0..2000 {
                attend(&layer, &qkv, &step, &kv, &mut out, threads, simd).unwrap();
            }
            println!("{simd:?}, {threads} thread(s): {:.1} us per layer", t.elapsed().as_secs_f64() / 2000.0 * 1e6);
        }
        // a step's layers: 30 x 8 planes of their own, cycled, so each layer's pages come from the L3
        let planes: Vec<(Vec<f32>, Vec<f32>)> = (0..240).map(|l| {
            let k: Vec<f32> = (0..kv.plane()).map(|i| ((i + l) as f32 * 0.001).sin()).collect();
            (k.clone(), k)
        }).collect();
        for (simd, threads) in [(Simd::best(), 1), (Simd::Portable, 1), (Simd::best(), 2)] {
            let t = std::time::Instant::now();
            for i in 0..4800 {
                let (k, v) = &planes[i % planes.len()];
                let layer = LayerAttention { planes: Planes::F32 { k, v }, heads: 9, scale: 0.125, sliding_window: None };
                attend(&layer, &qkv, &step, &kv, &mut out, threads, simd).unwrap();
            }
            println!("{simd:?}, {threads} thread(s), pages from the L3: {:.1} us per layer",
                     t.elapsed().as_secs_f64() / 4800.0 * 1e6);
        }
    }
}

mod timing_long {
    use super::super::attention::*;
    use crate::cpu_decode::kv_cache::Planes;
    use crate::cpu_decode::step::{KvGeometry, StepLayout, StepMeta};

    /// `cargo test --release --lib attention_speed_long -- --ignored --nocapture`: SmolLM2's geometry at
    /// batch 1 over long contexts, 16 layers' pages cycled (so they come from the L3), 1 and 2 threads.
    /// 2026-12-05, Intel Xeon: 512 keys 45.2-45.7 us a layer on 1 thread, 30.0-30.8 on 2; 1024 keys
    /// 90.9-91.8 and 58.9-60.5; 2048 keys 186.9-190.0 and 116.7-124.4 (1.5-1.6x: 27 GB/s of K/V at
    /// 2 threads, what the GEMV products reach). Splitting each row's keys into parts of 64 or more
    /// (flash-decoding: (row, head, part) items, the parts met in a fixed order, the same bits on any
    /// thread count) was built and measured: no faster here (2048 keys 115.3-120.8 on 2 threads) and
    /// slower at SmolLM2's 160 keys (8.5 -> 10.7 us a layer in the L2, 14.2 -> 15.8 from the L3: twice
    /// the items, and each part's first keys miss the prefetch), so it is not in. The 5 : 4 split of 9
    /// heads is not what holds 2 threads back: both cores share the L3's bandwidth. 2026-12-06, a KV head's
    /// query heads in one pass (before -> after, back to back): 512 keys 45.2 -> 32.6 us on 1 thread, 28.9
    /// -> 24.4 on 2; 1024 keys 91.2 -> 65.9 and 58.5 -> 50.5; 2048 keys 189.4 -> 137.1 and 117.3 -> 102.2.
    #[test]
    #[ignore]
    fn attention_speed_long() {
        for keys in [512usize, 1024, 2048] {
            let blocks = keys / 16;
            let kv = KvGeometry { layers: 1, num_blocks: blocks, block_size: 16, kv_heads: 3, head_dim: 64 };
            let tables: Vec<i32> = (0..blocks as i32).rev().collect();
            let slot = tables[(keys - 1) / 16] as i64 * 16 + ((keys - 1) % 16) as i64;
            let seq_lens = [keys as i32];
            let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens,
                                  block_tables: &tables, table_width: blocks };
            let step = StepLayout::new(meta, 1, &kv).unwrap();
            let qkv: Vec<f32> = (0..15 * 64).map(|i| (i as f32 * 0.01).cos()).collect();
            let planes: Vec<Vec<f32>> = (0..16).map(|l| (0..kv.plane()).map(|i| ((i + l) as f32 * 0.001).sin()).collect())
                .collect();
            let mut out = vec![0f32; 9 * 64];
            for threads in [1, 2] {
                let t = std::time::Instant::now();
                let n = 800;
                for i in 0..n {
                    let p = &planes[i % planes.len()];
                    let layer = LayerAttention { planes: Planes::F32 { k: p, v: p }, heads: 9, scale: 0.125, sliding_window: None };
                    attend(&layer, &qkv, &step, &kv, &mut out, threads, Simd::best()).unwrap();
                }
                println!("{keys} keys, {threads} thread(s): {:.1} us per layer", t.elapsed().as_secs_f64() / n as f64 * 1e6);
            }
        }
    }
}


mod hot {
    use super::super::attention::*;
    use crate::cpu_decode::kv_cache::Planes;
    use crate::cpu_decode::step::{KvGeometry, StepLayout, StepMeta};

    /// `cargo test --release --lib attention_hot -- --ignored --nocapture`: one row over 1024 keys
    /// whose pages stay in the caches (one layer's, ascending), 1 thread: the loops' own cost.
    /// 2026-12-06, AMD EPYC Zen 3: 79-83 us a layer (about 250 cycles a key for 9 heads of 64, where
    /// their 144 vector FMAs a key take 72 at two a cycle): in the engine at 1,000 keys a layer's
    /// attention takes ~190 us, so about half of it is waiting for the pages.
    #[test]
    #[ignore]
    fn attention_hot() {
        let keys = 1024usize;
        let blocks = keys / 16;
        let kv = KvGeometry { layers: 1, num_blocks: blocks, block_size: 16, kv_heads: 3, head_dim: 64 };
        let (tables, slot) = super::ascending(keys, blocks);
        let seq_lens = [keys as i32];
        let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables,
                              table_width: blocks };
        let step = StepLayout::new(meta, 1, &kv).unwrap();
        let qkv: Vec<f32> = (0..15 * 64).map(|i| (i as f32 * 0.01).cos()).collect();
        let k: Vec<f32> = (0..kv.plane()).map(|i| ((i * 37) % 1001) as f32 * 0.001 - 0.5).collect();
        let v: Vec<f32> = (0..kv.plane()).map(|i| ((i * 91) % 997) as f32 * 0.001 - 0.5).collect();
        let layer = LayerAttention { planes: Planes::F32 { k: &k, v: &v }, heads: 9, scale: 0.125, sliding_window: None };
        let mut out = vec![0f32; 9 * 64];
        let mut times = Vec::new();
        for _ in 0..9 {
            let t = std::time::Instant::now();
            for _ in 0..200 {
                attend(&layer, &qkv, &step, &kv, &mut out, 1, Simd::best()).unwrap();
            }
            times.push(t.elapsed().as_secs_f64() / 200.0 * 1e6);
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("1024 keys in the caches, 1 thread: median {:.1} us a layer (min {:.1}); checksum {}", times[4], times[0],
                 out.iter().sum::<f32>());
    }
}

mod cold {
    use super::super::attention::*;
    use crate::cpu_decode::kv_cache::Planes;
    use crate::cpu_decode::step::{KvGeometry, StepLayout, StepMeta};

    /// Sum of `plane`'s floats at `starts[i] .. starts[i] + len`, 16 lanes (a read the loads bound).
    fn read(plane: &[f32], starts: impl Iterator<Item = usize>, len: usize, acc: &mut [f32; 16]) {
        for s in starts {
            for c in plane[s..s + len].chunks_exact(16) {
                for i in 0..16 {
                    acc[i] += c[i];
                }
            }
        }
    }

    /// `cargo test --release --lib attention_cold -- --ignored --nocapture`: one row over 1000 keys
    /// (SmolLM2's 3 KV heads of 64, 9 query heads; then one KV head for the 9) in each of 30
    /// layers' own pages (past the L3), ascending, a 3 MB weights-like read between layers (as a
    /// step's products do), on 1 and 2 threads; beside it, the same K/V bytes only read: in order,
    /// and in attention's order (each KV head's 256 bytes of every key for the scores, then each
    /// 128-byte half of its values).
    /// 2026-12-06, fifth session, AMD EPYC Zen 3 (noisy; medians of 9): attention on 1 thread
    /// 220-330 us a layer (75-85 with the pages in the caches, `attention_hot`); read in order 71-106;
    /// read in attention's order 126-190, and slower still with software prefetch ahead of it (8, 32,
    /// 96 keys: 149-224). Runs of 16-256 keys with all of a key's KV heads at once (the rows read in
    /// order) and the loops' own prefetch off were measured too: 245-295, inside the noise of the
    /// build in use. On 2 threads, items of one KV head (before `attention_split`): 146-153 us with 3
    /// KV heads (2 : 1), 123-125 with one (one thread did it all); split in two phases: 137-146 and
    /// 60-87 (3 KV heads on 2 threads are no longer split: with the pages in the caches the split
    /// lost, see `attention_split`).
    #[test]
    #[ignore]
    fn attention_cold() {
        for kv_heads in [3usize, 1] {
            cold(kv_heads);
        }
    }

    fn cold(kv_heads: usize) {
        let (keys, blocks, layers) = (1000usize, 256usize, 30usize);
        let kv = KvGeometry { layers: 1, num_blocks: blocks, block_size: 16, kv_heads, head_dim: 64 };
        let (tables, slot) = super::ascending(keys, blocks);
        let seq_lens = [keys as i32];
        let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables,
                              table_width: blocks };
        let step = StepLayout::new(meta, 1, &kv).unwrap();
        let qkv: Vec<f32> = (0..(9 + 2 * kv_heads) * 64).map(|i| (i as f32 * 0.01).cos()).collect();
        let planes: Vec<(Vec<f32>, Vec<f32>)> = (0..layers).map(|l| {
            let k: Vec<f32> = (0..kv.plane()).map(|i| (((i + l) * 37) % 1001) as f32 * 0.001 - 0.5).collect();
            let v: Vec<f32> = (0..kv.plane()).map(|i| (((i + l) * 91) % 997) as f32 * 0.001 - 0.5).collect();
            (k, v)
        }).collect();
        let weights: Vec<u64> = (0..3 * 1024 * 1024 / 8).map(|i| i as u64 * 7).collect();
        let row = kv_heads * 64;
        for what in ["attention, 1 thread", "attention, 2 threads", "read in order", "read in attention's order"] {
            let (mut out, mut acc, mut sink) = (vec![0f32; 9 * 64], [0f32; 16], 0u64);
            let mut times = Vec::new();
            for _ in 0..9 {
                let mut spent = 0f64;
                for _ in 0..10 {
                    for (k, v) in &planes {
                        sink = sink.wrapping_add(weights.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
                        let t = std::time::Instant::now();
                        match what {
                            "attention, 1 thread" | "attention, 2 threads" => {
                                let layer = LayerAttention { planes: Planes::F32 { k, v }, heads: 9, scale: 0.125,
                                                             sliding_window: None };
                                let threads = if what.ends_with("1 thread") { 1 } else { 2 };
                                attend(&layer, &qkv, &step, &kv, &mut out, threads, Simd::best()).unwrap();
                            }
                            "read in order" => {
                                read(k, std::iter::once(0), keys * row, &mut acc);
                                read(v, std::iter::once(0), keys * row, &mut acc);
                            }
                            _ => {
                                for j in 0..kv_heads {
                                    read(k, (0..keys).map(|t| t * row + j * 64), 64, &mut acc);
                                }
                                for h in 0..2 * kv_heads {
                                    read(v, (0..keys).map(|t| t * row + h * 32), 32, &mut acc);
                                }
                            }
                        }
                        spent += t.elapsed().as_secs_f64();
                    }
                }
                times.push(spent / (10 * layers) as f64 * 1e6);
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!("{kv_heads} KV heads, {what}: median {:.1} us a layer (min {:.1}); checksum {} {sink}", times[4], times[0],
                     out.iter().sum::<f32>() + acc.iter().sum::<f32>());
        }
    }
}
