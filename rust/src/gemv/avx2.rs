//! The AVX2 kernel (`vpmaddubsw`): one 16-row tile as two halves of 8 lanes (one row per
//! 32-bit lane), up to four activation rows per pass over the tile.
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
//!
//! IQ4_XS (`tile_rows_k`): Q4_K's steps over super-blocks, `d` converted once, each sub-block
//! IQ4_NL's (`iq4_sums`) with the scale `d * (ls - 32)` from a sign-extended byte a lane and no
//! minimum. Streaming a 4096 x 14336 matrix at M = 1 it took 1.97 ms a product (16.0 GB/s of its 138
//! bytes a row per 256 weights) against Q8_0's 4.01 ms (272 bytes; the format IQ4_XS tensors were
//! converted to before) and Q4_K's 1.85 ms in the same run; from the cache 19.3 ns a (row, tile block)
//! against Q4_K's 16.6 and Q8_0's 35.7 (AMD EPYC Zen 3, 2 cores under another session's load, the
//! cache numbers twice this file's others; `cargo bench --bench gemv_rows -- avx2 1 1 4096x14336
//! iq4_xs,q4_k,q8_0`).
//!
//! Q3_K (`tile_rows_q3_k`): a block of 32 at a time, its super-block's `d` and its lane's scale
//! pair read per block, eight vectors of unsigned codes (0..7) unpacked from three (`unpack_q3_k`,
//! `pack.rs`), each `maddubs` the activations (at most 2 * 7 * 128 = 1792 a 16-bit lane), a group's
//! four summed in 16 bits onto `-4 * sum_g` (the activations' group sum, `sum_lo` or `sum - sum_lo`,
//! in the low half of each lane: at most 4 * 1792 + 4 * 16 * 128 = 15360, no overflow), then one `madd`
//! by the group's scale (in both halves) each: `sc_g * (sum_g(c a) - 4 sum_g(a))` = `sc_g * isum_g`,
//! and their sum is `T` of `scalar.rs` exactly. The offsets ride in the 16-bit sums (computed per
//! row inside the row loop: precomputed for all rows before it they spilled, and M = 4 cost 16.7 ns a
//! (row, tile block) instead of 9.6). Streaming a 4096 x 14336 matrix on 1 thread it took 2.20-2.52
//! ms a product at M = 1 (10.4-11.9 GB/s of its 114 bytes a row per 256 weights) against Q8_0's
//! 6.12-6.87 ms (272 bytes; the format Q3_K tensors were converted to before), Q4_K's 2.90-2.96 and
//! Q6_K's 4.86-4.87; at M = 4 4.61-5.03 ms against Q8_0's 8.14-8.80, Q4_K's 4.96-5.37 and Q6_K's
//! 7.49-7.57; from the cache (1536 x 768) 13.7-14.3 ns a (row, tile block) at M = 1 against Q4_K's
//! 9.9-10.6 and Q8_0's 12.8-13.9, 9.5-9.6 against 7.3-7.5 and 10.2-10.9 at M = 4 (Intel Xeon, 2 cores
//! shared with two other builds, runs alternated; `cargo bench --bench gemv_rows -- avx2 1 1,4
//! 4096x14336 q3_k,q4_k,q6_k,q8_0` and `-- avx2 1 1,4,8 1536x768 q3_k,q4_k,q8_0`). Its prefetch asks
//! `prefetch::Q3_K_DISTANCE` (4096 bytes) ahead.
//!
//! Why this shape (AMD EPYC Zen 3, 2026-12-06, `cargo bench --bench gemv_rows -- avx2`): the
//! first version multiplied one activation row at a time and asked for nothing ahead: at M = 1
//! it streamed 13.7 GB/s of Q4_1 from memory against 24 GB/s of read bandwidth, because the
//! multiply (35 GB/s from the cache) and the loads did not overlap; and each further row
//! reloaded and unpacked every weight again. Now the weight stream is prefetched (`prefetch`)
//! and a pass over the tile serves up to four rows, each weight vector unpacked once for all of
//! them. From three rows on the tile's two halves run as two passes (the second from L1), so
//! that each row's accumulator and 16-bit sums fit AVX2's 16 registers.

