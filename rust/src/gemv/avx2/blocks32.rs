//! The AVX2 kernel for the formats of blocks of 32 weights: Q4_0, Q4_1, Q8_0, Q6_K, Q5_0, Q5_1 and
//! IQ4_NL (`tile_rows`, one instance per format and row count; `q4_sums`, `q5_sums` and `iq4_sums`,
//! which the super-block formats share, in `mod.rs`).
//!
//! Q4: nibbles (0..15, unsigned) times activations (int8) with `maddubs`; a lane's 16-bit
//! sums stay below 4 * 2 * 2 * 15 * 127 = 30480 over a block, so no saturation, then one
//! `madd` by ones into 32 bits. Q8_0: `maddubs(|w|, sign(a, w))` (at most 2 * 128 * 127 =
//! 32512 per pair), widened after each vector. Q6_K: the unsigned q (0..63) times activations,
//! two vectors summed in 16 bits (at most 4 * 63 * 127 = 32004), then `madd` by the lane's group
//! scale (in both 16-bit halves) into 32 bits; `32 * (sc_0 * sum_0 + sc_1 * sum_1)` (one `madd` of
//! the scale pair by the activations' two group sums) subtracted per block makes it `T` of
//! `scalar.rs` exactly: every partial sum is an exact int32. (The sign trick of Q8_0 on `q - 32`
//! costs an `abs`, a `sub` per vector and a `sign` per vector and row more.) Float steps as in
//! `scalar.rs`. Q6_K does the most work a byte (its unpacking, `pack.rs`): at M = 1 from the cache
//! 14.1 ns a tile block (1536 x 768) against Q8_0's 12.1 and Q4_1's 8.9 (1536 x 576); streaming a
//! 4096 x 14336 matrix 2.5-2.9 ms a product (17.6-20.9 GB/s) against Q8_0's 3.0-3.5 ms, the format
//! Q6_K tensors were converted to before (AMD EPYC Zen 3, 2 cores, noisy; `cargo bench --bench
//! gemv_rows -- avx2 1 1 4096x14336 q6_k,q8_0,q4_1`). Its prefetch distance is the others' (2048
//! bytes at one row): 1024 streamed 15.5-16.3 GB/s, 3072 and 4096 were within the noise of 2048.
//!
//! Q5_0 (`tile_rows`): Q4_0's steps over the same 5-bit codes (`q5_sums`), minus `16 * sum` for
//! `q - 16`. A 4096 x 4096 product at M = 1 took 0.66 ms (17.6 GB/s of its 22 bytes a row per 32
//! weights) against Q8_0's 0.97 ms (34 bytes; the format Q5_0 tensors were converted to before) and
//! Q4_0's 0.55 ms in the same run; from the cache (1536 x 768) 12.5 ns a (row, tile block) at M = 1
//! against Q4_0's 8.7, 8.6 against 7.0 at M = 8 (same machine; `cargo bench --bench gemv_rows --
//! avx2 1 1 4096x4096 q5_0,q4_0,q8_0` and `-- avx2 1 1,8 1536x768 q5_0,q4_0`). Q5_1: Q4_1's steps
//! over the same sums, 0.70 ms (17.9 GB/s of 24 bytes a row per 32 weights) against Q5_0's 0.59,
//! Q4_0's 0.54, Q4_1's 0.73 and Q8_0's 1.07 in another run (two other sessions' loads on the 2 cores;
//! `-- avx2 1 1 4096x4096 q5_0,q5_1,q4_0,q4_1`).
//!
//! IQ4_NL (`tile_rows`, `iq4_sums`): the nibbles (Q4_0's layout) looked up in the int8 table with
//! one `pshufb` a vector of 32 codes (the 16 values in each 128-bit lane), then Q8_0's signed
//! products: `maddubs(|w|, sign(a, w))` (at most 2 * 127 * 127 = 32258 a 16-bit lane, no saturation),
//! widened after each vector, and Q8_0's float step. A half-tile's 8 code vectors cost 12 ops to
//! unpack, 8 `pshufb` and 8 `abs` for all rows, and a `sign`, `maddubs`, `madd` and `add` a vector and
//! row, Q8_0's per-row work. A 4096 x 4096 product at M = 1 took 0.59 ms (15.9 GB/s of its 18 bytes a
//! row per 32 weights) against Q8_0's 1.16 ms (34 bytes; the format IQ4_NL tensors were converted to
//! before) and Q4_0's 0.64 ms in the same run; from the cache 14.6 ns a (row, tile block) against
//! Q4_0's 9.8 and Q8_0's 18.9 (AMD EPYC Zen 3, 2 cores, another session's load on them; `cargo bench
//! --bench gemv_rows -- avx2 1 1 4096x4096 iq4_nl,q4_0,q8_0`).

