//! Attention's two inner loops in two builds that give the same bits: portable loops, and AVX2
//! intrinsics. Both define each value by one fixed order of f32 operations:
//!
//! - a score is `ops::dot(q, k) * scale`: lane `i` accumulates `acc[i] += q[8j + i] * k[8j + i]`
//!   (a multiply, then an add: never fused), the lanes meet in [`ops::reduce`]'s tree, then the
//!   tail is added in order;
//! - a weighted sum is, per element, `0 + p[0] v[0][i] + p[1] v[1][i] + ...`, keys in order.
//!
//! The AVX2 build only changes what runs side by side: eight keys' dot products at once (their
//! lanes transposed so the eight reductions are vector adds of the same tree), and a head's
//! outputs kept in registers across all its keys (eight independent chains of adds, instead of
//! a load and a store of the output per key).
//!
//! Why intrinsics: the portable loops are what the compiler vectorizes poorly (measured on an
//! Intel Xeon, 2026-12-03: SmolLM2's attention over 160 keys took 30 us a layer either way).

use super::ops::{self, LANES};

/// The kernels one attention build uses. `keys[k]` is where key `k` starts in its plane; every
/// key has `q.len()` (or `out.len()`) floats there.
pub trait Lanes {
    /// `out[k] = ops::dot(q, K[k]) * scale` for every key.
    fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]);
    /// `out[i] = sum over k in order of p[k] * V[k][i]`, starting from 0.
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]);
}

pub struct Portable;

impl Lanes for Portable {
    #[inline(always)]
    fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]) {
        let d = q.len();
        for (&k, o) in keys.iter().zip(out.iter_mut()) {
            *o = ops::dot(q, &plane[k..][..d]) * scale;
        }
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]) {
        let d = out.len();
        out.fill(0.0);
        for (&k, &pk) in keys.iter().zip(p) {
            ops::axpy(out, pk, &plane[k..][..d]);
        }
    }
}

/// AVX2 builds of the same kernels. Only `attention::attend_group_avx2` uses this type, and only
/// `Simd::Avx2` calls that, which is chosen where the CPU runs AVX2.
#[cfg(target_arch = "x86_64")]
pub struct Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ops, LANES};

    /// Lane `k` of the result is `ops::reduce` of `acc[k]`: the 8 x 8 transpose puts lane `j` of
    /// every accumulator in vector `t[j]`, then the tree's adds run on whole vectors.
    ///
    /// # Safety
    /// The CPU runs AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn reduce8(acc: [__m256; 8]) -> __m256 {
        // rows a..h = acc[0..8]; standard unpack / shuffle / permute transpose
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
        // c[j] holds lane j of every accumulator, accumulator k in lane k
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
    /// The CPU runs AVX2; `keys[k] + q.len() <= plane.len()` for every key; `out.len() >= keys.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]) {
        let d = q.len();
        let n = d / LANES * LANES;
        let (qp, pp) = (q.as_ptr(), plane.as_ptr());
        let scale_v = _mm256_set1_ps(scale);
        let eights = keys.len() / 8 * 8;
        for (ks, os) in keys[..eights].chunks_exact(8).zip(out.chunks_exact_mut(8)) {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..n).step_by(LANES) {
                // SAFETY: c + 8 <= n <= d, and each key's d floats lie inside `plane` (contract).
                unsafe {
                    let x = _mm256_loadu_ps(qp.add(c));
                    for (a, &k) in acc.iter_mut().zip(ks) {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(x, _mm256_loadu_ps(pp.add(k + c))));
                    }
                }
            }
            // SAFETY: AVX2 (this function's contract).
            let mut s = unsafe { reduce8(acc) };
            for i in n..d {
                // the tail in order, lane k for key k (as `ops::dot` adds it after the tree)
                let kv = _mm256_setr_ps(plane[ks[0] + i], plane[ks[1] + i], plane[ks[2] + i], plane[ks[3] + i],
                                        plane[ks[4] + i], plane[ks[5] + i], plane[ks[6] + i], plane[ks[7] + i]);
                s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_set1_ps(q[i]), kv));
            }
            // SAFETY: `os` holds 8 floats.
            unsafe { _mm256_storeu_ps(os.as_mut_ptr(), _mm256_mul_ps(s, scale_v)) };
        }
        for (&k, o) in keys[eights..].iter().zip(&mut out[eights..]) {
            *o = ops::dot(q, &plane[k..][..d]) * scale;
        }
    }

    /// # Safety
    /// The CPU runs AVX2; `keys[k] + out.len() <= plane.len()` for every key; `p.len() >= keys.len()`.
    #[target_feature(enable = "avx2")]
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
            let mut s = 0.0;
            for (&k, &pk) in keys.iter().zip(p) {
                s += pk * plane[k + i];
            }
            *o = s;
        }
    }

    /// Outputs `c0 .. c0 + 8W` over every key.
    ///
    /// # Safety
    /// AVX2; `c0 + 8W <= out.len()` and every key's floats `c0 .. c0 + 8W` inside the plane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn chunk<const W: usize>(p: &[f32], pp: *const f32, keys: &[usize], c0: usize, out: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); W];
        for (&k, &pk) in keys.iter().zip(p) {
            let pv = _mm256_set1_ps(pk);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: the function's contract.
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, unsafe { _mm256_loadu_ps(pp.add(k + c0 + 8 * j)) }));
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
    fn scores(q: &[f32], plane: &[f32], keys: &[usize], scale: f32, out: &mut [f32]) {
        assert!(out.len() >= keys.len() && keys.iter().all(|&k| k + q.len() <= plane.len()));
        // SAFETY: see the type's docs (AVX2 was detected); the bounds were just checked.
        unsafe { avx2::scores(q, plane, keys, scale, out) }
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], plane: &[f32], keys: &[usize], out: &mut [f32]) {
        assert!(p.len() >= keys.len() && keys.iter().all(|&k| k + out.len() <= plane.len()));
        // SAFETY: as above.
        unsafe { avx2::weighted_sum(p, plane, keys, out) }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn avx2_gives_the_portable_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        for d in [1, 7, 8, 13, 64, 67, 128, 200] {
            for nkeys in [1, 5, 8, 9, 17, 40] {
                let plane: Vec<f32> = (0..(nkeys + 3) * 211).map(|i| ((i * 31 + 7) as f32 * 0.13).sin()).collect();
                // scattered, out of order, some repeated
                let keys: Vec<usize> = (0..nkeys).map(|k| (k * 7 % (nkeys + 3)) * 211 + (k % 3)).collect();
                let q: Vec<f32> = (0..d).map(|i| ((i * 17) as f32 * 0.21).cos()).collect();
                let (mut a, mut b) = (vec![0f32; nkeys], vec![0f32; nkeys]);
                Avx2::scores(&q, &plane, &keys, 0.37, &mut a);
                Portable::scores(&q, &plane, &keys, 0.37, &mut b);
                assert_eq!(a, b, "scores d={d} keys={nkeys}");
                let (mut x, mut y) = (vec![f32::NAN; d], vec![f32::NAN; d]);
                Avx2::weighted_sum(&a, &plane, &keys, &mut x);
                Portable::weighted_sum(&a, &plane, &keys, &mut y);
                assert_eq!(x, y, "weighted sum d={d} keys={nkeys}");
            }
        }
    }
}
