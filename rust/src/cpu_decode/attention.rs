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
use super::kv_cache::Planes;
use super::kv_fp8::widen_rows;
use super::lanes::{Lanes, Portable};
#[cfg(target_arch = "x86_64")]
use super::lanes::Avx2;
use super::step::{KvGeometry, StepLayout};
use crate::gemv::{pool, GemvError};

/// What one layer's attention reads.
pub struct LayerAttention<'a> {
    pub planes: Planes<'a>,
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
        match layer.planes {
            Planes::F32 { k, v } => attend_group_on(simd, layer.scale, &k[j * d..], &v[j * d..], q, d, &keys[r], o),
            Planes::Fp8 { k, v, fp8 } => {
                // the unit's keys and values widened into rows of their own (the same values the
                // float32 path would read, so the same bits after), then attended as a dense plane
                let n = keys[r].len();
                WIDENED.with(|w| {
                    let mut w = w.borrow_mut();
                    let (starts, wk, wv, dense) = &mut *w;
                    starts.clear();
                    starts.extend(keys[r].iter().map(|&at| at + j * d));
                    dense.clear();
                    dense.extend((0..n).map(|t| t * d));
                    // grown, never shrunk: a step's units reuse one thread's buffers
                    if wk.len() < n * d {
                        wk.resize(n * d, 0.0);
                        wv.resize(n * d, 0.0);
                    }
                    widen_rows(fp8.format, k, starts, d, fp8.k_scale, wk);
                    widen_rows(fp8.format, v, starts, d, fp8.v_scale, wv);
                    attend_group_on(simd, layer.scale, &wk[..n * d], &wv[..n * d], q, d, dense, o);
                });
            }
        }
    }
}

/// Per thread: an fp8 unit's key starts, its widened keys and values, and their dense offsets.
type Widened = (Vec<usize>, Vec<f32>, Vec<f32>, Vec<usize>);

thread_local! {
    static WIDENED: std::cell::RefCell<Widened> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
}

/// [`attend_group`] in the build `simd`.
#[allow(clippy::too_many_arguments)]
fn attend_group_on(simd: Simd, scale: f32, kp: &[f32], vp: &[f32], q: &[f32], d: usize, keys: &[usize], o: &mut [f32]) {
    match simd {
        Simd::Portable => attend_group::<Portable>(scale, kp, vp, q, d, keys, o),
        // SAFETY: `Simd::Avx2` is only chosen (by `best`) or passed (by tests that take
        // `best`) on a CPU that runs AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { attend_group_avx2(scale, kp, vp, q, d, keys, o) },
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
            let layer = LayerAttention { planes: Planes::F32 { k: &k_plane, v: &v_plane }, heads, scale: 0.35, sliding_window: window };
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
mod fp8_tests {
    use super::*;
    use crate::cpu_decode::kv_cache::Fp8Cache;
    use crate::cpu_decode::kv_fp8::Fp8;
    use crate::cpu_decode::step::StepMeta;

    /// Attention over fp8 planes gives the bits of attention over float32 planes that hold the
    /// codes' widened values (`code * scale`), on both builds and any thread count.
    #[test]
    fn fp8_planes_read_as_their_widened_values() {
        let kv = KvGeometry { layers: 1, num_blocks: 5, block_size: 3, kv_heads: 2, head_dim: 12 };
        let tables = [4, 0, 2, 1, 3, 3];
        let meta = StepMeta { slot_mapping: &[2, 6, 4], query_start_loc: &[0, 2, 3], seq_lens: &[7, 2], block_tables: &tables, table_width: 3 };
        let step = StepLayout::new(meta, 3, &kv).unwrap();
        let k: Vec<u8> = (0..kv.plane()).map(|i| (i * 37 % 251) as u8 & 0xf7).collect(); // no NaN codes
        let v: Vec<u8> = (0..kv.plane()).map(|i| (i * 91 % 241) as u8 & 0xf7).collect();
        for (format, k_scale, v_scale) in [(Fp8::E4m3, 1.0, 1.0), (Fp8::E5m2, 0.01, 0.02), (Fp8::E4m3, 0.3, 0.7)] {
            let wide = |c: &[u8], s: f32| c.iter().map(|&c| format.decode(c) * s).collect::<Vec<f32>>();
            let (kf, vf) = (wide(&k, k_scale), wide(&v, v_scale));
            let heads = 6;
            let width = (heads + 2 * kv.kv_heads) * kv.head_dim;
            let qkv: Vec<f32> = (0..3 * width).map(|i| ((i * 13 % 97) as f32 / 48.0) - 1.0).collect();
            let run = |planes: Planes<'_>, threads: usize, simd: Simd| {
                let layer = LayerAttention { planes, heads, scale: 0.3, sliding_window: Some(4) };
                let mut out = vec![0f32; 3 * heads * kv.head_dim];
                attend(&layer, &qkv, &step, &kv, &mut out, threads, simd).unwrap();
                out
            };
            let want = run(Planes::F32 { k: &kf, v: &vf }, 1, Simd::best());
            assert!(want.iter().all(|x| x.is_finite()));
            let fp8 = Fp8Cache { format, k_scale, v_scale };
            for (threads, simd) in [(1, Simd::best()), (2, Simd::best()), (1, Simd::Portable)] {
                let got = run(Planes::Fp8 { k: &k, v: &v, fp8 }, threads, simd);
                assert_eq!(got, want, "{format:?} threads {threads} {simd:?}");
            }
        }
    }
}
