//! Paged attention of each row over the keys it sees, read from the pages in place.
//!
//! Per (row, query head): scores `q . k * scale` over the row's visible positions in order,
//! softmax with the maximum subtracted, then `sum(p * v) / sum(p)`. One work item is one
//! (row, KV head): the query heads that read that KV head, up to three at a time in one pass
//! over its keys (a key's row loaded once for them all; each head's values are the bits it
//! has alone). Items are independent, so the GEMV team shares them out and the bits do not
//! depend on how (each item writes only its own heads' outputs).

use std::sync::Mutex;

use super::error::DecodeError;
use super::lanes::{Lanes, Portable};
#[cfg(target_arch = "x86_64")]
use super::lanes::Avx2;
use super::step::{KvGeometry, StepLayout};
use crate::gemv::{pool, GemvError};

/// What one layer's attention reads.
pub struct LayerAttention<'a> {
    pub k_plane: &'a [f32],
    pub v_plane: &'a [f32],
    pub heads: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
}

/// Which build of the loops runs ([`super::lanes`]): both follow one float order, so both give
/// the same bits; AVX2 (with FMA) only runs more of them side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Simd {
    /// The widest this CPU runs (detected at run time).
    pub fn best() -> Simd {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Simd::Avx2;
        }
        Simd::Portable
    }
}

/// `out[r, h*d .. (h+1)*d]` for every row `r` and query head `h`; `qkv` is the rotated fused
/// output `[T, (heads + 2 kv_heads) * d]` (queries first). GQA: head `h` reads KV head
/// `h / (heads / kv_heads)`. `simd`: the build of the loops (`Simd::best()`; tests compare them).
pub fn attend(
    layer: &LayerAttention<'_>,
    qkv: &[f32],
    step: &StepLayout<'_>,
    kv: &KvGeometry,
    out: &mut [f32],
    threads: usize,
    simd: Simd,
) -> Result<(), DecodeError> {
    let keys = row_keys(layer.sliding_window, step, kv);
    let per_item = units_per_item(step.rows.len(), kv.kv_heads, threads);
    let size = per_item * layer.heads / kv.kv_heads * kv.head_dim;
    let items = step.rows.len() * kv.kv_heads / per_item;
    if threads == 1 || items == 1 {
        for (i, o) in out.chunks_exact_mut(size).enumerate() {
            attend_item(layer, &keys, qkv, kv, i, per_item, o, simd);
        }
        return Ok(());
    }
    // each item owns its heads' outputs; the lock is never contended (one item, one claim)
    let outs: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(size).map(Mutex::new).collect();
    let team = pool::team(threads)?;
    team.run(items, &|i: usize| {
        let mut o = outs[i].lock().unwrap_or_else(|e| e.into_inner());
        attend_item(layer, &keys, qkv, kv, i, per_item, &mut o, simd);
    })
    .map_err(|e| match e {
        GemvError::Threads { reason } => DecodeError::Gemv(GemvError::Threads { reason: format!("attention: {reason}") }),
        e => DecodeError::Gemv(e),
    })
}

/// How many (row, KV head) units make one work item of a layer's attention on `threads` threads:
/// a whole row (all its KV heads) when there are at least two rows a thread, else one. Why: a
/// page holds every KV head of a slot side by side, so items of one KV head each had a thread
/// stream the row's pages for a third of their bytes, and at batch 32 on 2 threads both threads
/// pulled the same pages; a row's KV heads one after another on one thread read them once. At
/// batch 1 the 3 KV heads of SmolLM2 stay 3 items, so 2 threads share them.
pub fn units_per_item(rows: usize, kv_heads: usize, threads: usize) -> usize {
    if rows >= 2 * threads { kv_heads } else { 1 }
}

/// Item `i` of a layer's attention: units `i * per_item ..` of `per_item` (unit `u` is row
/// `u / kv_heads` and KV head `u % kv_heads`, whose `heads / kv_heads` query heads' outputs lie
/// side by side in the output, head `h` at `h * d`), written into `o` (the units' outputs, in
/// order). `keys` is [`row_keys`] of the layer's window; `qkv` the rotated fused output
/// `[T, (heads + 2 kv_heads) * d]` (queries first).
#[allow(clippy::too_many_arguments)]
pub fn attend_item(layer: &LayerAttention<'_>, keys: &[Vec<usize>], qkv: &[f32], kv: &KvGeometry, i: usize,
                   per_item: usize, o: &mut [f32], simd: Simd) {
    let d = kv.head_dim;
    let width = (layer.heads + 2 * kv.kv_heads) * d;
    let group = layer.heads / kv.kv_heads;
    for (u, o) in (i * per_item..(i + 1) * per_item).zip(o.chunks_exact_mut(group * d)) {
        let (r, j) = (u / kv.kv_heads, u % kv.kv_heads);
        let q = &qkv[r * width + j * group * d..][..group * d];
        let (kp, vp) = (&layer.k_plane[j * d..], &layer.v_plane[j * d..]);
        match simd {
            Simd::Portable => attend_group::<Portable>(layer.scale, kp, vp, q, d, &keys[r], o),
            // SAFETY: `Simd::Avx2` is only chosen (by `best`) or passed (by tests that take
            // `best`) on a CPU that runs AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { attend_group_avx2(layer.scale, kp, vp, q, d, &keys[r], o) },
        }
    }
}

