//! Attention's inner loops in two builds that give the same bits: portable loops, and AVX2 + FMA
//! intrinsics. Both define each value by one fixed order of f32 operations (`fma` is a fused
//! multiply-add, one rounding: `f32::mul_add` in the portable build):
//!
//! - a score is `dot(q, k) * scale`, where `dot` runs 16 lanes, lane `i` accumulating
//!   `acc[i] = fma(q[16j + i], k[16j + i], acc[i])` for `j` in order, folds them to 8 lanes
//!   (`acc[i] + acc[i + 8]`), meets them in [`ops::reduce`]'s tree, then adds the tail in order
//!   (`s = fma(q[i], k[i], s)`);
//! - the softmax's weights are [`exp`] of `score - max`, and their sum runs 8 lanes
//!   (lane `i` adds weights `8j + i` in order), then `ops::reduce`, then the tail in order;
//! - a weighted sum is, per element, `out[i] = fma(p[k], v[k][i], out[i])` from 0, keys in order;
//! - SwiGLU is `(g * s) * u` with `e = exp(-|g|)`, `s = (g >= 0 ? 1 : e) / (1 + e)` (the sigmoid
//!   without an overflowing `exp(-g)`).
//!
//! The AVX2 build only changes what runs side by side: eight keys' dot products at once (their
//! lanes transposed so the eight reductions are vector adds of the same tree), eight weights'
//! `exp` at once, and a head's outputs kept in registers across all its keys (eight independent
//! chains, instead of a load and a store of the output per key).
//!
//! Why intrinsics and fused multiply-adds: the portable loops are what the compiler vectorizes
//! poorly (measured on an Intel Xeon, 2026-12-03: SmolLM2's attention over 160 keys took 30 us a
//! layer either way), and with separate multiplies and adds a key costs twice the instructions.

use super::attention::Simd;
use super::ops::{self, LANES};

/// Lanes of a score's accumulator (two AVX2 vectors; one AVX-512 vector).
pub const DOT_LANES: usize = 16;

/// The kernels one attention build uses. `keys[k]` is where key `k` starts in its plane; every
/// key has `q.len()` (or `out.len()`) floats there.
pub trait Lanes {
    /// `out[k] = dot(q, K[k]) * scale` for every key.
    fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]);
    /// `s[k] = exp(s[k] - max)` in place; returns their sum (8 lanes, then the tail).
    fn softmax_weights(s: &mut [f32], max: f32) -> f32;
    /// `out[i] = sum over k in order of p[k] * V[k][i]` (fused), starting from 0.
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]);
    /// SwiGLU of each fused `[gate | up]` row (`2 * inter` wide) into its `out` row: `silu(g) * u`.
    fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]);
}

/// SwiGLU (`Lanes::silu_mul`) in the build `simd`.
pub fn silu_mul(simd: Simd, gate_up: &[f32], inter: usize, out: &mut [f32]) {
    match simd {
        Simd::Portable => Portable::silu_mul(gate_up, inter, out),
        // `Simd::Avx2` is only chosen where the CPU runs AVX2 and FMA (`Simd::best`).
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => Avx2::silu_mul(gate_up, inter, out),
    }
}

/// One SwiGLU value of the module's definition.
#[inline(always)]
pub fn silu_times(g: f32, u: f32) -> f32 {
    let e = exp(-g.abs());
    let s = if g >= 0.0 { 1.0 } else { e } / (1.0 + e);
    (g * s) * u
}

/// `dot(q, k)` of the module's definition (16 lanes folded to 8, `ops::reduce`, the tail).
#[inline(always)]
pub fn dot(q: &[f32], k: &[f32]) -> f32 {
    let d = q.len();
    let n = d / DOT_LANES * DOT_LANES;
    let k = &k[..d];
    let mut acc = [0f32; DOT_LANES];
    for (cq, ck) in q[..n].chunks_exact(DOT_LANES).zip(k[..n].chunks_exact(DOT_LANES)) {
        for i in 0..DOT_LANES {
            acc[i] = cq[i].mul_add(ck[i], acc[i]);
        }
    }
    let folded: [f32; LANES] = std::array::from_fn(|i| acc[i] + acc[i + LANES]);
    let mut s = ops::reduce(folded);
    for (x, y) in q[n..].iter().zip(&k[n..]) {
        s = x.mul_add(*y, s);
    }
    s
}