use std::arch::x86_64::*;

use super::format::{Format, IQ4NL_VALUES, Q4_K_SUBS, QK};
use super::pack::{
    IQ4_XS_CODES, IQ4_XS_SC, Q3_K_CODES, Q3_K_SC, Q3_K_SUB_CODES, Q4_K_CODES, Q4_K_DMIN, Q4_K_M, Q4_K_SC,
    Q4_K_SUB_CODES, Q5_SUB_CODES, TILE,
};
use super::prefetch::{avx2_distance, prefetch_ahead, Q3_K_DISTANCE};
use super::quantize::QuantizedActs;

/// Whether this CPU can run the kernel (AVX2 for the integer part, F16C for the scales, FMA for
/// the float steps).
pub fn supported() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") && is_x86_feature_detected!("fma")
}

/// Activation rows multiplied together per pass over a tile (see the module docs).
const ROWS: usize = 4;

/// Lanes of one half of a tile: 8 rows, one per 32-bit lane of a ymm.
const HALF: usize = TILE / 2;

/// Same contract as `scalar::tile`.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA (`supported()`), `blocks` (of 32 weights) a multiple
/// of `format.kernel_block_weights() / 32`, `tile.len() >= blocks * 32 / format.kernel_block_weights()
/// * 16 * format.block_bytes()`, `acts.qs.len() >= acts.m * blocks * 32`, `acts.{d,sum,dsum}.len()
/// >= acts.m * blocks` and `out.len() >= acts.m * 16`.
#[target_feature(enable = "avx2,f16c,fma")]
pub unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let mut m0 = 0;
    while m0 < acts.m {
        let rows = (acts.m - m0).min(ROWS);
        // One instance per (format, rows): the format is a constant inside, so its branches and
        // the row loop fold away and each row's sums stay in registers.
        macro_rules! by_rows {
            ($kernel:ident, $f:literal) => {
                match rows {
                    1 => $kernel::<1, $f, 2>(tile, blocks, acts, m0, out),
                    2 => $kernel::<2, $f, 2>(tile, blocks, acts, m0, out),
                    3 => $kernel::<3, $f, 1>(tile, blocks, acts, m0, out),
                    _ => $kernel::<ROWS, $f, 1>(tile, blocks, acts, m0, out),
                }
            };
        }
        // SAFETY: this function's own contract, and m0 + rows <= acts.m.
        unsafe {
            match format {
                Format::Q4_0 => by_rows!(tile_rows, 0),
                Format::Q4_1 => by_rows!(tile_rows, 1),
                Format::Q8_0 => by_rows!(tile_rows, 2),
                Format::Q6K => by_rows!(tile_rows, 3),
                Format::Q5_0 => by_rows!(tile_rows, 4),
                Format::Q5_1 => by_rows!(tile_rows, 5),
                Format::IQ4NL => by_rows!(tile_rows, 6),
                Format::Q4K => by_rows!(tile_rows_k, 0),
                Format::Q5K => by_rows!(tile_rows_k, 1),
                Format::IQ4XS => by_rows!(tile_rows_k, 2),
                Format::Q3K => match rows {
                    1 => tile_rows_q3_k::<1, 2>(tile, blocks, acts, m0, out),
                    2 => tile_rows_q3_k::<2, 2>(tile, blocks, acts, m0, out),
                    3 => tile_rows_q3_k::<3, 1>(tile, blocks, acts, m0, out),
                    _ => tile_rows_q3_k::<ROWS, 1>(tile, blocks, acts, m0, out),
                },
            }
        }
        m0 += rows;
    }
}

/// The format of `tile_rows`'s constant `F`.
const FORMATS: [Format; 7] =
    [Format::Q4_0, Format::Q4_1, Format::Q8_0, Format::Q6K, Format::Q5_0, Format::Q5_1, Format::IQ4NL];

