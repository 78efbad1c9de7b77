//! Paged attention of each row over the keys it sees, read from the pages in place.
//!
//! One work item is one (row, query head): scores `q . k * scale` over the row's visible
//! positions in order, softmax with the maximum subtracted, then `sum(p * v) / sum(p)`.
//! Items are independent, so the GEMV team shares them out and the bits do not depend on
//! how (each item writes only its own `head_dim` outputs).

use std::sync::Mutex;

use super::error::DecodeError;
use super::ops::{axpy, dot};
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

/// `out[r, h*d .. (h+1)*d]` for every row `r` and query head `h`; `qkv` is the rotated fused
/// output `[T, (heads + 2 kv_heads) * d]` (queries first). GQA: head `h` reads KV head
/// `h / (heads / kv_heads)`.
pub fn attend(
    layer: &LayerAttention<'_>,
    qkv: &[f32],
    step: &StepLayout<'_>,
    kv: &KvGeometry,
    out: &mut [f32],
    threads: usize,
) -> Result<(), DecodeError> {
    let (heads, d) = (layer.heads, kv.head_dim);
    let width = (heads + 2 * kv.kv_heads) * d;
    let group = heads / kv.kv_heads;
    let item = |i: usize, o: &mut [f32]| {
        let (r, h) = (i / heads, i % heads);
        let q = &qkv[r * width + h * d..][..d];
        attend_one(layer, q, step, kv, r, h / group, o);
    };
    let items = step.rows.len() * heads;
    if threads == 1 || items == 1 {
        for (i, o) in out.chunks_exact_mut(d).enumerate() {
            item(i, o);
        }
        return Ok(());
    }
    // each item owns one head's outputs; the lock is never contended (one item, one claim)
    let outs: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(d).map(Mutex::new).collect();
    let team = pool::team(threads)?;
    team.run(items, &|i: usize| {
        let mut o = outs[i].lock().unwrap_or_else(|e| e.into_inner());
        item(i, &mut o);
    })
    .map_err(|e| match e {
        GemvError::Threads { reason } => DecodeError::Gemv(GemvError::Threads { reason: format!("attention: {reason}") }),
        e => DecodeError::Gemv(e),
    })
}

fn attend_one(
    layer: &LayerAttention<'_>,
    q: &[f32],
    step: &StepLayout<'_>,
    kv: &KvGeometry,
    r: usize,
    kv_head: usize,
    out: &mut [f32],
) {
    let row = step.rows[r];
    let (bs, d) = (kv.block_size, kv.head_dim);
    let lo = layer.sliding_window.map_or(0, |w| row.keys.saturating_sub(w));
    let offset = |p: usize| kv.slot_offset(step.block(row.seq, p, bs) * bs + p % bs, kv_head);
    let mut scores = Vec::with_capacity(row.keys - lo);
    let mut max = f32::NEG_INFINITY;
    for p in lo..row.keys {
        let s = dot(q, &layer.k_plane[offset(p)..][..d]) * layer.scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (p, &w) in (lo..row.keys).zip(&scores) {
        axpy(out, w, &layer.v_plane[offset(p)..][..d]);
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
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
        let heads = 4;
        let width = (heads + 2 * kv.kv_heads) * kv.head_dim;
        let qkv: Vec<f32> = (0..3 * width).map(|i| val(i + 3)).collect();
        for window in [None, Some(2)] {
            let layer = LayerAttention { k_plane: &k_plane, v_plane: &v_plane, heads, scale: 0.35, sliding_window: window };
            let mut one = vec![0f32; 3 * heads * 8];
            attend(&layer, &qkv, &step, &kv, &mut one, 1).unwrap();
            let mut two = vec![0f32; 3 * heads * 8];
            attend(&layer, &qkv, &step, &kv, &mut two, 2).unwrap();
            assert_eq!(one, two, "threads change no bit");
            for (r, row) in step.rows.iter().enumerate() {
                for h in 0..heads {
                    let kvh = h / 2;
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
                        assert!((got - w).abs() < 1e-5, "row {r} head {h} {j}: {got} vs {w}");
                    }
                }
            }
        }
    }
}
