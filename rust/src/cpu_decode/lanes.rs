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
//! Files: this one (the definitions, the portable build, the trait), `lanes/avx2.rs` (the AVX2 build),
//! `lanes/avx2/group.rs` (its passes of several heads over one KV head's keys).
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
    /// `out[i] = sum over k in order of p[k] * V[k][i]` (fused), starting from 0, or, with
    /// `accumulate`, from `out[i]`: the chain of an earlier call over the keys before these goes on
    /// (a sum over keys split into runs gives the bits of one call over them all).
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32], accumulate: bool);
    /// [`Lanes::scores`] of `G` query heads of `d` floats each (`q` is `[G, d]`) against the same keys:
    /// `out[g * stride + k]`, the bits of `scores` head by head (`stride >= keys.len()`).
    fn scores_group<const G: usize>(q: &[f32], d: usize, plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32],
                                    stride: usize);
    /// [`Lanes::weighted_sum`] of `G` heads' weights (head `g`'s at `p[g * stride..]`) over the same
    /// values into `out` `[G, d]`, the bits of `weighted_sum` head by head.
    fn weighted_sum_group<const G: usize>(p: &[f32], stride: usize, plane: &[f32], keys: &[usize], out: &mut [f32],
                                          accumulate: bool);

    /// `softmax_weights`' sum without writing the weights: `sum(exp(s[k] - max))`, the same bits.
    fn sum_exp(s: &[f32], max: f32) -> f32;
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
    fn sum_exp(s: &[f32], max: f32) -> f32 {
        let n = s.len() / LANES * LANES;
        let mut acc = [0f32; LANES];
        for c in s[..n].chunks_exact(LANES) {
            for i in 0..LANES {
                acc[i] += exp(c[i] - max);
            }
        }
        let mut sum = ops::reduce(acc);
        for &x in &s[n..] {
            sum += exp(x - max);
        }
        sum
    }
    #[inline(always)]
    fn scores_group<const G: usize>(q: &[f32], d: usize, plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32],
                                    stride: usize) {
        let n = keys.len();
        for (g, qg) in q.chunks_exact(d).take(G).enumerate() {
            Self::scores(qg, plane, keys, scale, &mut out[g * stride..][..n]);
        }
    }
    #[inline(always)]
    fn weighted_sum_group<const G: usize>(p: &[f32], stride: usize, plane: &[f32], keys: &[usize], out: &mut [f32],
                                          accumulate: bool) {
        let (n, d) = (keys.len(), out.len() / G);
        for (g, og) in out.chunks_exact_mut(d).take(G).enumerate() {
            Self::weighted_sum(&p[g * stride..][..n], plane, keys, og, accumulate);
        }
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32], accumulate: bool) {
        let d = out.len();
        if !accumulate {
            out.fill(0.0);
        }
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
mod avx2;

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
    fn sum_exp(s: &[f32], max: f32) -> f32 {
        // SAFETY: see the type's docs (AVX2 and FMA were detected).
        unsafe { avx2::sum_exp(s, max) }
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32], accumulate: bool) {
        assert!(p.len() >= keys.len() && keys.iter().all(|&k| k + out.len() <= plane.len()));
        // SAFETY: as above.
        unsafe { avx2::weighted_sum(p, plane, keys, out, accumulate) }
    }
    #[inline(always)]
    fn scores_group<const G: usize>(q: &[f32], d: usize, plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32],
                                    stride: usize) {
        let n = keys.len();
        assert!(q.len() >= G * d && stride >= n && out.len() >= (G - 1) * stride + n
                && keys.iter().all(|&k| k + d <= plane.len()));
        if G == 1 {
            return Self::scores(&q[..d], plane, keys, scale, out);
        }
        // SAFETY: see the type's docs (AVX2 and FMA were detected); the bounds were just checked.
        unsafe { avx2::scores_group::<G>(&q[..G * d], d, plane, keys, scale, out, stride) }
    }
    #[inline(always)]
    fn weighted_sum_group<const G: usize>(p: &[f32], stride: usize, plane: &[f32], keys: &[usize], out: &mut [f32],
                                          accumulate: bool) {
        let (n, d) = (keys.len(), out.len() / G);
        assert!(out.len() == G * d && stride >= n && p.len() >= (G - 1) * stride + n
                && keys.iter().all(|&k| k + d <= plane.len()));
        if G == 1 {
            return Self::weighted_sum(p, plane, keys, out, accumulate);
        }
        // SAFETY: as above.
        unsafe { avx2::weighted_sum_group::<G>(p, stride, plane, keys, out, accumulate) }
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

    /// Two and three heads over one KV head's keys, in one pass, against each head alone (portable).
    #[cfg(target_arch = "x86_64")]
    fn grouped_gives_each_heads_bits(d: usize, plane: &[f32], keys: &[usize]) {
        fn check<const G: usize>(d: usize, plane: &[f32], keys: &[usize]) {
            let n = keys.len();
            let q: Vec<f32> = (0..G * d).map(|i| ((i * 13) as f32 * 0.29).sin() * 2.5).collect();
            let (mut a, mut b) = (vec![f32::NAN; G * n], vec![f32::NAN; G * n]);
            Avx2::scores_group::<G>(&q, d, plane, keys, 0.41, &mut a, n);
            for (g, s) in b.chunks_exact_mut(n).enumerate() {
                Portable::scores(&q[g * d..(g + 1) * d], plane, keys, 0.41, s);
            }
            assert_eq!(a, b, "scores of {G} heads d={d} keys={n}");
            // weights of every size, exp's zero included
            let p: Vec<f32> = (0..G * n).map(|i| exp(-((i * 7 % 23) as f32) * 4.0)).collect();
            let (mut x, mut y) = (vec![f32::NAN; G * d], vec![f32::NAN; G * d]);
            Avx2::weighted_sum_group::<G>(&p, n, plane, keys, &mut x, false);
            for (g, o) in y.chunks_exact_mut(d).enumerate() {
                Portable::weighted_sum(&p[g * n..(g + 1) * n], plane, keys, o, false);
            }
            assert_eq!(x, y, "weighted sums of {G} heads d={d} keys={n}");
            Portable::weighted_sum_group::<G>(&p, n, plane, keys, &mut x, false);
            assert_eq!(x, y, "portable weighted sums of {G} heads d={d} keys={n}");
            // the keys in two runs, the second going on from the first's sums (`accumulate`), and
            // the scores of a run written at their place in the whole row (`stride`): the same bits
            let cut = n / 3;
            for avx in [true, false] {
                let (mut z, mut s) = (vec![f32::NAN; G * d], vec![f32::NAN; G * n]);
                for (lo, hi) in [(0, cut), (cut, n)] {
                    if avx {
                        Avx2::weighted_sum_group::<G>(&p[lo..], n, plane, &keys[lo..hi], &mut z, lo > 0);
                        Avx2::scores_group::<G>(&q, d, plane, &keys[lo..hi], 0.41, &mut s[lo..], n);
                    } else {
                        Portable::weighted_sum_group::<G>(&p[lo..], n, plane, &keys[lo..hi], &mut z, lo > 0);
                        Portable::scores_group::<G>(&q, d, plane, &keys[lo..hi], 0.41, &mut s[lo..], n);
                    }
                }
                assert_eq!(z, y, "weighted sums in two runs (avx2 {avx}), {G} heads d={d} keys={n}");
                assert_eq!(s, a, "scores in two runs (avx2 {avx}), {G} heads d={d} keys={n}");
            }
        }
        check::<2>(d, plane, keys);
        check::<3>(d, plane, keys);
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
                let sums = (Avx2::sum_exp(&a, max), Portable::sum_exp(&a, max));
                assert_eq!(sums.0.to_bits(), sums.1.to_bits(), "sum_exp d={d} keys={nkeys}");
                let weights_sum = Avx2::softmax_weights(&mut a, max);
                assert_eq!(weights_sum, Portable::softmax_weights(&mut b, max), "sum d={d}");
                assert_eq!(weights_sum.to_bits(), sums.0.to_bits(), "sum_exp is softmax_weights' sum d={d}");
                assert_eq!(a, b, "weights d={d} keys={nkeys}");
                let (mut x, mut y) = (vec![f32::NAN; d], vec![f32::NAN; d]);
                Avx2::weighted_sum(&a, &plane, &keys, &mut x, false);
                Portable::weighted_sum(&a, &plane, &keys, &mut y, false);
                assert_eq!(x, y, "weighted sum d={d} keys={nkeys}");
                grouped_gives_each_heads_bits(d, &plane, &keys);
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