/// Rows `m0 .. m0 + R` of `tile`'s contract, for the format `FORMATS[F]`, `NH` halves of the tile
/// per pass over it (2: one pass; 1: two, so that more rows' sums fit the registers). Per row and
/// lane the f32 operations are those of `scalar::tile`, in the same order: only the weights' loads
/// and unpacking are shared between rows.
///
/// # Safety
/// As `tile`, `m0 + R <= acts.m`, and `NH` is 1 or 2.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn tile_rows<const R: usize, const F: usize, const NH: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs,
                                                                     m0: usize, out: &mut [f32]) {
    let format = FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let qoff = TILE * format.header_bytes();
    let ones = _mm256_set1_epi16(1);
    // Q6_K: a lane's (sc_0, sc_1) int16 pair -> sc_0 (sc_1) in both halves, per 128-bit lane
    let dup = [_mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13),
               _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)];
    for pass in 0..2 / NH {
        let mut acc = [[_mm256_setzero_ps(); NH]; R];
        for b in 0..blocks {
            // SAFETY: b < blocks, every half h = pass * NH + j < 2 and every ab = mi * blocks + b <
            // m * blocks (mi < m0 + R <= m), so every offset below stays inside the slices whose
            // lengths the caller guarantees (see `tile`'s `# Safety`); all loads are unaligned.
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
                            let pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(2 * TILE + h * 2 * HALF) as *const __m128i));
                            let sc = [_mm256_shuffle_epi8(pair, dup[0]), _mm256_shuffle_epi8(pair, dup[1])];
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

/// Rows `m0 .. m0 + R`'s accumulators of the halves `pass * NH ..` into `out`.
///
/// # Safety
/// The CPU supports AVX2 (`out`'s bounds are checked by its slicing).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_rows<const R: usize, const NH: usize>(acc: &[[__m256; NH]; R], pass: usize, m0: usize, out: &mut [f32]) {
    for (r, acc) in acc.iter().enumerate() {
        for (j, acc) in acc.iter().enumerate() {
            let h = pass * NH + j;
            let o = &mut out[(m0 + r) * TILE + h * HALF..(m0 + r) * TILE + (h + 1) * HALF];
            // SAFETY: `o` has exactly 8 f32, room for one unaligned 8-lane store.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *acc) };
        }
    }
}

/// The halves `pass * NH ..`'s lanes' exact sums of a Q4 block's codes (0..15, the nibble layout at
/// `q`, `pack.rs`) times activation rows `m0 .. m0 + R`'s block `b`: nibbles `maddubs` the
/// activations into 16 bits (at most 16 * 15 * 127 = 30480 a lane, no saturation), then one `madd`
/// by ones into 32.
///
/// # Safety
/// AVX2; `q .. q + 256` readable; `pass * NH + NH <= 2`; `(m0 + R) * blocks * 32 <= acts.qs.len()`, `b < blocks`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q4_sums<const R: usize, const NH: usize>(q: *const u8, pass: usize, acts: &QuantizedActs, m0: usize, blocks: usize,
                                                   b: usize) -> [[__m256i; NH]; R] {
    let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0f));
    let mut s16 = [[_mm256_setzero_si256(); NH]; R];
    // SAFETY: the caller's contract: every load lies in `q`'s 256 bytes or row `m0 + r`'s block `b`
    // of `acts.qs`; all loads unaligned.
    unsafe {
        // Four activation bytes of row r broadcast to every lane (a macro: closures lose the target features).
        macro_rules! bc {
            ($r:expr, $i:expr) => {
                _mm256_set1_epi32((acts.qs.as_ptr().add(((m0 + $r) * blocks + b) * QK + $i) as *const i32).read_unaligned())
            };
        }
        for v in 0..4 {
            for j in 0..NH {
                let h = pass * NH + j;
                let raw = _mm256_loadu_si256(q.add(v * 64 + h * 32) as *const __m256i);
                let lo = _mm256_and_si256(raw, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                for (r, s16) in s16.iter_mut().enumerate() {
                    let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bc!(r, 8 * v)),
                                             _mm256_maddubs_epi16(hi, bc!(r, 8 * v + 4)));
                    s16[j] = _mm256_add_epi16(s16[j], p);
                }
            }
        }
    }
    let mut isum = [[_mm256_setzero_si256(); NH]; R];
    for (isum, s16) in isum.iter_mut().zip(&s16) {
        for (isum, &s16) in isum.iter_mut().zip(s16) {
            *isum = _mm256_madd_epi16(s16, ones);
        }
    }
    isum
}