/// Where each key row `r` sees starts in the K/V plane for KV head 0, in position order, under
/// a layer's sliding `window` (the page is looked up once per page; keys of a page are
/// `kv_heads * head_dim` floats apart, and the planes sliced at `kv_head * d` make them that head's).
pub fn row_keys(window: Option<usize>, step: &StepLayout<'_>, kv: &KvGeometry) -> Vec<Vec<usize>> {
    let stride = kv.kv_heads * kv.head_dim;
    (0..step.rows.len()).map(|r| key_offsets(window, step, kv, r, stride)).collect()
}

fn key_offsets(window: Option<usize>, step: &StepLayout<'_>, kv: &KvGeometry, r: usize, stride: usize) -> Vec<usize> {
    let row = step.rows[r];
    let bs = kv.block_size;
    let lo = window.map_or(0, |w| row.keys.saturating_sub(w));
    let mut keys = Vec::with_capacity(row.keys - lo);
    let mut p = lo;
    while p < row.keys {
        let end = ((p / bs + 1) * bs).min(row.keys);
        let start = kv.slot_offset(step.block(row.seq, p, bs) * bs + p % bs, 0);
        for j in 0..end - p {
            keys.push(start + j * stride);
        }
        p = end;
    }
    keys
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_group_avx2(scale: f32, kp: &[f32], vp: &[f32], q: &[f32], d: usize, keys: &[usize], out: &mut [f32]) {
    attend_group::<Avx2>(scale, kp, vp, q, d, keys, out)
}

/// The query heads in `q` (`[heads, d]`, all reading one KV head) over `keys`, into `out`
/// (`[heads, d]`): up to three heads at a time share each pass over the keys (three heads'
/// accumulators fill AVX2's 16 registers; SmolLM2 has 3 heads a KV head, Llama 3 and Mistral 4).
#[inline(always)]
fn attend_group<L: Lanes>(scale: f32, kp: &[f32], vp: &[f32], q: &[f32], d: usize, keys: &[usize], out: &mut [f32]) {
    let heads = q.len() / d;
    let mut scores = vec![0f32; heads.min(3) * keys.len()];
    let mut h = 0;
    while h < heads {
        let (q, out) = (&q[h * d..], &mut out[h * d..]);
        h += match heads - h {
            1 => attend_heads::<L, 1>(scale, kp, vp, &q[..d], keys, &mut out[..d], &mut scores),
            2 => attend_heads::<L, 2>(scale, kp, vp, &q[..2 * d], keys, &mut out[..2 * d], &mut scores),
            _ => attend_heads::<L, 3>(scale, kp, vp, &q[..3 * d], keys, &mut out[..3 * d], &mut scores),
        };
    }
}

/// `G` heads: scores, softmax (each head's maximum subtracted), `sum(p * v) / sum(p)`, keys in
/// position order, each head in [`Lanes`]'s fixed order (the bits of one head alone). Returns `G`.
#[inline(always)]
fn attend_heads<L: Lanes, const G: usize>(scale: f32, kp: &[f32], vp: &[f32], q: &[f32], keys: &[usize], out: &mut [f32],
                                           scores: &mut [f32]) -> usize {
    let (n, d) = (keys.len(), q.len() / G);
    let scores = &mut scores[..G * n];
    L::scores_group::<G>(q, d, kp, keys, scale, scores);
    let mut sums = [0f32; G];
    for (s, sum) in scores.chunks_exact_mut(n).zip(&mut sums) {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        *sum = L::softmax_weights(s, max);
    }
    L::weighted_sum_group::<G>(scores, vp, keys, out);
    for (o, sum) in out.chunks_exact_mut(d).zip(sums) {
        for x in o {
            *x /= sum;
        }
    }
    G
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_decode::step::StepMeta;

    /// float64 softmax attention of one query over explicit keys and values.
    fn reference(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], scale: f64) -> Vec<f64> {
        let s: Vec<f64> = keys.iter().map(|k| q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale).collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = p.iter().sum();
        (0..q.len()).map(|j| p.iter().zip(values).map(|(w, v)| w * v[j] as f64).sum::<f64>() / z).collect()
    }

    #[test]
    fn matches_float64_over_scattered_pages_with_gqa_windows_and_threads() {
        let kv = KvGeometry { layers: 1, num_blocks: 5, block_size: 3, kv_heads: 2, head_dim: 8 };
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        let k_plane: Vec<f32> = (0..kv.plane()).map(val).collect();
        let v_plane: Vec<f32> = (0..kv.plane()).map(|i| val(i + 17)).collect();
        // seq 0: 7 keys on blocks [4, 0, 2], its last 2 rows new; seq 1: 2 keys on block [1], decode
        let tables = [4, 0, 2, 1, 3, 3];
        let meta = StepMeta { slot_mapping: &[2, 6, 4], query_start_loc: &[0, 2, 3], seq_lens: &[7, 2], block_tables: &tables, table_width: 3 };
        let step = StepLayout::new(meta, 3, &kv).unwrap();
        // 2, 4 and 7 query heads a KV head: one pass of 2, of 3 + 1, of 3 + 3 + 1
        for (heads, window) in [(4, None), (4, Some(2)), (8, None), (14, Some(5))] {
            let width = (heads + 2 * kv.kv_heads) * kv.head_dim;
            let qkv: Vec<f32> = (0..3 * width).map(|i| val(i + 3)).collect();
            let layer = LayerAttention { k_plane: &k_plane, v_plane: &v_plane, heads, scale: 0.35, sliding_window: window };
            let mut one = vec![0f32; 3 * heads * 8];
            attend(&layer, &qkv, &step, &kv, &mut one, 1, Simd::best()).unwrap();
            let mut two = vec![0f32; 3 * heads * 8];
            attend(&layer, &qkv, &step, &kv, &mut two, 2, Simd::best()).unwrap();
            assert_eq!(one, two, "threads change no bit");
            let mut portable = vec![0f32; 3 * heads * 8];
            attend(&layer, &qkv, &step, &kv, &mut portable, 1, Simd::Portable).unwrap();
            assert_eq!(one, portable, "the SIMD build changes no bit");
            for (r, row) in step.rows.iter().enumerate() {
                for h in 0..heads {
                    let kvh = h / (heads / kv.kv_heads);
                    let lo = window.map_or(0, |w| row.keys.saturating_sub(w));
                    let at = |plane: &[f32], p: usize| {
                        let slot = tables[row.seq * 3 + p / 3] as usize * 3 + p % 3;
                        plane[kv.slot_offset(slot, kvh)..][..8].to_vec()
                    };
                    let keys: Vec<_> = (lo..row.keys).map(|p| at(&k_plane, p)).collect();
                    let values: Vec<_> = (lo..row.keys).map(|p| at(&v_plane, p)).collect();
                    let want = reference(&qkv[r * width + h * 8..][..8], &keys, &values, 0.35);
                    for (j, w) in want.iter().enumerate() {
                        let got = one[(r * heads + h) * 8 + j] as f64;
                        assert!((got - w).abs() < 1e-5, "{heads} heads: row {r} head {h} {j}: {got} vs {w}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use crate::cpu_decode::step::StepMeta;

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
        let layer = LayerAttention { k_plane: &k_plane, v_plane: &v_plane, heads: 9, scale: 0.125, sliding_window: None };
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
                let layer = LayerAttention { k_plane: k, v_plane: v, heads: 9, scale: 0.125, sliding_window: None };
                attend(&layer, &qkv, &step, &kv, &mut out, threads, simd).unwrap();
            }
            println!("{simd:?}, {threads} thread(s), pages from the L3: {:.1} us per layer",
                     t.elapsed().as_secs_f64() / 4800.0 * 1e6);
        }
    }
}

#[cfg(test)]
mod timing_long {
    use super::*;
    use crate::cpu_decode::step::StepMeta;

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
                    let layer = LayerAttention { k_plane: p, v_plane: p, heads: 9, scale: 0.125, sliding_window: None };
                    attend(&layer, &qkv, &step, &kv, &mut out, threads, Simd::best()).unwrap();
                }
                println!("{keys} keys, {threads} thread(s): {:.1} us per layer", t.elapsed().as_secs_f64() / n as f64 * 1e6);
            }
        }
    }
}

