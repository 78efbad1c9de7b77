//! Several query heads of one KV head in one pass over its keys (the AVX2 build): each head's
//! values are those of the one-head kernels of the parent module ([`super::scores`],
//! [`super::weighted_sum`]), bit for bit; a key's row is loaded once for all of them.

use std::arch::x86_64::*;

use super::super::{dot, DOT_LANES, LANES};
use super::{prefetch_row, reduce8, SCORE_AHEAD, SUM_AHEAD};

/// `G` query heads that read one KV head, scored against every key in one pass: `out[g * n + k]`
/// is head `g`'s score of key `k` (`n = stride`), the bits of [`scores`] for each head (each
/// lane's chain runs the same FMAs in the same order; the two 8-lane halves of a key's 16 lanes
/// are separate chains, computed one after the other here and met by the same add). Why: a key's
/// row is loaded once for all `G` heads instead of once per head (on SmolLM2's 9 heads over 3 KV
/// heads that is a third of the loads).
///
/// # Safety
/// The CPU runs AVX2 and FMA; `q.len() == G * d`; `keys[k] + d <= plane.len()` for every key;
/// `stride >= keys.len()` and `out.len() >= (G - 1) * stride + keys.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores_group<const G: usize>(q: &[f32], d: usize, plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32],
                                           stride: usize) {
    let nk = keys.len();
    let n = d / DOT_LANES * DOT_LANES;
    let (qp, pp) = (q.as_ptr(), plane.as_ptr());
    let scale_v = _mm256_set1_ps(scale);
    let eights = nk / 8 * 8;
    for g8 in 0..eights / 8 {
        let ks = &keys[8 * g8..8 * g8 + 8];
        for &k in keys.iter().skip(8 * g8 + SCORE_AHEAD).take(8) {
            prefetch_row(pp, k, d);
        }
        // lanes 0-7 and 8-15 of each (head, key) accumulator, before they are added
        let mut halves = [[[_mm256_setzero_ps(); 8]; G]; 2];
        for quad in 0..2 {
            let kq = &ks[4 * quad..4 * quad + 4];
            for (hl, half) in halves.iter_mut().enumerate() {
                let mut acc = [[_mm256_setzero_ps(); 4]; G];
                for c in (0..n).step_by(DOT_LANES) {
                    let c = c + 8 * hl;
                    for (t, &k) in kq.iter().enumerate() {
                        // SAFETY: c + 8 <= n <= d; each key's d floats lie inside `plane` and `q`
                        // holds G * d floats (the contract).
                        unsafe {
                            let kv = _mm256_loadu_ps(pp.add(k + c));
                            for (g, a) in acc.iter_mut().enumerate() {
                                a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(g * d + c)), kv, a[t]);
                            }
                        }
                    }
                }
                for (g, a) in acc.iter().enumerate() {
                    half[g][4 * quad..4 * quad + 4].copy_from_slice(a);
                }
            }
        }
        for g in 0..G {
            let folded: [__m256; 8] = std::array::from_fn(|t| _mm256_add_ps(halves[0][g][t], halves[1][g][t]));
            let mut s = reduce8(folded);
            let qg = &q[g * d..(g + 1) * d];
            for i in n..d {
                let kv = _mm256_setr_ps(plane[ks[0] + i], plane[ks[1] + i], plane[ks[2] + i], plane[ks[3] + i],
                                        plane[ks[4] + i], plane[ks[5] + i], plane[ks[6] + i], plane[ks[7] + i]);
                s = _mm256_fmadd_ps(_mm256_set1_ps(qg[i]), kv, s);
            }
            // SAFETY: g * stride + 8 * g8 + 8 <= (G - 1) * stride + nk <= out.len() (the contract).
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(g * stride + 8 * g8), _mm256_mul_ps(s, scale_v)) };
        }
    }
    for g in 0..G {
        let qg = &q[g * d..(g + 1) * d];
        for (&k, o) in keys[eights..].iter().zip(&mut out[g * stride + eights..g * stride + nk]) {
            *o = dot(qg, &plane[k..][..d]) * scale;
        }
    }
}