/// `exp(x)` for `x <= 0` (Cephes' `expf`: `x = n ln 2 + r`, a degree-7 polynomial in `r`, times
/// `2^n`), within 2 ulp of the true value; 0 below -87.3 (where `expf` leaves the normal
/// floats). Every operation is an exactly specified IEEE one, so the AVX2 build, which runs the
/// same steps on eight lanes, gives the same bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    if x < EXP_MIN {
        return 0.0;
    }
    let n = (x * LOG2E + ROUND) - ROUND; // round to nearest, |x * log2 e| < 2^22
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let z = r * r;
    let mut y = EXP_P[0];
    for &c in &EXP_P[1..] {
        y = y.mul_add(r, c);
    }
    let y = y.mul_add(z, r) + 1.0;
    y * f32::from_bits((((n as i32) + 127) << 23) as u32)
}

const EXP_MIN: f32 = -87.336_55;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

pub struct Portable;

impl Lanes for Portable {
    #[inline(always)]
    fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
        for (gu, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
            let (g, u) = gu.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = silu_times(g, u);
            }
        }
    }
    #[inline(always)]
    fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]) {
        let d = q.len();
        for (&k, o) in keys.iter().zip(out.iter_mut()) {
            *o = dot(q, &plane[k..][..d]) * scale;
        }
    }
    #[inline(always)]
    fn softmax_weights(s: &mut [f32], max: f32) -> f32 {
        let n = s.len() / LANES * LANES;
        let mut acc = [0f32; LANES];
        for c in s[..n].chunks_exact_mut(LANES) {
            for i in 0..LANES {
                c[i] = exp(c[i] - max);
                acc[i] += c[i];
            }
        }
        let mut sum = ops::reduce(acc);
        for x in &mut s[n..] {
            *x = exp(*x - max);
            sum += *x;
        }
        sum
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]) {
        let d = out.len();
        out.fill(0.0);
        for (&k, &pk) in keys.iter().zip(p) {
            for (o, v) in out.iter_mut().zip(&plane[k..][..d]) {
                *o = pk.mul_add(*v, *o);
            }
        }
    }
}

