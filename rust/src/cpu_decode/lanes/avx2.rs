//! The AVX2 + FMA build of [`super::Lanes`]'s kernels (see the parent module for the order every
//! build keeps); only `super::Avx2`'s methods call these, after checking the bounds.

use std::arch::x86_64::*;

use super::{dot, ops, silu_times, DOT_LANES, EXP_MIN, EXP_P, LANES, LN2_HI, LN2_LO, LOG2E, ROUND};

mod group;
pub use group::{scores_group, weighted_sum_group};

/// Lane `k` of the result is `ops::reduce` of `acc[k]`: the 8 x 8 transpose puts lane `j` of
/// every accumulator in vector `c[j]`, then the tree's adds run on whole vectors.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce8(acc: [__m256; 8]) -> __m256 {
    let t0 = _mm256_unpacklo_ps(acc[0], acc[1]);
    let t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
    let t2 = _mm256_unpacklo_ps(acc[2], acc[3]);
    let t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
    let t4 = _mm256_unpacklo_ps(acc[4], acc[5]);
    let t5 = _mm256_unpackhi_ps(acc[4], acc[5]);
    let t6 = _mm256_unpacklo_ps(acc[6], acc[7]);
    let t7 = _mm256_unpackhi_ps(acc[6], acc[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xee>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xee>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xee>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xee>(t5, t7);
    let c = [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ];
    // ops::reduce: ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))
    _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(c[0], c[4]), _mm256_add_ps(c[1], c[5])),
        _mm256_add_ps(_mm256_add_ps(c[2], c[6]), _mm256_add_ps(c[3], c[7])),
    )
}

/// # Safety
/// The CPU runs AVX2 and FMA; `keys[k] + q.len() <= plane.len()` for every key;
/// `out.len() >= keys.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]) {
    let d = q.len();
    let n = d / DOT_LANES * DOT_LANES;
    let (qp, pp) = (q.as_ptr(), plane.as_ptr());
    let scale_v = _mm256_set1_ps(scale);
    let eights = keys.len() / 8 * 8;
    for (g, (ks, os)) in keys[..eights].chunks_exact(8).zip(out.chunks_exact_mut(8)).enumerate() {
        // the keys SCORE_AHEAD further on are asked for now: a step's pages come from the L3 (or
        // DRAM), at scattered pages and a stride of kv_heads * d floats the prefetcher misses
        for &k in keys.iter().skip(8 * g + SCORE_AHEAD).take(8) {
            prefetch_row(pp, k, d);
        }
        let mut folded = [_mm256_setzero_ps(); 8];
        // four keys at a time: 8 accumulators (lanes 0-7 and 8-15 of each) stay in registers
        for half in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            for c in (0..n).step_by(DOT_LANES) {
                // SAFETY: c + 16 <= n <= d, and each key's d floats lie inside `plane` (contract).
                unsafe {
                    let (xl, xh) = (_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(qp.add(c + 8)));
                    for (a, &k) in acc.iter_mut().zip(&ks[4 * half..4 * half + 4]) {
                        a[0] = _mm256_fmadd_ps(xl, _mm256_loadu_ps(pp.add(k + c)), a[0]);
                        a[1] = _mm256_fmadd_ps(xh, _mm256_loadu_ps(pp.add(k + c + 8)), a[1]);
                    }
                }
            }
            for (t, a) in acc.iter().enumerate() {
                folded[4 * half + t] = _mm256_add_ps(a[0], a[1]);
            }
        }
        let mut s = reduce8(folded);
        for i in n..d {
            // the tail in order, lane k for key k
            let kv = _mm256_setr_ps(plane[ks[0] + i], plane[ks[1] + i], plane[ks[2] + i], plane[ks[3] + i],
                                    plane[ks[4] + i], plane[ks[5] + i], plane[ks[6] + i], plane[ks[7] + i]);
            s = _mm256_fmadd_ps(_mm256_set1_ps(q[i]), kv, s);
        }
        // SAFETY: `os` holds 8 floats.
        unsafe { _mm256_storeu_ps(os.as_mut_ptr(), _mm256_mul_ps(s, scale_v)) };
    }
    for (&k, o) in keys[eights..].iter().zip(&mut out[eights..]) {
        *o = dot(q, &plane[k..][..d]) * scale;
    }
}

/// Keys ahead of the 8 being scored whose rows `scores` asks the caches for (three groups: a
/// group of 8 keys takes ~100 cycles, a line from the L3 ~250).
const SCORE_AHEAD: usize = 32;
/// Keys ahead of the one being summed whose values `weighted_sum` asks for (a key's 8 FMAs a
/// chunk take a few cycles).
const SUM_AHEAD: usize = 48;

/// Asks for the cache lines of the `d` floats at `plane[k..]`. A hint only: `_mm_prefetch` never
/// faults, and `wrapping_add` keeps the address arithmetic defined for any offset.
#[inline(always)]
fn prefetch_row(plane: *const f32, k: usize, d: usize) {
    let mut i = 0;
    while i < d {
        // SAFETY: a prefetch of any address is harmless (never faults, changes no state but caches).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(plane.wrapping_add(k + i) as *const i8) };
        i += 16; // 64-byte lines
    }
}