/// The halves `pass * NH ..`'s lanes' exact sums `T` of a block's IQ4_NL values (its codes 0..15 in
/// the Q4 nibble layout at `q`, `pack.rs`, looked up in [`IQ4NL_VALUES`]) times activation rows `m0
/// .. m0 + R`'s block `b`: each vector of codes is `pshufb`'s index into the table (bit 7 clear, so
/// no lane is zeroed), then `maddubs(|w|, sign(a, w))` as Q8_0 (|w| <= 127: at most 2 * 127 * 127 =
/// 32258 a 16-bit lane; two vectors summed in 16 bits could reach 64516, so each is widened by a
/// `madd` by ones into 32 first).
///
/// # Safety
/// AVX2; `q .. q + 256` readable; `pass * NH + NH <= 2`; `(m0 + R) * blocks * 32 <= acts.qs.len()`, `b < blocks`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn iq4_sums<const R: usize, const NH: usize>(q: *const u8, pass: usize, acts: &QuantizedActs, m0: usize,
                                                    blocks: usize, b: usize) -> [[__m256i; NH]; R] {
    let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0f));
    // SAFETY: IQ4NL_VALUES is 16 bytes, one unaligned 128-bit load.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i) });
    let mut isum = [[_mm256_setzero_si256(); NH]; R];
    // SAFETY: the caller's contract: every load lies in `q`'s 256 bytes or row `m0 + r`'s block `b`
    // of `acts.qs`; all loads unaligned.
    unsafe {
        // Four activation bytes of row r broadcast to every lane (a macro: closures lose the target features).
        macro_rules! bc {
            ($r:expr, $i:expr) => {
                _mm256_set1_epi32((acts.qs.as_ptr().add(((m0 + $r) * blocks + b) * QK + $i) as *const i32).read_unaligned())
            };
        }
        for v in 0..4 {
            for j in 0..NH {
                let h = pass * NH + j;
                let raw = _mm256_loadu_si256(q.add(v * 64 + h * 32) as *const __m256i);
                let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
                let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
                let (alo, ahi) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                for (r, isum) in isum.iter_mut().enumerate() {
                    let plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bc!(r, 8 * v), lo));
                    let phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bc!(r, 8 * v + 4), hi));
                    let t = _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones));
                    isum[j] = _mm256_add_epi32(isum[j], t);
                }
            }
        }
    }
    isum
}

