//! The AVX-512 VNNI kernel for Q3_K (`vpdpbusd`): one 16-row tile, one row per 32-bit lane of a zmm,
//! up to [`super::ROWS`] activation rows per pass over it.
//!
//! Per block of 32 weights (a sub-block of the tile's super-block, `pack.rs`): the super-block's `d`
//! and the block's scale pairs are read once for all rows, and its eight vectors of unsigned codes
//! (0..7) unpacked once from three (`unpack_q3_k`: 19 ops, `pack.rs`). Per row, one `dpbusd` chain a
//! group of 16, each started at `-4 * sum_g(a)` (the activations' group sums, `sum_lo` and `sum -
//! sum_lo`), so it ends at `isum_g` = `sum_g((c - 4) a)` exactly (|isum_g| <= 16 * 4 * 127 = 8128);
//! the two chains are halves of one row's work, so they overlap. The pair `(isum_0, isum_1)` is then
//! put in the two 16-bit halves of each lane (a shift and a masked blend) and one `vpmaddwd` by the
//! lane's `(sc_0, sc_1)` gives `T = sc_0 * isum_0 + sc_1 * isum_1` of `scalar.rs`, exactly (two
//! `vpmulld`, two uops and ten cycles each on Intel, and an add were the other way). Then Q8_0's float
//! step with `d`, as `scalar.rs` does it, so the bits are the scalar kernel's.
//!
//! Streaming a 4096 x 14336 matrix on 1 thread it took 2.10-2.37 ms a product at M = 1 (11.1-12.4
//! GB/s of its 114 bytes a row per 256 weights) against Q8_0's 5.37-5.86 ms (10.6-11.6 GB/s of 272
//! bytes; the format Q3_K tensors were converted to before), and 2.54-2.70 ms at M = 4 (9.7-10.3 GB/s)
//! against Q8_0's 5.55-5.96 (Q4_K's 3.18-3.38 and 4.83-5.02, Q6_K's 4.63-5.27 and 7.20-10.3 in the
//! same runs, both still on the AVX2 kernel's bits through `superblock.rs` and `blocks32.rs`); from
//! the cache (1536 x 768) 7.0-7.8 ns a (row, tile block) at M = 1, 5.0-5.1 at M = 4 and 5.5-5.6 at M =
//! 8 against Q8_0's 10.8-12.5, 5.3-5.4 and 5.5 (Intel Xeon, 2 cores shared with two other builds, runs
//! alternated with AVX2's; `cargo bench --bench gemv_rows -- avx512_vnni 1 1,4 4096x14336
//! q3_k,q4_k,q6_k,q8_0` and `-- avx512_vnni 1 1,4,8 1536x768 q3_k,q4_k,q8_0`). At M = 8 a block's
//! multiply bounds it (5.0-5.2 GB/s streaming). The prefetch asks `prefetch::Q3_K_DISTANCE` (4096
//! bytes) ahead at every M: the AVX-512 table's 512 at M = 1 streamed 9.1-9.9 GB/s.

use std::arch::x86_64::*;

use super::super::format::{Format, Q4_K_SUBS, QK};
use super::super::pack::{Q3_K_CODES, Q3_K_SC, Q3_K_SUB_CODES, TILE};
use super::super::prefetch::{prefetch_ahead, Q3_K_DISTANCE};
use super::super::quantize::QuantizedActs;
use super::ROWS;

/// `super::tile` for Q3_K.
///
/// # Safety
/// As `super::tile`, and `format` is Q3_K.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    debug_assert_eq!(format, Format::Q3K);
    let mut m0 = 0;
    while m0 < acts.m {
        let rows = (acts.m - m0).min(ROWS);
        // SAFETY: this function's own contract, and m0 + rows <= acts.m. One instance per row
        // count: the row loop folds away and each row's accumulator stays in a register.
        unsafe {
            match rows {
                1 => tile_rows::<1>(tile, blocks, acts, m0, out),
                2 => tile_rows::<2>(tile, blocks, acts, m0, out),
                3 => tile_rows::<3>(tile, blocks, acts, m0, out),
                4 => tile_rows::<4>(tile, blocks, acts, m0, out),
                5 => tile_rows::<5>(tile, blocks, acts, m0, out),
                6 => tile_rows::<6>(tile, blocks, acts, m0, out),
                7 => tile_rows::<7>(tile, blocks, acts, m0, out),
                _ => tile_rows::<ROWS>(tile, blocks, acts, m0, out),
            }
        }
        m0 += rows;
    }
}

