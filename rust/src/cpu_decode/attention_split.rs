//! One row's attention shared out finer than by KV head, in two phases, with the bits of
//! [`super::attention::attend_item`]: a step of one row on more threads than it has KV heads (a
//! multi-query model's one KV head on 2 threads ran on one of them while the other waited: 123-125
//! us a layer at 1,000 keys, 60-87 split, `attention_cold`).
//!
//! - **Scores**: item `(j, p)` scores KV head `j`'s query heads against part `p` of the row's keys
//!   (`parts` contiguous ranges). A score is one key's alone, so cutting the keys anywhere gives
//!   its bits. Item `(j, p)` writes its own block of the scores buffer (laid out `[KV head][part]
//!   [query head of the KV head][key of the part]`: the items' blocks lie in item order).
//! - **Sums**: item `(j, c)` gathers KV head `j`'s query heads' scores into one row each (every
//!   key in order, as the one-item path has them), makes the softmax weights and their sum (the
//!   same calls; each of the `cols` items of a KV head computes them again: a few microseconds),
//!   then the weighted sums for its own columns `c` of the head dimension, divided by the sum. A
//!   weighted sum is one chain of FMAs per output column over the keys in order, so a column's
//!   bits do not depend on which columns share its pass. Item `(j, c)` writes its own piece
//!   (`[group][columns]`), and [`KeySplit::scatter`] puts the pieces into the row's outputs.
//!
//! Float32 pages are read in place; fp8 pages as the one-item path reads them ([`each_run`]), run
//! by run widened into a per-thread buffer, each item widening only what it reads (a score
//! item its KV head's codes, a sum item its columns), so every code is still widened once. Only
//! one row (more rows give enough items: `units_per_item`), only where some thread would get no KV
//! head (SmolLM2's 3 on 2 threads, 2 : 1, measured no faster split: 7-30 us by KV head against 9-35
//! split with the pages in the caches, 146-153 against 137-146 from memory), and only from
//! [`MIN_KEYS`] keys (one KV head on 2 threads, in the caches: 130 keys 7.8-10.4 us by KV head, 7.1-9.1
//! split).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Mutex;

use super::attention::{divide_rows, scores_heads, softmax_rows, weighted_sums_heads, Simd};
use super::kv_cache::Planes;
use super::kv_rows::{each_run, Rows};
#[cfg(target_arch = "x86_64")]
use super::lanes::Avx2;
use super::lanes::{Lanes, Portable};
use crate::gemv::pool::Team;
use crate::gemv::GemvError;

/// Keys from which a one-row step is split (measured: see the module docs and the README).
pub const MIN_KEYS: usize = 128;

/// How one row's attention is cut: `parts` key ranges for the scores, `cols` column pieces for
/// the sums, per KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySplit {
    pub kv_heads: usize,
    /// Query heads a KV head.
    pub group: usize,
    pub head_dim: usize,
    /// The row's keys.
    pub keys: usize,
    pub parts: usize,
    pub cols: usize,
    /// Columns a piece (a multiple of 8, the last piece may hold fewer; none is empty).
    pub piece: usize,
}

impl KeySplit {
    /// The split for a step of `rows` rows over `keys` keys (its longest row's) on `threads`
    /// threads, or None where every thread gets a KV head of its own, or the step is not one row,
    /// or it has fewer than [`MIN_KEYS`] keys.
    pub fn plan(rows: usize, heads: usize, kv_heads: usize, head_dim: usize, keys: usize, threads: usize) -> Option<KeySplit> {
        if rows != 1 || threads < 2 || keys < MIN_KEYS || kv_heads == 0 || kv_heads >= threads {
            return None;
        }
        let piece = (head_dim.div_ceil(8)).div_ceil(threads) * 8;
        let cols = head_dim.div_ceil(piece);
        Some(KeySplit { kv_heads, group: heads / kv_heads, head_dim, keys, parts: threads.min(keys), cols, piece })
    }

    pub fn score_items(&self) -> usize {
        self.kv_heads * self.parts
    }

    pub fn sum_items(&self) -> usize {
        self.kv_heads * self.cols
    }