/// `G` heads' weighted sums over one KV head's values in one pass: `out[g * d + i] = sum over k in
/// order of p[g * stride + k] * V[k][i]`, the bits of [`weighted_sum`] for each head (every output
/// is its own chain of FMAs from 0, or from `out`'s value with `accumulate`, keys in order). A
/// value row is loaded once for all `G` heads.
///
/// # Safety
/// The CPU runs AVX2 and FMA; `out.len() == G * d`; `keys[k] + d <= plane.len()` for every key;
/// `stride >= keys.len()` and `p.len() >= (G - 1) * stride + keys.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_sum_group<const G: usize>(p: &[f32], stride: usize, plane: &[f32], keys: &[usize], out: &mut [f32],
                                                 accumulate: bool) {
    let d = out.len() / G;
    let nk = keys.len();
    let n = d / LANES * LANES;
    let pp = plane.as_ptr();
    let mut c0 = 0;
    // 32 outputs of each head (4 vectors, 4G accumulators) at a time across every key
    while c0 + 32 <= n {
        // SAFETY: c0 + 32 <= n <= d: inside each head's outputs and every key's d floats.
        unsafe { chunk_group::<G, 4>(p, stride, pp, keys, c0, d, out, accumulate) };
        c0 += 32;
    }
    while c0 < n {
        // SAFETY: c0 + 8 <= n, as above.
        unsafe { chunk_group::<G, 1>(p, stride, pp, keys, c0, d, out, accumulate) };
        c0 += 8;
    }
    for g in 0..G {
        for i in n..d {
            let mut s = if accumulate { out[g * d + i] } else { 0.0 };
            for (&k, &pk) in keys.iter().zip(&p[g * stride..g * stride + nk]) {
                s = pk.mul_add(plane[k + i], s);
            }
            out[g * d + i] = s;
        }
    }
}

/// Outputs `c0 .. c0 + 8W` of each of `G` heads over every key (from 0, or from `out`'s with
/// `accumulate`).
///
/// # Safety
/// AVX2 and FMA; `c0 + 8W <= d`, `out.len() == G * d`, `p.len() >= (G - 1) * stride + keys.len()`,
/// and every key's floats `c0 .. c0 + 8W` inside the plane.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_group<const G: usize, const W: usize>(p: &[f32], stride: usize, pp: *const f32, keys: &[usize], c0: usize,
                                                       d: usize, out: &mut [f32], accumulate: bool) {
    let mut acc = [[_mm256_setzero_ps(); W]; G];
    if accumulate {
        for (g, a) in acc.iter_mut().enumerate() {
            for (j, x) in a.iter_mut().enumerate() {
                // SAFETY: g * d + c0 + 8j + 8 <= (g + 1) * d <= out.len() (the contract).
                *x = unsafe { _mm256_loadu_ps(out.as_ptr().add(g * d + c0 + 8 * j)) };
            }
        }
    }
    for (i, &k) in keys.iter().enumerate() {
        if let Some(&ahead) = keys.get(i + SUM_AHEAD) {
            let mut j = 0;
            while j < W {
                prefetch_row(pp, ahead + c0 + 8 * j, 8 * (W - j).min(2));
                j += 2;
            }
        }
        // the G weights first, then one value vector at a time: G * W accumulators, G weights and
        // one vector fill AVX2's 16 registers at G = 3, W = 4 (the W vectors loaded first, the
        // compiler kept one accumulator on the stack, a store and a load on its chain every key)
        // SAFETY: g * stride + i < (G - 1) * stride + keys.len() <= p.len() (the contract).
        let pv: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(unsafe { *p.get_unchecked(g * stride + i) }));
        for j in 0..W {
            // SAFETY: the function's contract.
            let v = unsafe { _mm256_loadu_ps(pp.add(k + c0 + 8 * j)) };
            for (a, &pv) in acc.iter_mut().zip(&pv) {
                a[j] = _mm256_fmadd_ps(pv, v, a[j]);
            }
        }
    }
    for (g, a) in acc.iter().enumerate() {
        for (j, x) in a.iter().enumerate() {
            // SAFETY: g * d + c0 + 8j + 8 <= g * d + c0 + 8W <= (g + 1) * d <= out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(g * d + c0 + 8 * j), *x) };
        }
    }
}