/// Rows `m0 .. m0 + R` of `tile`'s contract: blocks of 32 in order (block `b` is sub-block `b % 8`
/// of super-block `b / 8`). Per row the f32 operations are those of `scalar::tile`, in the same
/// order: only the weights' loads and unpacking are shared.
///
/// # Safety
/// As `tile`, and `m0 + R <= acts.m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_rows<const R: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize, out: &mut [f32]) {
    let tbb = TILE * Format::Q3K.block_bytes();
    let sub = tbb / Q4_K_SUBS; // the stream's share of a block, for the prefetch
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..blocks {
        // SAFETY: b < blocks, so super-block b / 8's `tbb` bytes lie in `tile` (the caller's
        // contract), and every ab = (m0 + r) * blocks + b < m * blocks (m0 + r < m0 + R <= m), so
        // every read stays inside the slices whose lengths the caller guarantees; all loads unaligned.
        unsafe {
            let (sb, u) = (tile.as_ptr().add(b / Q4_K_SUBS * tbb), b % Q4_K_SUBS);
            if m0 == 0 {
                prefetch_ahead(sb.add(u * sub), sub, Q3_K_DISTANCE);
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(sb as *const __m256i));
            // lane j: (sc_0, sc_1) as int16 halves
            let pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(sb.add(Q3_K_SC + 2 * TILE * u) as *const __m256i));
            let w = unpack_q3_k(sb.add(Q3_K_CODES + Q3_K_SUB_CODES * u));
            for (r, acc) in acc.iter_mut().enumerate() {
                let ab = (m0 + r) * blocks + b;
                let a = acts.qs.as_ptr().add(ab * QK);
                let lo = *acts.sum_lo.get_unchecked(ab);
                let hi = *acts.sum.get_unchecked(ab) - lo;
                let (mut i0, mut i1) = (_mm512_set1_epi32(-4 * lo), _mm512_set1_epi32(-4 * hi));
                for v in 0..4 {
                    i0 = _mm512_dpbusd_epi32(i0, w[v], bc!(a, 4 * v));
                    i1 = _mm512_dpbusd_epi32(i1, w[4 + v], bc!(a, 16 + 4 * v));
                }
                // (isum_0, isum_1) as the lane's int16 halves (both fit), times (sc_0, sc_1)
                let halves = _mm512_mask_blend_epi16(0xaaaa_aaaa, i0, _mm512_slli_epi32(i1, 16));
                let isum = _mm512_madd_epi16(halves, pair);
                let s = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(ab)));
                *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut out[(m0 + r) * TILE..(m0 + r + 1) * TILE];
        // SAFETY: `o` has exactly 16 f32, room for one unaligned 16-lane store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *acc) };
    }
}

/// One Q3_K block's three packed vectors at `p` (`pack.rs`) as its eight vectors of codes (0..7):
/// elements `4v + i` of the block in vector `v`, Q8_0's order (as `avx2::q3k::unpack_q3_k`).
///
/// # Safety
/// AVX-512 F/BW; `p` readable for 192 bytes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q3_k(p: *const u8) -> [__m512i; 8] {
    // SAFETY: the caller's contract; all loads unaligned.
    let raw = unsafe {
        [_mm512_loadu_si512(p as *const __m512i), _mm512_loadu_si512(p.add(64) as *const __m512i),
         _mm512_loadu_si512(p.add(128) as *const __m512i)]
    };
    let (m7, m3, m4) = (_mm512_set1_epi8(7), _mm512_set1_epi8(3), _mm512_set1_epi8(4));
    // 16-bit shifts: what moves in from the next byte is masked off
    [_mm512_and_si512(raw[0], m7), _mm512_and_si512(raw[1], m7), _mm512_and_si512(raw[2], m7),
     _mm512_and_si512(_mm512_srli_epi16(raw[0], 3), m7), _mm512_and_si512(_mm512_srli_epi16(raw[1], 3), m7),
     _mm512_and_si512(_mm512_srli_epi16(raw[2], 3), m7),
     _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw[0], 6), m3), _mm512_and_si512(_mm512_srli_epi16(raw[2], 4), m4)),
     _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw[1], 6), m3), _mm512_and_si512(_mm512_srli_epi16(raw[2], 5), m4))]
}