/// AVX2 + FMA builds of the same kernels. Only `attention::attend_one_avx2` uses this type, and
/// only `Simd::Avx2` calls that, which is chosen where the CPU runs AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub struct Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{dot, ops, silu_times, DOT_LANES, EXP_MIN, EXP_P, LANES, LN2_HI, LN2_LO, LOG2E, ROUND};

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

    /// # Safety
    /// The CPU runs AVX2 and FMA; `keys[k] + out.len() <= plane.len()` for every key;
    /// `p.len() >= keys.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]) {
        let d = out.len();
        let n = d / LANES * LANES;
        let pp = plane.as_ptr();
        let mut c0 = 0;
        // 64 outputs (8 vectors) at a time stay in registers across every key
        while c0 + 64 <= n {
            // SAFETY: c0 + 64 <= n <= d: inside `out` and inside every key's d floats.
            unsafe { chunk::<8>(p, pp, keys, c0, out) };
            c0 += 64;
        }
        while c0 < n {
            // SAFETY: c0 + 8 <= n, as above.
            unsafe { chunk::<1>(p, pp, keys, c0, out) };
            c0 += 8;
        }
        for (i, o) in out.iter_mut().enumerate().skip(n) {
            let mut s = 0f32;
            for (&k, &pk) in keys.iter().zip(p) {
                s = pk.mul_add(plane[k + i], s);
            }
            *o = s;
        }
    }

    /// Outputs `c0 .. c0 + 8W` over every key.
    ///
    /// # Safety
    /// AVX2 and FMA; `c0 + 8W <= out.len()` and every key's floats `c0 .. c0 + 8W` inside the plane.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chunk<const W: usize>(p: &[f32], pp: *const f32, keys: &[usize], c0: usize, out: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); W];
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
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    #[inline(always)]
    fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
        assert!(gate_up.len() / (2 * inter) >= out.len() / inter);
        // SAFETY: see the type's docs (AVX2 and FMA were detected); the lengths were just checked.
        unsafe { avx2::silu_mul(gate_up, inter, out) }
    }
    #[inline(always)]
    fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]) {
        assert!(out.len() >= keys.len() && keys.iter().all(|&k| k + q.len() <= plane.len()));
        // SAFETY: see the type's docs (AVX2 and FMA were detected); the bounds were just checked.
        unsafe { avx2::scores(q, plane, keys, scale, out) }
    }
    #[inline(always)]
    fn softmax_weights(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { avx2::softmax_weights(s, max) }
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]) {
        assert!(p.len() >= keys.len() && keys.iter().all(|&k| k + out.len() <= plane.len()));
        // SAFETY: as above.
        unsafe { avx2::weighted_sum(p, plane, keys, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_float64() {
        let mut x = -87.3f32;
        while x <= 0.0 {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            let ulp = (want as f32).to_bits().abs_diff((got as f32).to_bits());
            assert!(ulp <= 2, "exp({x}) = {got}, want {want} ({ulp} ulp)");
            x += 0.000_37;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn silu_is_gate_times_sigmoid_times_up() {
        for g in [-100.0f32, -20.0, -3.5, -0.25, -0.0, 0.0, 0.25, 2.0, 17.0, 100.0] {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * 3.0;
            let got = silu_times(g, 3.0) as f64;
            assert!((got - want).abs() <= 1e-6 * want.abs().max(1e-30), "silu({g}) * 3 = {got}, want {want}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_gives_the_portable_bits() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        for d in [1, 7, 8, 13, 16, 24, 64, 67, 128, 200] {
            for nkeys in [1, 5, 8, 9, 17, 40] {
                let plane: Vec<f32> = (0..(nkeys + 3) * 211).map(|i| ((i * 31 + 7) as f32 * 0.13).sin()).collect();
                // scattered, out of order, some repeated
                let keys: Vec<usize> = (0..nkeys).map(|k| (k * 7 % (nkeys + 3)) * 211 + (k % 3)).collect();
                let q: Vec<f32> = (0..d).map(|i| ((i * 17) as f32 * 0.21).cos() * 3.0).collect();
                let (mut a, mut b) = (vec![0f32; nkeys], vec![0f32; nkeys]);
                Avx2::scores(&q, &plane, &keys, 0.37, &mut a);
                Portable::scores(&q, &plane, &keys, 0.37, &mut b);
                assert_eq!(a, b, "scores d={d} keys={nkeys}");
                let max = a.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                // weights far below the maximum too (down to exp's zero)
                a.iter_mut().enumerate().for_each(|(k, s)| *s -= (k % 4) as f32 * 30.0);
                b.clone_from(&a);
                assert_eq!(Avx2::softmax_weights(&mut a, max), Portable::softmax_weights(&mut b, max), "sum d={d}");
                assert_eq!(a, b, "weights d={d} keys={nkeys}");
                let (mut x, mut y) = (vec![f32::NAN; d], vec![f32::NAN; d]);
                Avx2::weighted_sum(&a, &plane, &keys, &mut x);
                Portable::weighted_sum(&a, &plane, &keys, &mut y);
                assert_eq!(x, y, "weighted sum d={d} keys={nkeys}");
            }
            // SwiGLU: two rows of `d` gates and ups, gates across exp's whole range
            let gu: Vec<f32> = (0..4 * d).map(|i| ((i * 37) as f32 * 0.17).sin() * 40.0).collect();
            let (mut x, mut y) = (vec![f32::NAN; 2 * d], vec![f32::NAN; 2 * d]);
            Avx2::silu_mul(&gu, d, &mut x);
            Portable::silu_mul(&gu, d, &mut y);
            assert_eq!(x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "silu d={d}");
        }
    }
}