    /// Floats of the scores buffer (every query head's score of every key).
    pub fn scores_len(&self) -> usize {
        self.kv_heads * self.group * self.keys
    }

    /// Floats of the pieces buffer (every query head's outputs).
    pub fn pieces_len(&self) -> usize {
        self.kv_heads * self.group * self.head_dim
    }

    /// Keys of part `p`.
    fn part(&self, p: usize) -> Range<usize> {
        self.keys * p / self.parts..self.keys * (p + 1) / self.parts
    }

    /// Columns of piece `c`.
    fn columns(&self, c: usize) -> Range<usize> {
        c * self.piece..((c + 1) * self.piece).min(self.head_dim)
    }

    /// Where score item `i`'s block lies in the scores buffer.
    pub fn score_block(&self, i: usize) -> Range<usize> {
        let (j, p) = (i / self.parts, i % self.parts);
        let part = self.part(p);
        let start = self.group * (j * self.keys + part.start);
        start..start + self.group * part.len()
    }

    /// Where sum item `i`'s piece lies in the pieces buffer.
    pub fn piece_block(&self, i: usize) -> Range<usize> {
        let (j, c) = (i / self.cols, i % self.cols);
        let start = j * self.group * self.head_dim + self.group * c * self.piece;
        start..start + self.group * self.columns(c).len()
    }

    /// Score item `i`: `q` is the row's queries `[heads, d]`, `planes` the layer's pages, `keys`
    /// the row's key offsets ([`super::attention::row_keys`]), `out` this item's block.
    #[allow(clippy::too_many_arguments)]
    pub fn scores(&self, i: usize, q: &[f32], planes: Planes<'_>, keys: &[usize], scale: f32, out: &mut [f32], simd: Simd) {
        assert_eq!(keys.len(), self.keys, "the row's keys");
        let (j, p) = (i / self.parts, i % self.parts);
        let keys = &keys[self.part(p)];
        let (d, group) = (self.head_dim, self.group);
        let (q, (k, _)) = (&q[j * group * d..(j + 1) * group * d], Rows::of(planes, j * d));
        match simd {
            Simd::Portable => scores_part::<Portable>(q, d, k, keys, scale, out),
            // SAFETY: `Simd::Avx2` is only chosen (`Simd::best`) on a CPU that runs AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { scores_part_avx2(q, d, k, keys, scale, out) },
        }
    }

    /// Sum item `i`: `scores` the whole scores buffer (every score item done), `planes` the
    /// layer's pages, `out` this item's piece.
    pub fn sums(&self, i: usize, scores: &[f32], planes: Planes<'_>, keys: &[usize], out: &mut [f32], simd: Simd) {
        assert_eq!(keys.len(), self.keys, "the row's keys");
        let (j, c) = (i / self.cols, i % self.cols);
        let (n, group) = (self.keys, self.group);
        WEIGHTS.with(|cell| {
            let mut cell = cell.borrow_mut();
            let (w, sums) = &mut *cell;
            w.clear();
            sums.resize(group, 0.0);
            // head j*group + g's scores, every part's in key order: one row of n per head
            for g in 0..group {
                for p in 0..self.parts {
                    let (block, len) = (self.score_block(j * self.parts + p), self.part(p).len());
                    w.extend_from_slice(&scores[block][g * len..(g + 1) * len]);
                }
            }
            let (_, v) = Rows::of(planes, j * self.head_dim + self.columns(c).start);
            match simd {
                Simd::Portable => sums_piece::<Portable>(w, sums, n, group, v, keys, out),
                // SAFETY: as in `scores`.
                #[cfg(target_arch = "x86_64")]
                Simd::Avx2 => unsafe { sums_piece_avx2(w, sums, n, group, v, keys, out) },
            }
        });
    }

    /// The pieces (every sum item done) into the row's outputs `o` (`[heads, d]`).
    pub fn scatter(&self, pieces: &[f32], o: &mut [f32]) {
        for i in 0..self.sum_items() {
            let (j, c) = (i / self.cols, i % self.cols);
            let cols = self.columns(c);
            let piece = &pieces[self.piece_block(i)];
            for (g, src) in piece.chunks_exact(cols.len()).enumerate() {
                let h = j * self.group + g;
                o[h * self.head_dim + cols.start..h * self.head_dim + cols.end].copy_from_slice(src);
            }
        }
    }
}