use std::arch::x86_64::*;

use super::super::format::{Format, QK};
use super::super::pack::TILE;
use super::super::prefetch::{avx2_distance, prefetch_ahead};
use super::super::quantize::QuantizedActs;
use super::{iq4_sums, q4_sums, q5_sums, store_rows, HALF};

/// The format of `tile_rows`'s constant `F`.
const FORMATS: [Format; 7] =
    [Format::Q4_0, Format::Q4_1, Format::Q8_0, Format::Q6K, Format::Q5_0, Format::Q5_1, Format::IQ4NL];

/// Rows `m0 .. m0 + R` of `super::tile`'s contract, for the format `FORMATS[F]`, `NH` halves of the tile
/// per pass over it (2: one pass; 1: two, so that more rows' sums fit the registers). Per row and
/// lane the f32 operations are those of `scalar::tile`, in the same order: only the weights' loads
/// and unpacking are shared between rows.
///
/// # Safety
/// As `super::tile`, `m0 + R <= acts.m`, and `NH` is 1 or 2.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn tile_rows<const R: usize, const F: usize, const NH: usize>(tile: &[u8], blocks: usize,
                                                                                acts: &QuantizedActs, m0: usize,
                                                                                out: &mut [f32]) {
    let format = FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let qoff = TILE * format.header_bytes();
    let ones = _mm256_set1_epi16(1);
    for pass in 0..2 / NH {
        let mut acc = [[_mm256_setzero_ps(); NH]; R];
        for b in 0..blocks {
            // SAFETY: b < blocks, every half h = pass * NH + j < 2 and every ab = mi * blocks + b <
            // m * blocks (mi < m0 + R <= m), so every offset below stays inside the slices whose
            // lengths the caller guarantees (see `super::tile`'s `# Safety`); all loads are unaligned.
            unsafe {
                let blk = tile.as_ptr().add(b * tbb);
                if m0 == 0 && pass == 0 {
                    prefetch_ahead(blk, tbb, avx2_distance(R)); // the first pass streams the weights
                }
                // Four activation bytes of row r broadcast to every lane (a macro: closures lose
                // the target features).
                macro_rules! bc {
                    ($r:expr, $i:expr) => {
                        _mm256_set1_epi32((acts.qs.as_ptr().add(((m0 + $r) * blocks + b) * QK + $i) as *const i32).read_unaligned())
                    };
                }
                let mut isum = [[_mm256_setzero_si256(); NH]; R];
                match format {
                    Format::Q4_0 | Format::Q4_1 => {
                        isum = q4_sums::<R, NH>(blk.add(qoff), pass, acts, m0, blocks, b);
                        if format == Format::Q4_0 {
                            for (r, isum) in isum.iter_mut().enumerate() {
                                let ab = (m0 + r) * blocks + b;
                                for s in isum.iter_mut() {
                                    *s = _mm256_sub_epi32(*s, _mm256_set1_epi32(8 * *acts.sum.get_unchecked(ab)));
                                }
                            }
                        }
                    }
                    Format::Q5_0 | Format::Q5_1 => {
                        isum = q5_sums::<R, NH>(blk.add(qoff), pass, acts, m0, blocks, b);
                        if format == Format::Q5_0 {
                            for (r, isum) in isum.iter_mut().enumerate() {
                                let ab = (m0 + r) * blocks + b;
                                for s in isum.iter_mut() {
                                    *s = _mm256_sub_epi32(*s, _mm256_set1_epi32(16 * *acts.sum.get_unchecked(ab)));
                                }
                            }
                        }
                    }
                    Format::IQ4NL => isum = iq4_sums::<R, NH>(blk.add(qoff), pass, acts, m0, blocks, b),
                    Format::Q8_0 => {
                        for v in 0..8 {
                            for j in 0..NH {
                                let h = pass * NH + j;
                                let w = _mm256_loadu_si256(blk.add(qoff + v * 64 + h * 32) as *const __m256i);
                                let aw = _mm256_abs_epi8(w);
                                for (r, s) in isum.iter_mut().enumerate() {
                                    let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bc!(r, 4 * v), w));
                                    s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(p, ones));
                                }
                            }
                        }
                    }
                    Format::Q6K => {
                        for j in 0..NH {
                            let h = pass * NH + j;
                            let (pair, sc) = scale_pairs!(blk.add(2 * TILE + h * 2 * HALF));
                            for (g, &sc) in sc.iter().enumerate() {
                                let w = unpack_q6_k(blk.add(qoff + 3 * g * 64 + h * 32));
                                for (r, s) in isum.iter_mut().enumerate() {
                                    let p01 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bc!(r, 16 * g)),
                                                               _mm256_maddubs_epi16(w[1], bc!(r, 16 * g + 4)));
                                    let p23 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bc!(r, 16 * g + 8)),
                                                               _mm256_maddubs_epi16(w[3], bc!(r, 16 * g + 12)));
                                    let t = _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc));
                                    s[j] = _mm256_add_epi32(s[j], t);
                                }
                            }
                            for (r, s) in isum.iter_mut().enumerate() {
                                // the activations' group sums (|sum| <= 16 * 127) as an int16 pair
                                let ab = (m0 + r) * blocks + b;
                                let lo = *acts.sum_lo.get_unchecked(ab);
                                let hi = *acts.sum.get_unchecked(ab) - lo;
                                let sums = _mm256_set1_epi32((hi << 16) | (lo & 0xffff));
                                s[j] = _mm256_sub_epi32(s[j], _mm256_slli_epi32(_mm256_madd_epi16(pair, sums), 5));
                            }
                        }
                    }
                    Format::Q4K | Format::Q5K | Format::IQ4XS => unreachable!("tile_rows_k computes the super-blocks"),
                    Format::Q3K => unreachable!("tile_rows_q3_k computes Q3_K"),
                }
                for j in 0..NH {
                    let h = pass * NH + j;
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(h * 2 * HALF) as *const __m128i));
                    let mw = if format.has_min() {
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * TILE + h * 2 * HALF) as *const __m128i))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let ab = (m0 + r) * blocks + b;
                        let s = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(ab)));
                        acc[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(isum[r][j]), acc[j]);
                        if format.has_min() {
                            acc[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*acts.dsum.get_unchecked(ab)), acc[j]);
                        }
                    }
                }
            }
        }
        // SAFETY: `out` holds `acts.m * 16 >= (m0 + R) * 16` floats (the caller's contract).
        unsafe { store_rows(&acc, pass, m0, out) };
    }
}

