//! The attention's inner products in two builds that give the same bits: portable loops over
//! 8-lane arrays, and AVX2 intrinsics over one 8-lane vector. Both accumulate lane `i` as
//! `acc[i] += a[8j + i] * b[8j + i]` (a multiply, then an add: never fused), reduce the lanes
//! with [`ops::reduce`], then add the tail in order.
//!
//! Why intrinsics: the portable loops are what the compiler vectorizes poorly (measured on an
//! Intel Xeon, 2026-12-03: SmolLM2's attention over 160 keys took 30 us a layer either way).

use super::ops::{self, LANES};

/// The kernels one attention build uses.
pub trait Lanes {
    /// `sum(a[i] * b[i])`, in `ops::dot`'s order.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// Four `dot`s sharing `a`.
    fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4];
    /// `out[i] += p[0] v[0][i]; out[i] += p[1] v[1][i]; ...` (one key after another, per element).
    fn axpy4(out: &mut [f32], p: [f32; 4], v: [&[f32]; 4]);
}

pub struct Portable;

impl Lanes for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        ops::dot(a, b)
    }
    #[inline(always)]
    fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        b.map(|b| ops::dot(a, b))
    }
    #[inline(always)]
    fn axpy4(out: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
        let len = out.len();
        let v = v.map(|v| &v[..len]);
        for i in 0..len {
            let mut o = out[i];
            o += p[0] * v[0][i];
            o += p[1] * v[1][i];
            o += p[2] * v[2][i];
            o += p[3] * v[3][i];
            out[i] = o;
        }
    }
}

/// AVX2 builds of the same kernels. Only `attention::attend_one_avx2` uses this type, and only
/// `Simd::Avx2` calls that, which is chosen where the CPU runs AVX2.
#[cfg(target_arch = "x86_64")]
pub struct Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ops, LANES};

    #[inline]
    #[target_feature(enable = "avx2")]
    fn lanes(v: __m256) -> [f32; LANES] {
        let mut out = [0f32; LANES];
        // SAFETY: `out` holds 8 floats; storeu has no alignment requirement.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn tail(a: &[f32], b: &[f32], n: usize, mut s: f32) -> f32 {
        for (x, y) in a[n..].iter().zip(&b[n..]) {
            s += x * y;
        }
        s
    }

    /// # Safety
    /// The CPU runs AVX2; `b.len() >= a.len()`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len() / LANES * LANES;
        let b = &b[..a.len()];
        let mut acc = _mm256_setzero_ps();
        for c in (0..n).step_by(LANES) {
            // SAFETY: c + 8 <= n <= len of both slices.
            let (x, y) = unsafe { (_mm256_loadu_ps(a.as_ptr().add(c)), _mm256_loadu_ps(b.as_ptr().add(c))) };
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        tail(a, b, n, ops::reduce(lanes(acc)))
    }

    /// # Safety
    /// The CPU runs AVX2; every `b[t].len() >= a.len()`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        let len = a.len();
        let n = len / LANES * LANES;
        let b = b.map(|b| &b[..len]);
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in (0..n).step_by(LANES) {
            // SAFETY: c + 8 <= n <= len of every slice.
            unsafe {
                let x = _mm256_loadu_ps(a.as_ptr().add(c));
                for t in 0..4 {
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(x, _mm256_loadu_ps(b[t].as_ptr().add(c))));
                }
            }
        }
        let mut out = [0f32; 4];
        for t in 0..4 {
            out[t] = tail(a, b[t], n, ops::reduce(lanes(acc[t])));
        }
        out
    }

    /// # Safety
    /// The CPU runs AVX2; every `v[t].len() >= out.len()`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn axpy4(out: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
        let len = out.len();
        let n = len / LANES * LANES;
        let v = v.map(|v| &v[..len]);
        let pv = p.map(|p| _mm256_set1_ps(p));
        for c in (0..n).step_by(LANES) {
            // SAFETY: c + 8 <= n <= len of `out` and of every `v[t]`.
            unsafe {
                let mut o = _mm256_loadu_ps(out.as_ptr().add(c));
                for t in 0..4 {
                    o = _mm256_add_ps(o, _mm256_mul_ps(pv[t], _mm256_loadu_ps(v[t].as_ptr().add(c))));
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(c), o);
            }
        }
        for i in n..len {
            let mut o = out[i];
            for t in 0..4 {
                o += p[t] * v[t][i];
            }
            out[i] = o;
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: see the type's docs (AVX2 was detected); slices are re-sliced to a's length.
        unsafe { avx2::dot(a, b) }
    }
    #[inline(always)]
    fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        // SAFETY: as above.
        unsafe { avx2::dot4(a, b) }
    }
    #[inline(always)]
    fn axpy4(out: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
        // SAFETY: as above.
        unsafe { avx2::axpy4(out, p, v) }
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
        for n in [1, 7, 8, 13, 64, 67] {
            let v = |k: usize| -> Vec<f32> { (0..n).map(|i| ((i * 31 + k * 7) as f32 * 0.13).sin()).collect() };
            let (a, b) = (v(0), [v(1), v(2), v(3), v(4)]);
            let bs = [&b[0][..], &b[1][..], &b[2][..], &b[3][..]];
            assert_eq!(Avx2::dot(&a, &b[0]), Portable::dot(&a, &b[0]), "n={n}");
            assert_eq!(Avx2::dot4(&a, bs), Portable::dot4(&a, bs), "n={n}");
            let (mut x, mut y) = (v(9), v(9));
            Avx2::axpy4(&mut x, [0.3, -1.5, 2.0, 0.7], bs);
            Portable::axpy4(&mut y, [0.3, -1.5, 2.0, 0.7], bs);
            assert_eq!(x, y, "n={n}");
        }
    }
}