/// The halves `pass * NH ..`'s lanes' exact sums of a block's 5-bit codes (0..31, the layout at `q`,
/// `pack.rs`) times activation rows `m0 .. m0 + R`'s block `b`: eight vectors of codes unpacked from
/// five, each `maddubs` the activations (at most 2 * 31 * 127 a 16-bit lane), the first and the
/// second 16 elements summed apart in 16 bits (at most 4 * 2 * 31 * 127 = 31496 each, no
/// saturation; all eight would reach 62992), then one `madd` by ones each into 32.
///
/// # Safety
/// AVX2; `q .. q + 320` readable; `pass * NH + NH <= 2`; `(m0 + R) * blocks * 32 <= acts.qs.len()`, `b < blocks`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q5_sums<const R: usize, const NH: usize>(q: *const u8, pass: usize, acts: &QuantizedActs, m0: usize,
                                                   blocks: usize, b: usize) -> [[__m256i; NH]; R] {
    let (ones, low5, top3, low2) =
        (_mm256_set1_epi16(1), _mm256_set1_epi8(0x1f), _mm256_set1_epi8(0x1c), _mm256_set1_epi8(0x03));
    let mut isum = [[_mm256_setzero_si256(); NH]; R];
    // SAFETY: the caller's contract: every load lies in `q`'s 320 bytes or row `m0 + r`'s block `b`
    // of `acts.qs`; all loads unaligned.
    unsafe {
        // Four activation bytes of row r broadcast to every lane (a macro: closures lose the target features).
        macro_rules! bc {
            ($r:expr, $i:expr) => {
                _mm256_set1_epi32((acts.qs.as_ptr().add(((m0 + $r) * blocks + b) * QK + $i) as *const i32).read_unaligned())
            };
        }
        for j in 0..NH {
            let h = pass * NH + j;
            let raw: [__m256i; 5] =
                std::array::from_fn(|k| _mm256_loadu_si256(q.add(k * 64 + h * 32) as *const __m256i));
            // vector 4's bit pairs 2k .. 2k + 2 at bits 0..2 (16-bit shifts: what moves in from the
            // next byte is masked off, as are the top 3 bits' neighbours below)
            let pairs =
                [raw[4], _mm256_srli_epi16(raw[4], 2), _mm256_srli_epi16(raw[4], 4), _mm256_srli_epi16(raw[4], 6)];
            let mut s16 = [[_mm256_setzero_si256(); 2]; R];
            for k in 0..4 {
                let c = _mm256_and_si256(raw[k], low5);
                let c16 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw[k], 3), top3),
                                          _mm256_and_si256(pairs[k], low2));
                for (r, s16) in s16.iter_mut().enumerate() {
                    s16[0] = _mm256_add_epi16(s16[0], _mm256_maddubs_epi16(c, bc!(r, 4 * k)));
                    s16[1] = _mm256_add_epi16(s16[1], _mm256_maddubs_epi16(c16, bc!(r, 16 + 4 * k)));
                }
            }
            for (isum, s16) in isum.iter_mut().zip(&s16) {
                isum[j] = _mm256_add_epi32(_mm256_madd_epi16(s16[0], ones), _mm256_madd_epi16(s16[1], ones));
            }
        }
    }
    isum
}

/// The format of `tile_rows_k`'s constant `F`.
const K_FORMATS: [Format; 3] = [Format::Q4K, Format::Q5K, Format::IQ4XS];

