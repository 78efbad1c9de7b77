//! Paged attention of each row over the keys it sees, read from the pages in place.
//!
//! Per (row, query head): scores `q . k * scale` over the row's visible positions in order,
//! softmax with the maximum subtracted, then `sum(p * v) / sum(p)`. One work item is one
//! (row, KV head): the query heads that read that KV head, up to three at a time in one pass
//! over its keys (a key's row loaded once for them all; each head's values are the bits it
//! has alone). Items are independent, so the GEMV team shares them out and the bits do not
//! depend on how (each item writes only its own heads' outputs).

use std::sync::Mutex;

use super::attention_split::{attend_on_team, KeySplit};
use super::error::DecodeError;
use super::kv_cache::Planes;
use super::kv_rows::{each_run, Rows};
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
    let n = keys.first().map_or(0, Vec::len);
    if let Some(split) = KeySplit::plan(step.rows.len(), layer.heads, kv.kv_heads, kv.head_dim, n, threads) {
        // one row on threads its KV heads do not share out evenly (`attention_split`)
        let team = pool::team(threads)?;
        return attend_on_team(&split, &team, &qkv[..layer.heads * kv.head_dim], layer.planes, &keys[0], layer.scale, out,
                              simd)
            .map_err(|e| threads_error(e, "attention"));
    }
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
    .map_err(|e| threads_error(e, "attention"))
}

/// A team's failure as the step's error, naming the part that failed.
fn threads_error(e: GemvError, part: &str) -> DecodeError {
    match e {
        GemvError::Threads { reason } => DecodeError::Gemv(GemvError::Threads { reason: format!("{part}: {reason}") }),
        e => DecodeError::Gemv(e),
    }
}

/// How many (row, KV head) units make one work item of a layer's attention on `threads` threads:
/// a whole row (all its KV heads) on one thread or when there are at least two rows a thread,
/// else one. Why: a page holds every KV head of a slot side by side, so items of one KV head each
/// had a thread stream the row's pages for a third of their bytes, and at batch 32 on 2 threads
/// both threads pulled the same pages; a row's KV heads one after another on one thread read them
/// once, and with an fp8 cache each run of keys is widened once for all of them (by one KV head at a
/// time, SmolLM2 at 1,000 keys took 0.68-0.95 s of attention for 96 tokens against 0.50-0.63 whole).
/// At batch 1 on 2 threads the 3 KV heads of SmolLM2 stay 3 items, so both threads share them.
pub fn units_per_item(rows: usize, kv_heads: usize, threads: usize) -> usize {
    if threads == 1 || rows >= 2 * threads { kv_heads } else { 1 }
}

/// Item `i` of a layer's attention: units `i * per_item ..` of `per_item` (unit `u` is row
/// `u / kv_heads` and KV head `u % kv_heads`, whose `heads / kv_heads` query heads' outputs lie
/// side by side in the output, head `h` at `h * d`), written into `o` (the units' outputs, in
/// order). `keys` is [`row_keys`] of the layer's window; `qkv` the rotated fused output
/// `[T, (heads + 2 kv_heads) * d]` (queries first). A row's consecutive units run as one
/// [`attend_units`] (with an fp8 cache, each run of keys is widened once for all of them).
#[allow(clippy::too_many_arguments)]
pub fn attend_item(layer: &LayerAttention<'_>, keys: &[Vec<usize>], qkv: &[f32], kv: &KvGeometry, i: usize,
                   per_item: usize, o: &mut [f32], simd: Simd) {
    let d = kv.head_dim;
    let width = (layer.heads + 2 * kv.kv_heads) * d;
    let group = layer.heads / kv.kv_heads;
    let (mut u, end) = (i * per_item, (i + 1) * per_item);
    let mut o = o;
    while u < end {
        let (r, j0) = (u / kv.kv_heads, u % kv.kv_heads);
        let nj = (end - u).min(kv.kv_heads - j0);
        let (mine, rest) = std::mem::take(&mut o).split_at_mut(nj * group * d);
        let q = &qkv[r * width + j0 * group * d..][..nj * group * d];
        let shape = Units { kv_heads: nj, group, d, scale: layer.scale };
        let (k, v) = Rows::of(layer.planes, j0 * d);
        attend_units_on(simd, &shape, k, v, q, &keys[r], mine);
        o = rest;
        u += nj;
    }
}

/// The heads [`attend_units`] computes: `kv_heads` consecutive KV heads of one row (KV head `j`'s
/// keys at `d * j` past each key start), `group` query heads each.
struct Units {
    kv_heads: usize,
    group: usize,
    d: usize,
    scale: f32,
}

