//! The AVX2 kernel (`vpmaddubsw`): one 16-row tile as two halves of 8 lanes (one row per
//! 32-bit lane), up to four activation rows per pass over the tile.
//!
//! Files, one per format family as the AVX-512 kernel's: this one (`tile`'s dispatch, `store_rows`,
//! `scale_pairs!` for Q6_K and Q3_K, and the integer sums of a block of 32 that two families below
//! share: `q4_sums` for Q4_0, Q4_1 and Q4_K, `q5_sums` for Q5_0, Q5_1 and Q5_K, `iq4_sums` for
//! IQ4_NL and IQ4_XS); `blocks32.rs` (`tile_rows`: Q4_0, Q4_1, Q8_0, Q6_K, Q5_0, Q5_1 and IQ4_NL, a
//! block of 32 at a time); `superblock.rs` (`tile_rows_k`: Q4_K, Q5_K and IQ4_XS, a super-block of
//! 256 at a time); `q3k.rs` (`tile_rows_q3_k`: Q3_K). Each file's docs hold its formats' steps and
//! measurements.
//!
//! Why this shape (AMD EPYC Zen 3, 2026-12-06, `cargo bench --bench gemv_rows -- avx2`): the
//! first version multiplied one activation row at a time and asked for nothing ahead: at M = 1
//! it streamed 13.7 GB/s of Q4_1 from memory against 24 GB/s of read bandwidth, because the
//! multiply (35 GB/s from the cache) and the loads did not overlap; and each further row
//! reloaded and unpacked every weight again. Now the weight stream is prefetched (`prefetch`)
//! and a pass over the tile serves up to four rows, each weight vector unpacked once for all of
//! them. From three rows on the tile's two halves run as two passes (the second from L1), so
//! that each row's accumulator and 16-bit sums fit AVX2's 16 registers.

/// A half's 8 lanes' signed scale pairs `(sc_0, sc_1)` at `$p` (16 bytes, `pack.rs`) widened to int16,
/// and `[sc_0, sc_1]`, each in both 16-bit halves of every lane: the `madd` operand of the lanes'
/// 16-bit sums of group 0 (1). Q6_K's and Q3_K's group sums differ past it (Q6_K's two vectors of
/// products to a `madd`, as four would overflow 16 bits, and `32 * sum_g` subtracted after; Q3_K's
/// four onto `-4 * sum_g`, one `madd` a group), so only this step is shared. A macro, not an
/// `#[inline]` fn: it compiles `tile` to the machine code of the two copies it replaced, where the
/// fn changed it (another register allocation, 45 fewer instructions of 13168). Expands to unsafe
/// code: the caller's unsafe block must have `$p .. $p + 16` readable, and AVX2.
macro_rules! scale_pairs {
    ($p:expr) => {{
        // a lane's (sc_0, sc_1) int16 pair -> sc_0 (sc_1) in both halves, per 128-bit lane
        let dup = [_mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13),
                   _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)];
        let pair = _mm256_cvtepi8_epi16(_mm_loadu_si128($p as *const __m128i));
        (pair, [_mm256_shuffle_epi8(pair, dup[0]), _mm256_shuffle_epi8(pair, dup[1])])
    }};
}

mod blocks32;
mod q3k;
mod superblock;

use std::arch::x86_64::*;

use super::format::{Format, IQ4NL_VALUES, QK};
use super::pack::TILE;
use super::quantize::QuantizedActs;
use blocks32::tile_rows;
use q3k::tile_rows_q3_k;
use superblock::tile_rows_k;

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
