//! The AVX2 kernel (`vpmaddubsw`): one 16-row tile as two halves of 8 lanes.
//!
//! Q4: nibbles (0..15, unsigned) times activations (int8) with `maddubs`; a lane's 16-bit
//! sums stay below 4 * 2 * 2 * 15 * 127 = 30480 over a block, so no saturation, then one
//! `madd` by ones into 32 bits. Q8_0: `maddubs(|w|, sign(a, w))` (at most 2 * 128 * 127 =
//! 32512 per pair), widened after each vector. Float steps as in `scalar.rs`.

use std::arch::x86_64::*;

use super::format::{Format, QK};
use super::pack::TILE;
use super::quantize::QuantizedActs;

/// Whether this CPU can run the kernel (AVX2 for the integer part, F16C for the scales, FMA for
/// the float steps).
pub fn supported() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") && is_x86_feature_detected!("fma")
}

/// Same contract as `scalar::tile`.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA (`supported()`), `tile.len() >= blocks * 16 *
/// format.block_bytes()`, `acts.qs.len() >= acts.m * blocks * 32`, `acts.{d,sum,dsum}.len()
/// >= acts.m * blocks` and `out.len() >= acts.m * 16`.
#[target_feature(enable = "avx2,f16c,fma")]
pub unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let tbb = TILE * format.block_bytes();
    let qoff = if format.has_min() { 4 * TILE } else { 2 * TILE };
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0x0f);
    for mi in 0..acts.m {
        let mut acc = [_mm256_setzero_ps(); 2];
        for b in 0..blocks {
            let ab = mi * blocks + b;
            // SAFETY: b < blocks and ab < m * blocks, so every offset below stays inside the
            // slices whose lengths the caller guarantees (see `# Safety`); loads are unaligned.
            unsafe {
                let blk = tile.as_ptr().add(b * tbb);
                let q = blk.add(qoff);
                let a = acts.qs.as_ptr().add(ab * QK);
                // Four activation bytes broadcast to every lane (a macro: closures lose the target features).
                macro_rules! bc {
                    ($i:expr) => {
                        _mm256_set1_epi32((a.add($i) as *const i32).read_unaligned())
                    };
                }
                let mut isum = [_mm256_setzero_si256(); 2];
                match format {
                    Format::Q4_0 | Format::Q4_1 => {
                        let mut s16 = [_mm256_setzero_si256(); 2];
                        for v in 0..4 {
                            let (alo, ahi) = (bc!(8 * v), bc!(8 * v + 4));
                            for (h, s16) in s16.iter_mut().enumerate() {
                                let raw = _mm256_loadu_si256(q.add(v * 64 + h * 32) as *const __m256i);
                                let lo = _mm256_and_si256(raw, low);
                                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                                let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
                                *s16 = _mm256_add_epi16(*s16, p);
                            }
                        }
                        for h in 0..2 {
                            isum[h] = _mm256_madd_epi16(s16[h], ones);
                        }
                        if format == Format::Q4_0 {
                            let off = _mm256_set1_epi32(8 * *acts.sum.get_unchecked(ab));
                            for s in isum.iter_mut() {
                                *s = _mm256_sub_epi32(*s, off);
                            }
                        }
                    }
                    Format::Q8_0 => {
                        for v in 0..8 {
                            let av = bc!(4 * v);
                            for (h, s) in isum.iter_mut().enumerate() {
                                let w = _mm256_loadu_si256(q.add(v * 64 + h * 32) as *const __m256i);
                                let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(av, w));
                                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
                            }
                        }
                    }
                }
                let da = _mm256_set1_ps(*acts.d.get_unchecked(ab));
                for h in 0..2 {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(h * 16) as *const __m128i));
                    let s = _mm256_mul_ps(dw, da);
                    acc[h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(isum[h]), acc[h]);
                }
                if format == Format::Q4_1 {
                    let dsum = _mm256_set1_ps(*acts.dsum.get_unchecked(ab));
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * TILE + h * 16) as *const __m128i));
                        *acc = _mm256_fmadd_ps(mw, dsum, *acc);
                    }
                }
            }
        }
        let o = &mut out[mi * TILE..(mi + 1) * TILE];
        // SAFETY: `o` has exactly 16 f32, room for two unaligned 8-lane stores.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), acc[1]);
        }
    }
}