/// One Q6_K group's three packed vectors at `p` (8 lanes, one every 64 bytes; `pack.rs`) as its four
/// vectors of q (0..63): elements `4u + i` of the group in vector `u`, Q8_0's order.
///
/// # Safety
/// AVX2; `p`, `p + 64` and `p + 128` readable for 32 bytes each.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_q6_k(p: *const u8) -> [__m256i; 4] {
    // SAFETY: the caller's contract; all loads unaligned.
    let raw = unsafe {
        [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(64) as *const __m256i),
         _mm256_loadu_si256(p.add(128) as *const __m256i)]
    };
    let low6 = _mm256_set1_epi8(0x3f);
    // the fourth vector's bits 0-1, 2-3, 4-5 are the top bit pairs of the three (16-bit shifts:
    // what moves in from the next byte is masked off)
    let top = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw[0], 6), _mm256_set1_epi8(0x03)),
                        _mm256_and_si256(_mm256_srli_epi16(raw[1], 4), _mm256_set1_epi8(0x0c))),
        _mm256_and_si256(_mm256_srli_epi16(raw[2], 2), _mm256_set1_epi8(0x30)));
    [_mm256_and_si256(raw[0], low6), _mm256_and_si256(raw[1], low6), _mm256_and_si256(raw[2], low6), top]
}