/// Rows `m0 .. m0 + R` of `tile`'s contract for Q4_K, Q5_K or IQ4_XS (`K_FORMATS[F]`; `NH` as
/// `tile_rows`): super-blocks in order, `d` and `dmin` converted once each, then their 8 sub-blocks
/// (activation blocks `8t + u`), each Q4_1's integer sums (`q4_sums`, or `q5_sums` of the 5-bit codes)
/// and float steps with `d * sc_u` and `-(dmin * m_u)` (exact, as `scalar.rs`; the negation folded
/// into `fnmadd`, which rounds `-(a b) + c` once as `fma(-a, b, c)` does). IQ4_XS: `iq4_sums` and
/// IQ4_NL's one float step with `d * (ls_u - 32)` (its signed scale bytes widened with sign; exact).
///
/// # Safety
/// As `tile`, `m0 + R <= acts.m`, `NH` is 1 or 2, and `blocks` a multiple of 8.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn tile_rows_k<const R: usize, const F: usize, const NH: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs,
                                                                       m0: usize, out: &mut [f32]) {
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

/// Rows `m0 .. m0 + R` of `tile`'s contract for Q3_K (`NH` as `tile_rows`): blocks of 32 in order
/// (block `b` is sub-block `b % 8` of super-block `b / 8`, `pack.rs`), each Q6_K's integer step over
/// its two groups (see the module docs) and Q8_0's float step with the super-block's `d`, per row
/// and lane the f32 operations of `scalar::tile`, in the same order.
///
/// # Safety
/// As `tile`, `m0 + R <= acts.m`, `NH` is 1 or 2, and `blocks` a multiple of 8.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn tile_rows_q3_k<const R: usize, const NH: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize,
                                                          out: &mut [f32]) {
    let tbb = TILE * Format::Q3K.block_bytes();
    let sub = tbb / Q4_K_SUBS; // the stream's share of a block, for the prefetch
    // a lane's (sc_0, sc_1) int16 pair -> sc_0 (sc_1) in both halves, per 128-bit lane
    let dup = [_mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13),
               _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)];
    for pass in 0..2 / NH {
        let mut acc = [[_mm256_setzero_ps(); NH]; R];
        for b in 0..blocks {
            // SAFETY: b < blocks, so super-block b / 8's `tbb` bytes lie in `tile`; every half h =
            // pass * NH + j < 2 and every ab = (m0 + r) * blocks + b < m * blocks, so every read
            // stays inside the slices whose lengths the caller guarantees; all loads are unaligned.
            unsafe {
                let (sb, u) = (tile.as_ptr().add(b / Q4_K_SUBS * tbb), b % Q4_K_SUBS);
                if m0 == 0 && pass == 0 {
                    prefetch_ahead(sb.add(u * sub), sub, Q3_K_DISTANCE); // the first pass streams the weights
                }
                // Four activation bytes of row r broadcast to every lane (a macro: closures lose the
                // target features).
                macro_rules! bc {
                    ($r:expr, $i:expr) => {
                        _mm256_set1_epi32((acts.qs.as_ptr().add(((m0 + $r) * blocks + b) * QK + $i) as *const i32).read_unaligned())
                    };
                }
                for j in 0..NH {
                    let h = pass * NH + j;
                    let pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(sb.add(Q3_K_SC + 2 * TILE * u + h * 2 * HALF) as *const __m128i));
                    let sc = [_mm256_shuffle_epi8(pair, dup[0]), _mm256_shuffle_epi8(pair, dup[1])];
                    let w = unpack_q3_k(sb.add(Q3_K_CODES + Q3_K_SUB_CODES * u + h * 32));
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(sb.add(h * 2 * HALF) as *const __m128i));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        // each group's 16-bit sums start at -4 * its activations' sum (the low half of
                        // each lane; |4 * sum_g| <= 4 * 16 * 127 fits)
                        let ab = (m0 + r) * blocks + b;
                        let lo = *acts.sum_lo.get_unchecked(ab);
                        let hi = *acts.sum.get_unchecked(ab) - lo;
                        let mut s16 = [_mm256_set1_epi32((-4 * lo) & 0xffff), _mm256_set1_epi32((-4 * hi) & 0xffff)];
                        for (v, &w) in w.iter().enumerate() {
                            s16[v / 4] = _mm256_add_epi16(s16[v / 4], _mm256_maddubs_epi16(w, bc!(r, 4 * v)));
                        }
                        let isum = _mm256_add_epi32(_mm256_madd_epi16(s16[0], sc[0]), _mm256_madd_epi16(s16[1], sc[1]));
                        let s = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(ab)));
                        acc[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(isum), acc[j]);
                    }
                }
            }
        }
        // SAFETY: `out` holds `acts.m * 16 >= (m0 + R) * 16` floats (the caller's contract).
        unsafe { store_rows(&acc, pass, m0, out) };
    }
}

/// One Q3_K block's three packed vectors at `p` (8 lanes, one every 64 bytes; `pack.rs`) as its eight
/// vectors of codes (0..7): elements `4v + i` of the block in vector `v`, Q8_0's order.
///
/// # Safety
/// AVX2; `p`, `p + 64` and `p + 128` readable for 32 bytes each.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_q3_k(p: *const u8) -> [__m256i; 8] {
    // SAFETY: the caller's contract; all loads unaligned.
    let raw = unsafe {
        [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(64) as *const __m256i),
         _mm256_loadu_si256(p.add(128) as *const __m256i)]
    };
    let (m7, m3, m4) = (_mm256_set1_epi8(7), _mm256_set1_epi8(3), _mm256_set1_epi8(4));
    // 16-bit shifts: what moves in from the next byte is masked off
    [_mm256_and_si256(raw[0], m7), _mm256_and_si256(raw[1], m7), _mm256_and_si256(raw[2], m7),
     _mm256_and_si256(_mm256_srli_epi16(raw[0], 3), m7), _mm256_and_si256(_mm256_srli_epi16(raw[1], 3), m7),
     _mm256_and_si256(_mm256_srli_epi16(raw[2], 3), m7),
     _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw[0], 6), m3), _mm256_and_si256(_mm256_srli_epi16(raw[2], 4), m4)),
     _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw[1], 6), m3), _mm256_and_si256(_mm256_srli_epi16(raw[2], 5), m4))]
}