/// Both phases of `split` on `team` for one row, into `o` (`[heads, d]`): what the chain's
/// phases run, for `attention::attend` on several threads.
#[allow(clippy::too_many_arguments)]
pub fn attend_on_team(split: &KeySplit, team: &Team, q: &[f32], planes: Planes<'_>, keys: &[usize], scale: f32,
                      o: &mut [f32], simd: Simd) -> Result<(), GemvError> {
    let mut scores = vec![0f32; split.scores_len()];
    let blocks = in_blocks(&mut scores, (0..split.score_items()).map(|i| split.score_block(i)));
    team.run(split.score_items(), &|i| split.scores(i, q, planes, keys, scale, &mut lock(&blocks[i]), simd))?;
    drop(blocks);
    let mut pieces = vec![0f32; split.pieces_len()];
    let blocks = in_blocks(&mut pieces, (0..split.sum_items()).map(|i| split.piece_block(i)));
    team.run(split.sum_items(), &|i| split.sums(i, &scores, planes, keys, &mut lock(&blocks[i]), simd))?;
    drop(blocks);
    split.scatter(&pieces, o);
    Ok(())
}

/// `buf` cut into the consecutive `ranges` (each starting where the one before ended), one lock
/// each: every item owns its block (the lock is never contended).
fn in_blocks(buf: &mut [f32], ranges: impl Iterator<Item = Range<usize>>) -> Vec<Mutex<&mut [f32]>> {
    let (mut rest, mut at) = (buf, 0);
    ranges.map(|r| {
        assert_eq!(r.start, at, "blocks in order, back to back");
        let (block, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
        (rest, at) = (tail, r.end);
        Mutex::new(block)
    }).collect()
}

fn lock<'a, 'b>(m: &'a Mutex<&'b mut [f32]>) -> std::sync::MutexGuard<'a, &'b mut [f32]> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// Per thread: a sum item's gathered scores, then weights (`[group, keys]`), and their sums.
    static WEIGHTS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The `group` query heads `q` (`[group, d]`) of one KV head (its keys from `k`) over `keys`,
/// into `out` (`[group, keys]`).
#[inline(always)]
fn scores_part<L: Lanes>(q: &[f32], d: usize, k: Rows<'_>, keys: &[usize], scale: f32, out: &mut [f32]) {
    let n = keys.len();
    each_run(k, keys, d, |plane, run, t0| scores_heads::<L>(q, d, plane, run, scale, &mut out[t0..], n));
}

/// Softmax of each of the `group` rows of `w` (`[group, n]` scores, weights after; their sums into
/// `sums`), then their weighted sums over `v` (the piece's first column at each key's start),
/// divided by each row's sum, into `out` (`[group, columns]`); the chains go on from run to run.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn sums_piece<L: Lanes>(w: &mut [f32], sums: &mut [f32], n: usize, group: usize, v: Rows<'_>, keys: &[usize],
                        out: &mut [f32]) {
    softmax_rows::<L>(w, n, sums);
    let cols = out.len() / group;
    each_run(v, keys, cols, |plane, run, t0| weighted_sums_heads::<L>(&w[t0..], n, plane, run, out, group, t0 > 0));
    divide_rows(out, cols, sums);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_part_avx2(q: &[f32], d: usize, k: Rows<'_>, keys: &[usize], scale: f32, out: &mut [f32]) {
    scores_part::<Avx2>(q, d, k, keys, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn sums_piece_avx2(w: &mut [f32], sums: &mut [f32], n: usize, group: usize, v: Rows<'_>, keys: &[usize],
                          out: &mut [f32]) {
    sums_piece::<Avx2>(w, sums, n, group, v, keys, out)
}

#[cfg(test)]
mod tests {
    use super::super::attention::{attend, row_keys, LayerAttention};
    use super::super::kv_cache::{Fp8Cache, Planes};
    use super::super::kv_bf16;
    use super::super::kv_fp8::Fp8;
    use super::super::step::{KvGeometry, StepLayout, StepMeta};
    use super::*;

    /// The split's phases, items in the order given, then the scatter.
    #[allow(clippy::too_many_arguments)]
    fn split_attention(s: &KeySplit, q: &[f32], planes: Planes<'_>, keys: &[usize], scale: f32, simd: Simd,
                       order: &[usize]) -> Vec<f32> {
        let mut scores = vec![f32::NAN; s.scores_len()];
        for &i in order.iter().filter(|&&i| i < s.score_items()) {
            let block = s.score_block(i);
            s.scores(i, q, planes, keys, scale, &mut scores[block], simd);
        }
        assert!(scores.iter().all(|x| !x.is_nan()), "the score blocks cover the buffer");
        let mut pieces = vec![f32::NAN; s.pieces_len()];
        for &i in order.iter().filter(|&&i| i < s.sum_items()) {
            let block = s.piece_block(i);
            s.sums(i, &scores, planes, keys, &mut pieces[block], simd);
        }
        let mut o = vec![f32::NAN; s.pieces_len()];
        s.scatter(&pieces, &mut o);
        assert!(o.iter().all(|x| !x.is_nan()), "the pieces cover the outputs");
        o
    }

    /// Every split (parts and pieces for 2-5 threads, head dims that are and are not multiples of
    /// 8, 1-3 KV heads of 1-7 query heads, windows, keys over scattered pages, float32 and fp8
    /// pages: parts and pieces that start and end mid-run) gives the bits of the one-item path on
    /// both builds, whatever order its items run in.
    #[test]
    fn split_rows_have_the_bits_of_one_item_a_kv_head() {
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        for (kv_heads, group, d) in [(3, 3, 64), (1, 4, 20), (2, 7, 8), (3, 1, 36), (1, 2, 72)] {
            let kv = KvGeometry { layers: 1, num_blocks: 40, block_size: 16, kv_heads, head_dim: d };
            let (k, v): (Vec<f32>, Vec<f32>) = ((0..kv.plane()).map(val).collect(), (0..kv.plane()).map(|i| val(i + 5)).collect());
            let (k8, v8): (Vec<u8>, Vec<u8>) = ((0..kv.plane()).map(|i| (i * 53 % 247) as u8 & 0xf7).collect(),
                                                (0..kv.plane()).map(|i| (i * 29 % 239) as u8 & 0xf7).collect());
            let fp8 = Fp8Cache { format: Fp8::E4m3, k_scale: 0.05, v_scale: 0.2 };
            let (k16, v16): (Vec<u16>, Vec<u16>) = (k.iter().map(|&x| kv_bf16::encode(x)).collect(),
                                                    v.iter().map(|&x| kv_bf16::encode(x)).collect());
            let tables: Vec<i32> = (0..40).map(|b| (b * 17 + 3) % 40).collect();
            for ((len, window), planes) in [(131usize, None), (600, Some(300)), (257, None)].into_iter()
                .flat_map(|c| [(c, Planes::F32 { k: &k, v: &v }), (c, Planes::Fp8 { k: &k8, v: &v8, fp8 }),
                               (c, Planes::Bf16 { k: &k16, v: &v16 })]) {
                let slot = tables[(len - 1) / 16] as i64 * 16 + ((len - 1) % 16) as i64;
                let seq_lens = [len as i32];
                let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables,
                                      table_width: 40 };
                let step = StepLayout::new(meta, 1, &kv).unwrap();
                let keys = row_keys(window, &step, &kv).remove(0);
                let heads = kv_heads * group;
                let qkv: Vec<f32> = (0..(heads + 2 * kv_heads) * d).map(|i| val(i * 3 + 1)).collect();
                let layer = LayerAttention { planes, heads, scale: 0.3, sliding_window: window };
                let mut want = vec![0f32; heads * d];
                attend(&layer, &qkv, &step, &kv, &mut want, 1, Simd::Portable).unwrap();
                for threads in [2, 3, 4, 5] {
                    let Some(s) = KeySplit::plan(1, heads, kv_heads, d, keys.len(), threads) else {
                        assert!(kv_heads >= threads, "split where a thread would get no KV head");
                        continue;
                    };
                    let forward: Vec<usize> = (0..s.score_items().max(s.sum_items())).collect();
                    let backward: Vec<usize> = forward.iter().rev().copied().collect();
                    for simd in [Simd::Portable, Simd::best()] {
                        for order in [&forward, &backward] {
                            let got = split_attention(&s, &qkv[..heads * d], layer.planes, &keys, 0.3, simd, order);
                            let codes = match planes { Planes::F32 { .. } => "f32", Planes::Bf16 { .. } => "bf16", _ => "fp8" };
                            assert_eq!(got, want, "{kv_heads}x{group} heads of {d}, {len} keys {window:?}, {codes}, {threads} threads {simd:?}");
                        }
                    }
                }
            }
        }
    }

    /// `attention::attend` on 2-4 threads runs the split for one long row where a thread would get
    /// no KV head (SmolLM2's 3 on 4 threads, one KV head of 9 query heads on 2-4) and gives the
    /// one-thread bits either way.
    #[test]
    fn attend_on_a_team_splits_one_long_row() {
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        for (kv_heads, heads) in [(3, 9), (1, 9)] {
            let kv = KvGeometry { layers: 1, num_blocks: 40, block_size: 16, kv_heads, head_dim: 64 };
            let (k, v): (Vec<f32>, Vec<f32>) = ((0..kv.plane()).map(val).collect(), (0..kv.plane()).map(|i| val(i + 5)).collect());
            let tables: Vec<i32> = (0..40).map(|b| (b * 17 + 3) % 40).collect();
            let len = 500usize;
            let slot = tables[(len - 1) / 16] as i64 * 16 + ((len - 1) % 16) as i64;
            let seq_lens = [len as i32];
            let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables,
                                  table_width: 40 };
            let step = StepLayout::new(meta, 1, &kv).unwrap();
            let qkv: Vec<f32> = (0..(heads + 2 * kv_heads) * 64).map(|i| val(i * 3 + 1)).collect();
            let layer = LayerAttention { planes: Planes::F32 { k: &k, v: &v }, heads, scale: 0.125, sliding_window: None };
            let mut want = vec![0f32; heads * 64];
            attend(&layer, &qkv, &step, &kv, &mut want, 1, Simd::best()).unwrap();
            for threads in [2, 3, 4] {
                let mut got = vec![f32::NAN; heads * 64];
                attend(&layer, &qkv, &step, &kv, &mut got, threads, Simd::best()).unwrap();
                assert_eq!(got, want, "{kv_heads} KV heads, {threads} threads");
            }
        }
    }

    #[test]
    fn only_one_row_with_enough_keys_and_fewer_kv_heads_than_threads_is_split() {
        assert!(KeySplit::plan(1, 9, 1, 64, 1000, 2).is_some());
        assert_eq!(KeySplit::plan(2, 9, 1, 64, 1000, 2), None, "two rows");
        assert_eq!(KeySplit::plan(1, 9, 1, 64, 1000, 1), None, "one thread");
        assert_eq!(KeySplit::plan(1, 9, 1, 64, MIN_KEYS - 1, 2), None, "few keys");
        assert_eq!(KeySplit::plan(1, 8, 2, 64, 1000, 2), None, "2 KV heads on 2 threads");
        assert_eq!(KeySplit::plan(1, 9, 3, 64, 1000, 2), None, "3 KV heads on 2 threads (2 : 1)");
        let s = KeySplit::plan(1, 9, 3, 64, 1000, 4).unwrap();
        assert_eq!((s.parts, s.cols, s.piece, s.score_items(), s.sum_items()), (4, 4, 16, 12, 12), "3 KV heads on 4 threads");
        let s = KeySplit::plan(1, 9, 1, 64, 1000, 2).unwrap();
        assert_eq!((s.parts, s.cols, s.piece, s.score_items(), s.sum_items()), (2, 2, 32, 2, 2));
        let s = KeySplit::plan(1, 4, 1, 20, 200, 4).unwrap();
        assert_eq!((s.parts, s.cols, s.piece), (4, 3, 8), "20 columns as 8 + 8 + 4");
    }
}
