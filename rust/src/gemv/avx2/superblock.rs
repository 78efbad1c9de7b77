//! The AVX2 kernel for the super-block formats Q4_K, Q5_K and IQ4_XS (`tile_rows_k`): a super-block of
//! 256 weights at a time, each of its 8 sub-blocks through the integer sums of the block-of-32 format
//! it extends (`q4_sums`, `q5_sums`, `iq4_sums` in `mod.rs`).
//!
//! Q4_K (`tile_rows_k`): a super-block at a time, its `d` and `dmin` converted once, then each
//! of its 8 sub-blocks is Q4_1's block (the same nibble sums, `q4_sums`) with the scale `d * sc`
//! and minimum `dmin * m` from two widened bytes a lane; the prefetch asks for a sub-block's share
//! of the stream (2368 / 8 bytes) per sub-block. Streaming a 4096 x 14336 matrix at M = 1 it took
//! 1.77-2.19 ms a product (15.5-19.2 GB/s of its 148 bytes a row per 256 weights) against Q4_1's
//! 1.90-2.55 ms (160 bytes), the format Q4_K tensors were converted to before; from the cache
//! (1536 x 768) 9.8-11.6 ns a (row, 16 x 32 tile block) at M = 1 against Q4_1's 8.9-9.2, and
//! 7.3-8.7 against 7.0-7.4 at M = 8 (AMD EPYC Zen 3, 2 cores, noisy; `cargo bench --bench
//! gemv_rows -- avx2 1 1 4096x14336 q4_k,q4_1,q6_k,q8_0` and `-- avx2 1 1,2,4,8 1536x768 q4_k,q4_1`).
//!
//! Q5_K (`tile_rows_k` too): Q4_K's steps over 5-bit codes (`q5_sums`: eight vectors of codes
//! unpacked from five, `pack.rs`, each half of a block summed apart in 16 bits). Streaming a 4096 x
//! 14336 matrix at M = 1 it took 2.14 ms a product (19.3 GB/s of its 180 bytes a row per 256
//! weights) against Q8_0's 3.13 ms (272 bytes; the format Q5_K tensors were converted to before)
//! and Q4_K's 1.69 ms in the same run; from the cache (1536 x 768) 13.7 ns a (row, 16 x 32 tile
//! block) at M = 1 against Q4_K's 9.7 and Q8_0's 12.6, 8.1 against 7.3 and 13.8 at M = 8 (AMD EPYC
//! Zen 3, 2 cores, noisy; `cargo bench --bench gemv_rows -- avx2 1 1 4096x14336 q5_k,q4_k,q8_0`
//! and `-- avx2 1 1,4,8 1536x768 q5_k,q4_k,q8_0`).
//!
//! IQ4_XS (`tile_rows_k`): Q4_K's steps over super-blocks, `d` converted once, each sub-block
//! IQ4_NL's (`iq4_sums`) with the scale `d * (ls - 32)` from a sign-extended byte a lane and no
//! minimum. Streaming a 4096 x 14336 matrix at M = 1 it took 1.97 ms a product (16.0 GB/s of its 138
//! bytes a row per 256 weights) against Q8_0's 4.01 ms (272 bytes; the format IQ4_XS tensors were
//! converted to before) and Q4_K's 1.85 ms in the same run; from the cache 19.3 ns a (row, tile block)
//! against Q4_K's 16.6 and Q8_0's 35.7 (AMD EPYC Zen 3, 2 cores under another session's load, the
//! cache numbers twice this kernel's others; `cargo bench --bench gemv_rows -- avx2 1 1 4096x14336
//! iq4_xs,q4_k,q8_0`).

use std::arch::x86_64::*;

use super::super::format::{Format, Q4_K_SUBS};
use super::super::pack::{
    IQ4_XS_CODES, IQ4_XS_SC, Q4_K_CODES, Q4_K_DMIN, Q4_K_M, Q4_K_SC, Q4_K_SUB_CODES, Q5_SUB_CODES, TILE,
};
use super::super::prefetch::{avx2_distance, prefetch_ahead};
use super::super::quantize::QuantizedActs;
use super::{iq4_sums, q4_sums, q5_sums, store_rows, HALF};

/// The format of `tile_rows_k`'s constant `F`.
const K_FORMATS: [Format; 3] = [Format::Q4K, Format::Q5K, Format::IQ4XS];