/// [`attend_units`] in the build `simd`.
fn attend_units_on(simd: Simd, u: &Units, k: Rows<'_>, v: Rows<'_>, q: &[f32], keys: &[usize], o: &mut [f32]) {
    match simd {
        Simd::Portable => attend_units::<Portable>(u, k, v, q, keys, o),
        // SAFETY: `Simd::Avx2` is only chosen (by `best`) or passed (by tests that take
        // `best`) on a CPU that runs AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { attend_units_avx2(u, k, v, q, keys, o) },
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
unsafe fn attend_units_avx2(u: &Units, k: Rows<'_>, v: Rows<'_>, q: &[f32], keys: &[usize], o: &mut [f32]) {
    attend_units::<Avx2>(u, k, v, q, keys, o)
}

/// The `kv_heads * group` query heads of `q` (`[heads, d]`; query head `j * group + g` reads KV
/// head `j`) over `keys`, into `o` (`[heads, d]`): scores, softmax (each head's maximum
/// subtracted), `sum(p * v) / sum(p)`, keys in position order, each head in [`Lanes`]'s fixed
/// order (the bits of one head alone, whichever heads share its pass and however the keys are cut
/// into runs: a score is one key's alone and a weighted sum's chain goes on across runs). Up to
/// three query heads of a KV head share each loaded key (three heads' accumulators fill AVX2's 16
/// registers; SmolLM2 has 3 a KV head, Llama 3 and Mistral 4).
#[inline(always)]
fn attend_units<L: Lanes>(u: &Units, k: Rows<'_>, v: Rows<'_>, q: &[f32], keys: &[usize], o: &mut [f32]) {
    let (n, d, group) = (keys.len(), u.d, u.group);
    let heads = u.kv_heads * group;
    let width = u.kv_heads * d;
    SCRATCH.with(|cell| {
        let mut cell = cell.borrow_mut();
        let Scratch { scores, sums } = &mut *cell;
        // grown, never shrunk (one set a thread)
        if scores.len() < heads * n {
            scores.resize(heads * n, 0.0);
        }
        sums.resize(heads, 0.0);
        let scores = &mut scores[..heads * n];
        // a run's rows hold every KV head of the item (an fp8 run widened once for them all)
        each_run(k, keys, width, |kp, run, t0| {
            for j in 0..u.kv_heads {
                let q = &q[j * group * d..(j + 1) * group * d];
                scores_heads::<L>(q, d, &kp[j * d..], run, u.scale, &mut scores[j * group * n + t0..], n);
            }
        });
        softmax_rows::<L>(scores, n, sums);
        each_run(v, keys, width, |vp, run, t0| {
            for j in 0..u.kv_heads {
                let out = &mut o[j * group * d..(j + 1) * group * d];
                weighted_sums_heads::<L>(&scores[j * group * n + t0..], n, &vp[j * d..], run, out, group, t0 > 0);
            }
        });
        if n == 0 {
            o[..heads * d].fill(0.0);
        }
        divide_rows(&mut o[..heads * d], d, sums);
    });
}

/// Scores of the query heads `q` (`[heads, d]`, every one reading the KV head whose keys `run`
/// starts in `plane`) against the run's keys: head `h`'s at `out[h * stride ..]`, passes of up to
/// three heads ([`each_group`]).
#[inline(always)]
pub(super) fn scores_heads<L: Lanes>(q: &[f32], d: usize, plane: &[f32], run: &[usize], scale: f32, out: &mut [f32],
                                     stride: usize) {
    each_group(q.len() / d, |h, g| {
        let (q, out) = (&q[h * d..], &mut out[h * stride..]);
        match g {
            1 => L::scores_group::<1>(&q[..d], d, plane, run, scale, out, stride),
            2 => L::scores_group::<2>(&q[..2 * d], d, plane, run, scale, out, stride),
            _ => L::scores_group::<3>(&q[..3 * d], d, plane, run, scale, out, stride),
        }
    });
}

/// Weighted sums of `heads` heads whose weights lie at `p[h * stride ..]` over the run's values
/// (`plane`), into `out` (`[heads, columns]`): from 0, or going on with `accumulate`; passes of up
/// to three heads ([`each_group`]).
#[inline(always)]
pub(super) fn weighted_sums_heads<L: Lanes>(p: &[f32], stride: usize, plane: &[f32], run: &[usize], out: &mut [f32],
                                            heads: usize, accumulate: bool) {
    let cols = out.len() / heads;
    each_group(heads, |h, g| {
        let (p, out) = (&p[h * stride..], &mut out[h * cols..(h + g) * cols]);
        match g {
            1 => L::weighted_sum_group::<1>(p, stride, plane, run, out, accumulate),
            2 => L::weighted_sum_group::<2>(p, stride, plane, run, out, accumulate),
            _ => L::weighted_sum_group::<3>(p, stride, plane, run, out, accumulate),
        }
    });
}

/// Each head's softmax weights in place (`scores` holds `n` of each, its maximum subtracted) and
/// their sums into `sums` (one a head).
#[inline(always)]
pub(super) fn softmax_rows<L: Lanes>(scores: &mut [f32], n: usize, sums: &mut [f32]) {
    for (s, sum) in scores.chunks_exact_mut(n.max(1)).zip(sums.iter_mut()) {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        *sum = L::softmax_weights(s, max);
    }
}

/// Each head's outputs (`cols` of them in `out`) divided by its sum.
#[inline(always)]
pub(super) fn divide_rows(out: &mut [f32], cols: usize, sums: &[f32]) {
    for (out, &sum) in out.chunks_exact_mut(cols).zip(sums) {
        for x in out {
            *x /= sum;
        }
    }
}

/// Calls `f(first, count)` for a KV head's `group` query heads in passes of up to three (each
/// head's bits are its own whichever heads share its pass; `attention_split` passes the same way).
#[inline(always)]
pub(super) fn each_group(group: usize, mut f: impl FnMut(usize, usize)) {
    let mut h = 0;
    while h < group {
        let g = (group - h).min(3);
        f(h, g);
        h += g;
    }
}

/// Per thread: the scores (then softmax weights) of the heads [`attend_units`] runs and their
/// sums.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    sums: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
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
    use crate::cpu_decode::kv_bf16;
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

    /// Rows over more keys than an fp8 (or bfloat16) run (`kv_rows::RUN`, 16 keys), with the last run partial and
    /// windows that start mid-run: each run's widened rows carry the weighted sums' chains on (the
    /// bits of the float32 planes of the widened values), on both builds, 1 and 2 threads, and
    /// batches that give whole-row items and one-KV-head items.
    #[test]
    fn fp8_runs_carry_each_chain_across_runs() {
        let kv = KvGeometry { layers: 1, num_blocks: 12, block_size: 16, kv_heads: 3, head_dim: 20 };
        // 4 rows: 61 keys (4 runs, the last of 13), 33 over blocks out of order, 17, 1
        let tables = [5, 9, 2, 11, 0, 7, 3, 1, 8, 6, 4, 10, 10, 10, 10, 10];
        let lens = [61i32, 33, 17, 1];
        let slot = |seq: usize, p: usize| (tables[seq * 4 + p / 16] as i64) * 16 + (p % 16) as i64;
        let slots: Vec<i64> = lens.iter().enumerate().map(|(s, &l)| slot(s, l as usize - 1)).collect();
        let k: Vec<u8> = (0..kv.plane()).map(|i| (i * 53 % 247) as u8 & 0xf7).collect();
        let v: Vec<u8> = (0..kv.plane()).map(|i| (i * 29 % 239) as u8 & 0xf7).collect();
        let (format, k_scale, v_scale) = (Fp8::E4m3, 0.05, 0.2);
        let wide = |c: &[u8], s: f32| c.iter().map(|&c| format.decode(c) * s).collect::<Vec<f32>>();
        let (kf, vf) = (wide(&k, k_scale), wide(&v, v_scale));
        // bfloat16 pages run the same way: their codes, and float32 planes of the values they hold
        let (kb, vb): (Vec<u16>, Vec<u16>) = (kf.iter().map(|&x| kv_bf16::encode(x)).collect(),
                                              vf.iter().map(|&x| kv_bf16::encode(x)).collect());
        let (kbf, vbf): (Vec<f32>, Vec<f32>) = (kb.iter().map(|&c| kv_bf16::decode(c)).collect(),
                                                vb.iter().map(|&c| kv_bf16::decode(c)).collect());
        let heads = 9;
        let width = (heads + 2 * kv.kv_heads) * kv.head_dim;
        for rows in [1usize, 4] {
            let qsl: Vec<i32> = (0..=rows as i32).collect();
            let meta = StepMeta { slot_mapping: &slots[..rows], query_start_loc: &qsl, seq_lens: &lens[..rows],
                                  block_tables: &tables[..rows * 4], table_width: 4 };
            let step = StepLayout::new(meta, rows, &kv).unwrap();
            let qkv: Vec<f32> = (0..rows * width).map(|i| ((i * 17 % 89) as f32 / 30.0) - 1.5).collect();
            for window in [None, Some(40), Some(5)] {
                let run = |planes: Planes<'_>, threads: usize, simd: Simd| {
                    let layer = LayerAttention { planes, heads, scale: 0.2, sliding_window: window };
                    let mut out = vec![f32::NAN; rows * heads * kv.head_dim];
                    attend(&layer, &qkv, &step, &kv, &mut out, threads, simd).unwrap();
                    out
                };
                let want = run(Planes::F32 { k: &kf, v: &vf }, 1, Simd::Portable);
                assert!(want.iter().all(|x| x.is_finite()));
                let fp8 = Fp8Cache { format, k_scale, v_scale };
                let want_bf16 = run(Planes::F32 { k: &kbf, v: &vbf }, 1, Simd::Portable);
                for (threads, simd) in [(1, Simd::best()), (2, Simd::best()), (1, Simd::Portable), (2, Simd::Portable)] {
                    assert_eq!(run(Planes::F32 { k: &kf, v: &vf }, threads, simd), want, "float32 rows {rows} {window:?}");
                    let got = run(Planes::Fp8 { k: &k, v: &v, fp8 }, threads, simd);
                    assert_eq!(got, want, "rows {rows} window {window:?} threads {threads} {simd:?}");
                    let got = run(Planes::Bf16 { k: &kb, v: &vb }, threads, simd);
                    assert_eq!(got, want_bf16, "bfloat16 rows {rows} window {window:?} threads {threads} {simd:?}");
                }
            }
        }
    }
}