/// `super::exp` on eight lanes, step for step.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let round = _mm256_set1_ps(ROUND);
    let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), round), round);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let z = _mm256_mul_ps(r, r);
    let mut y = _mm256_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0));
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                            _mm256_set1_epi32(127))));
    let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
    _mm256_andnot_ps(below, _mm256_mul_ps(y, pow2))
}

/// # Safety
/// The CPU runs AVX2 and FMA; `gate_up.len() >= 2 * inter * rows` and `out.len() >= inter * rows`
/// for the rows of `out`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    let n = inter / 8 * 8;
    let (zero, one) = (_mm256_setzero_ps(), _mm256_set1_ps(1.0));
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for (gu, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (g, u) = gu.split_at(inter);
        for c in (0..n).step_by(8) {
            // SAFETY: c + 8 <= n <= inter, the length of `g`, `u` and `o`.
            unsafe {
                let gv = _mm256_loadu_ps(g.as_ptr().add(c));
                let e = exp8(_mm256_sub_ps(zero, _mm256_and_ps(gv, abs_mask)));
                let num = _mm256_blendv_ps(e, one, _mm256_cmp_ps::<_CMP_GE_OQ>(gv, zero));
                let s = _mm256_div_ps(num, _mm256_add_ps(one, e));
                let r = _mm256_mul_ps(_mm256_mul_ps(gv, s), _mm256_loadu_ps(u.as_ptr().add(c)));
                _mm256_storeu_ps(o.as_mut_ptr().add(c), r);
            }
        }
        for i in n..inter {
            o[i] = silu_times(g[i], u[i]);
        }
    }
}

/// # Safety
/// The CPU runs AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax_weights(s: &mut [f32], max: f32) -> f32 {
    let n = s.len() / LANES * LANES;
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    for c in s[..n].chunks_exact_mut(LANES) {
        // SAFETY: `c` holds 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; LANES];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum = ops::reduce(lanes);
    for x in &mut s[n..] {
        *x = super::exp(*x - max);
        sum += *x;
    }
    sum
}

/// `softmax_weights`' sum without its stores (the same lanes, the same order: the same bits).
///
/// # Safety
/// The CPU runs AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn sum_exp(s: &[f32], max: f32) -> f32 {
    let n = s.len() / LANES * LANES;
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    for c in s[..n].chunks_exact(LANES) {
        // SAFETY: `c` holds 8 floats.
        acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, m)));
    }
    let mut lanes = [0f32; LANES];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum = ops::reduce(lanes);
    for &x in &s[n..] {
        sum += super::exp(x - max);
    }
    sum
}

/// # Safety
/// The CPU runs AVX2 and FMA; `keys[k] + out.len() <= plane.len()` for every key;
/// `p.len() >= keys.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32], accumulate: bool) {
    let d = out.len();
    let n = d / LANES * LANES;
    let pp = plane.as_ptr();
    let mut c0 = 0;
    // 64 outputs (8 vectors) at a time stay in registers across every key
    while c0 + 64 <= n {
        // SAFETY: c0 + 64 <= n <= d: inside `out` and inside every key's d floats.
        unsafe { chunk::<8>(p, pp, keys, c0, out, accumulate) };
        c0 += 64;
    }
    while c0 < n {
        // SAFETY: c0 + 8 <= n, as above.
        unsafe { chunk::<1>(p, pp, keys, c0, out, accumulate) };
        c0 += 8;
    }
    for (i, o) in out.iter_mut().enumerate().skip(n) {
        let mut s = if accumulate { *o } else { 0.0 };
        for (&k, &pk) in keys.iter().zip(p) {
            s = pk.mul_add(plane[k + i], s);
        }
        *o = s;
    }
}

/// Outputs `c0 .. c0 + 8W` over every key (from 0, or from `out`'s with `accumulate`).
///
/// # Safety
/// AVX2 and FMA; `c0 + 8W <= out.len()` and every key's floats `c0 .. c0 + 8W` inside the plane.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk<const W: usize>(p: &[f32], pp: *const f32, keys: &[usize], c0: usize, out: &mut [f32], accumulate: bool) {
    let mut acc = [_mm256_setzero_ps(); W];
    if accumulate {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: c0 + 8j + 8 <= c0 + 8W <= out.len().
            *a = unsafe { _mm256_loadu_ps(out.as_ptr().add(c0 + 8 * j)) };
        }
    }
    for (i, (&k, &pk)) in keys.iter().zip(p).enumerate() {
        if let Some(&ahead) = keys.get(i + SUM_AHEAD) {
            let mut j = 0;
            while j < W {  // this chunk's lines of the value SUM_AHEAD keys on
                prefetch_row(pp, ahead + c0 + 8 * j, 8 * (W - j).min(2));
                j += 2;
            }
        }
        let pv = _mm256_set1_ps(pk);
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: the function's contract.
            *a = _mm256_fmadd_ps(pv, unsafe { _mm256_loadu_ps(pp.add(k + c0 + 8 * j)) }, *a);
        }
    }
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: c0 + 8j + 8 <= c0 + 8W <= out.len().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * j), *a) };
    }
}