/// Rows `m0 .. m0 + R` of `super::tile`'s contract for Q4_K, Q5_K or IQ4_XS (`K_FORMATS[F]`; `NH`
/// as `tile_rows`, `blocks32.rs`): super-blocks in order, `d` and `dmin` converted once each, then their 8 sub-blocks
/// (activation blocks `8t + u`), each Q4_1's integer sums (`q4_sums`, or `q5_sums` of the 5-bit codes)
/// and float steps with `d * sc_u` and `-(dmin * m_u)` (exact, as `scalar.rs`; the negation folded
/// into `fnmadd`, which rounds `-(a b) + c` once as `fma(-a, b, c)` does). IQ4_XS: `iq4_sums` and
/// IQ4_NL's one float step with `d * (ls_u - 32)` (its signed scale bytes widened with sign; exact).
///
/// # Safety
/// As `super::tile`, `m0 + R <= acts.m`, `NH` is 1 or 2, and `blocks` a multiple of 8.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn tile_rows_k<const R: usize, const F: usize, const NH: usize>(tile: &[u8], blocks: usize,
                                                                                  acts: &QuantizedActs, m0: usize,
                                                                                  out: &mut [f32]) {
    let format = K_FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let xs = format == Format::IQ4XS;
    let (sc_off, codes_off, sub_codes) = match format {
        Format::Q5K => (Q4_K_SC, Q4_K_CODES, Q5_SUB_CODES),
        Format::IQ4XS => (IQ4_XS_SC, IQ4_XS_CODES, Q4_K_SUB_CODES),
        _ => (Q4_K_SC, Q4_K_CODES, Q4_K_SUB_CODES),
    };
    let sub = tbb / Q4_K_SUBS; // the stream's share of a sub-block, for the prefetch
    for pass in 0..2 / NH {
        let mut acc = [[_mm256_setzero_ps(); NH]; R];
        for t in 0..blocks / Q4_K_SUBS {
            // SAFETY: t < blocks / 8, so the super-block's `tbb` bytes lie in `tile`; every half h =
            // pass * NH + j < 2 and every ab = (m0 + r) * blocks + 8t + u < m * blocks, so every read
            // stays inside the slices whose lengths the caller guarantees; all loads are unaligned.
            unsafe {
                let sb = tile.as_ptr().add(t * tbb);
                // a half's 8 f16 at `off` as f32 (macros: closures lose the target features)
                macro_rules! halves {
                    ($off:expr) => {{
                        let mut v = [_mm256_setzero_ps(); NH];
                        for (j, v) in v.iter_mut().enumerate() {
                            *v = _mm256_cvtph_ps(_mm_loadu_si128(sb.add($off + (pass * NH + j) * 2 * HALF) as *const __m128i));
                        }
                        v
                    }};
                }
                let (d, dmin) = (halves!(0), if xs { [_mm256_setzero_ps(); NH] } else { halves!(Q4_K_DMIN) });
                for u in 0..Q4_K_SUBS {
                    if m0 == 0 && pass == 0 {
                        prefetch_ahead(sb.add(u * sub), sub, avx2_distance(R)); // the first pass streams the weights
                    }
                    let b = t * Q4_K_SUBS + u;
                    let codes = sb.add(codes_off + sub_codes * u);
                    let isum = match format {
                        Format::Q5K => q5_sums::<R, NH>(codes, pass, acts, m0, blocks, b),
                        Format::IQ4XS => iq4_sums::<R, NH>(codes, pass, acts, m0, blocks, b),
                        _ => q4_sums::<R, NH>(codes, pass, acts, m0, blocks, b),
                    };
                    // half h's 8 bytes (scales or minima of sub-block u; IQ4_XS's scales signed) as f32
                    macro_rules! bytes {
                        ($off:expr, $h:expr) => {{
                            let v = _mm_loadl_epi64(sb.add($off + TILE * u + $h * HALF) as *const __m128i);
                            _mm256_cvtepi32_ps(if xs { _mm256_cvtepi8_epi32(v) } else { _mm256_cvtepu8_epi32(v) })
                        }};
                    }
                    for j in 0..NH {
                        let h = pass * NH + j;
                        let dw = _mm256_mul_ps(d[j], bytes!(sc_off, h));
                        let mw = if xs { _mm256_setzero_ps() } else { _mm256_mul_ps(dmin[j], bytes!(Q4_K_M, h)) };
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let ab = (m0 + r) * blocks + b;
                            let s = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(ab)));
                            acc[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(isum[r][j]), acc[j]);
                            if !xs {
                                acc[j] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(*acts.dsum.get_unchecked(ab)), acc[j]);
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: `out` holds `acts.m * 16 >= (m0 + R) * 16` floats (the caller's contract).
        unsafe { store_rows(&acc, pass, m0, out) };
    }
}
