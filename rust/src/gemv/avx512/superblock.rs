//! The AVX-512 VNNI kernel for the super-block formats Q4_K, Q5_K and IQ4_XS: one 16-row tile, one
//! row per 32-bit lane of a zmm (so no halves, unlike the AVX2 kernel), up to `ROWS` activation
//! rows per pass over the tile.
//!
//! A super-block at a time, its `d` (and `dmin`) converted once; then each of its 8 sub-blocks
//! (activation blocks `8t + u`) as in `scalar.rs`: its 8 vectors of codes unpacked once for all
//! the pass's rows, code vector `i` paired with activation bytes `4i .. 4i + 4` in every format
//! (Q4's nibble layout and the 5-bit layout both give Q8_0's order, `pack.rs`), then per row 8
//! `dpbusd` (codes unsigned, broadcast activations signed, exact int32 sums: no 16-bit
//! intermediate to watch, unlike `maddubs`) and the float steps of `scalar.rs`, in its order.
//! - Q4_K: the nibbles (0..15) as they are; `d * sc` and `dmin * m` from one widening load of a
//!   sub-block's 16 bytes each (exact), then per row `fma(d * sc * d_a, isum, acc)` and
//!   `fnmadd(dmin * m, d_a * sum_a, acc)` (= `fma(-(dmin * m), ..)`, one rounding, as the AVX2 kernel).
//! - Q5_K: the same over the 5-bit codes, eight vectors unpacked from five (the upper 16 elements'
//!   codes as a shift, a mask and one `vpternlogd` each).
//! - IQ4_XS: the nibbles looked up with one `vpshufb` a vector in the table plus 128
//!   ([`IQ4NL_VALUES`] -127..113 -> 1..241, unsigned), so `dpbusd` sums `T + 128 * sum_a`; each row's
//!   chain starts at `-128 * sum_a`, so it ends at `T` exactly (|partials| < 2^31). Then IQ4_NL's
//!   one float step with `d * (ls - 32)` (signed bytes widened with sign; exact).
//!
//! Up to 3 rows each row's sum runs as two `dpbusd` chains (codes 0..3 and 4..7) joined after,
//! each half as long; from 4 rows on the rows' chains overlap (as `tile_rows` in `mod.rs`). The rows
//! are written out (`row!`), not looped over: LLVM left that loop rolled for some (format, rows), the
//! accumulators on the stack (IQ4_XS at 8 rows: 5.2-9.7 ns a (row, tile block) from the cache, 4.3
//! written out). The stream is prefetched a sub-block's share (a super-block's bytes / 8) per
//! sub-block, 2048 bytes ahead at 1 and 2 rows (`distance`).
//!
//! Why this shape: the AVX2 kernel's work a row is twice the instructions (two halves, `maddubs`
//! plus a `madd` into 32 bits, IQ4_XS's `sign` a vector and row) and from 3 rows on it makes two
//! passes over the tile, so from 2 rows on it falls behind the memory (the table: 4.3-7.5 GB/s at 4
//! rows for Q4_K and Q5_K, 5.3 for IQ4_XS, before this kernel). Here a row costs 8 `dpbusd` a
//! sub-block and its float steps, and the unpacking is shared by up to 8 rows: up to 4 rows it
//! streams within 10% of its 1-row rate. At 8 rows the pass is bound by `dpbusd` (64 a sub-block,
//! one a cycle: 4.0-4.8 ns a (row, tile block) against the 3.1 of the `dpbusd` alone at 2.6 GHz, so
//! 32-38 ns a sub-block against the 24-31 its 276-360 bytes take to stream), 8.0-9.3 GB/s.
//!
//! Measured on an Intel Xeon @ 2.60GHz with AVX-512 VNNI (2 cores, shared with other sessions'
//! builds and benches: quiet periods only, the kernels alternated; medians of 4 runs streaming, of 3
//! from the cache). `cargo bench --bench gemv_rows -- KERNEL 1 1,2,4,8 4096x4096 q4_k,q5_k,iq4_xs`:
//! GB/s streaming; `.. 1536x768 ..`: ns a (row, tile block of 16 x 32 weights) from the cache.
//!
//! | format | M | AVX2 GB/s | AVX-512 GB/s | AVX2 ns (cache) | AVX-512 ns (cache) |
//! |--------|---|-----------|--------------|-----------------|--------------------|
//! | Q4_K   | 1 | 11.8      | 11.6         | 10.0            | 6.6                |
//! | Q4_K   | 2 | 10.2      | 11.4         | 8.4             | 5.6                |
//! | Q4_K   | 4 | 7.4       | 10.8         | 7.2             | 4.9                |
//! | Q4_K   | 8 | 4.3       | 8.4          | 7.2             | 4.6                |
//! | Q5_K   | 1 | 11.3      | 11.8         | 13.6            | 7.4                |
//! | Q5_K   | 2 | 9.3       | 11.4         | 10.2            | 5.9                |
//! | Q5_K   | 4 | 7.5       | 10.9         | 8.2             | 5.0                |
//! | Q5_K   | 8 | 4.5       | 9.3          | 8.1             | 4.6                |
//! | IQ4_XS | 1 | 11.4      | 11.6         | 15.4            | 7.0                |
//! | IQ4_XS | 2 | 8.5       | 11.6         | 13.0            | 5.1                |
//! | IQ4_XS | 4 | 5.3       | 10.8         | 11.4            | 4.8                |
//! | IQ4_XS | 8 | 2.9       | 8.0          | 11.4            | 4.3                |
//!
//! The prefetch distance: `avx512_distance`'s 512 bytes at 1 row and 1024 at 2 streamed 11.2-12.3
//! and 11.0-12.0 GB/s over the three formats against 2048's 11.4-13.0 and 11.1-12.8 (three runs
//! alternated); from 3 rows on 4096 and 8192 were tried only under other sessions' load, within
//! its noise of the table's.

use std::arch::x86_64::*;

use super::super::format::{Format, IQ4NL_VALUES, Q4_K_SUBS, QK};
use super::super::pack::{
    IQ4_XS_CODES, IQ4_XS_SC, Q4_K_CODES, Q4_K_DMIN, Q4_K_M, Q4_K_SC, Q4_K_SUB_CODES, Q5_SUB_CODES, TILE,
};
use super::super::prefetch::{avx512_distance, prefetch_ahead};
use super::super::quantize::QuantizedActs;
use super::ROWS;

/// `super::tile` for Q4_K, Q5_K and IQ4_XS.
///
/// # Safety
/// As `super::tile` (`blocks` a multiple of 8, the tile's super-blocks).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let mut m0 = 0;
    while m0 < acts.m {
        let rows = (acts.m - m0).min(ROWS);
        // SAFETY: this function's own contract, and m0 + rows <= acts.m.
        unsafe {
            match format {
                Format::Q4K => by_rows!(tile_rows_k, rows, 0, (tile, blocks, acts, m0, out)),
                Format::Q5K => by_rows!(tile_rows_k, rows, 1, (tile, blocks, acts, m0, out)),
                Format::IQ4XS => by_rows!(tile_rows_k, rows, 2, (tile, blocks, acts, m0, out)),
                Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q6K | Format::Q5_0 | Format::Q5_1
                | Format::IQ4NL | Format::Q3K => unreachable!("not a super-block format of this file (`super::tile`)"),
            }
        }
        m0 += rows;
    }
}

/// Bytes ahead of the sub-block being read that the pass asks for: `avx512_distance`, but 2048
/// at one and two rows (its 512 and 1024 streamed 5-8% less here; see the module docs).
const fn distance(rows: usize) -> usize {
    match rows {
        1 | 2 => 2048,
        _ => avx512_distance(rows),
    }
}

// `tile_rows_k` writes out rows 0 .. 8 (`row!`).
const _: () = assert!(ROWS == 8);

/// The format of `tile_rows_k`'s constant `F`.
const K_FORMATS: [Format; 3] = [Format::Q4K, Format::Q5K, Format::IQ4XS];

/// Rows `m0 .. m0 + R` of `tile`'s contract for `K_FORMATS[F]`: super-blocks in order, then their 8
/// sub-blocks, each sub-block's codes unpacked once for all `R` rows (see the module docs). Per row
/// the f32 operations are those of `scalar::tile_k`, in the same order.
///
/// # Safety
/// As `tile`, and `m0 + R <= acts.m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_rows_k<const R: usize, const F: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize,
                                                      out: &mut [f32]) {
    let format = K_FORMATS[F];
    let xs = format == Format::IQ4XS;
    let tbb = TILE * format.block_bytes();
    let (sc_off, codes_off, sub_codes) = match format {
        Format::Q5K => (Q4_K_SC, Q4_K_CODES, Q5_SUB_CODES),
        Format::IQ4XS => (IQ4_XS_SC, IQ4_XS_CODES, Q4_K_SUB_CODES),
        _ => (Q4_K_SC, Q4_K_CODES, Q4_K_SUB_CODES),
    };
    let sub = tbb / Q4_K_SUBS; // the stream's share of a sub-block, for the prefetch
    let low = _mm512_set1_epi8(0x0f);
    // the IQ4_NL values plus 128 (as unsigned bytes) in each 128-bit lane, `vpshufb`'s table
    // SAFETY: IQ4NL_VALUES is 16 bytes, one unaligned 128-bit load.
    let table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i) }),
        _mm512_set1_epi8(-128));
    let mut acc = [_mm512_setzero_ps(); R];
    for t in 0..blocks / Q4_K_SUBS {
        // SAFETY: t < blocks / 8, so the super-block's `tbb` bytes lie in `tile`; every ab = (m0 + r)
        // * blocks + 8t + u < m * blocks, so every read stays inside the slices whose lengths the
        // caller guarantees; all loads are unaligned.
        unsafe {
            let sb = tile.as_ptr().add(t * tbb);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(sb as *const __m256i));
            let dmin = if xs {
                _mm512_setzero_ps()
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(sb.add(Q4_K_DMIN) as *const __m256i))
            };
            for u in 0..Q4_K_SUBS {
                if m0 == 0 {
                    prefetch_ahead(sb.add(u * sub), sub, distance(R)); // the first pass streams the weights
                }
                let b = t * Q4_K_SUBS + u;
                let q = sb.add(codes_off + sub_codes * u);
                // the sub-block's 8 vectors of codes, vector i the elements 4i .. 4i + 4 of each lane
                let mut w = [_mm512_setzero_si512(); 8];
                match format {
                    Format::Q4K | Format::IQ4XS => {
                        for v in 0..4 {
                            let raw = _mm512_loadu_si512(q.add(v * 64) as *const __m512i);
                            w[2 * v] = _mm512_and_si512(raw, low);
                            w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                        }
                        if xs {
                            for w in w.iter_mut() {
                                *w = _mm512_shuffle_epi8(table, *w); // bit 7 clear: no byte zeroed
                            }
                        }
                    }
                    Format::Q5K => {
                        let raw: [__m512i; 5] =
                            std::array::from_fn(|k| _mm512_loadu_si512(q.add(k * 64) as *const __m512i));
                        // vector 4's bit pairs 2k .. 2k + 2 at bits 0..2 (16-bit shifts: what moves in
                        // from the next byte is masked off, as are the top 3 bits' neighbours below)
                        let pairs = [raw[4], _mm512_srli_epi16(raw[4], 2), _mm512_srli_epi16(raw[4], 4),
                                     _mm512_srli_epi16(raw[4], 6)];
                        let (low5, top3, low2) =
                            (_mm512_set1_epi8(0x1f), _mm512_set1_epi8(0x1c), _mm512_set1_epi8(0x03));
                        for k in 0..4 {
                            w[k] = _mm512_and_si512(raw[k], low5);
                            let top = _mm512_and_si512(_mm512_srli_epi16(raw[k], 3), top3);
                            // top | (pairs & 3): 0xf8 is A | (B & C) for A = 0xf0, B = 0xcc, C = 0xaa
                            w[4 + k] = _mm512_ternarylogic_epi32::<0xf8>(top, pairs[k], low2);
                        }
                    }
                    Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q6K | Format::Q5_0 | Format::Q5_1
                    | Format::IQ4NL | Format::Q3K => unreachable!("not in K_FORMATS"),
                }
                // the sub-block's scale (and minimum) of each lane as f32, exact: d * sc, dmin * m
                let scb = _mm_loadu_si128(sb.add(sc_off + TILE * u) as *const __m128i);
                let sc = if xs { _mm512_cvtepi8_epi32(scb) } else { _mm512_cvtepu8_epi32(scb) };
                let dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                let mw = if xs {
                    _mm512_setzero_ps()
                } else {
                    let mb = _mm_loadu_si128(sb.add(Q4_K_M + TILE * u) as *const __m128i);
                    _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb)))
                };
                // Row r's sums and float steps; written out for r = 0 .. R below.
                macro_rules! row {
                    ($r:literal) => {
                        if $r < R {
                            let ab = (m0 + $r) * blocks + b;
                            let a = acts.qs.as_ptr().add(ab * QK);
                            // IQ4_XS: the chain starts at -128 * sum_a, so it ends at T (the module docs)
                            let mut isum = if xs {
                                _mm512_set1_epi32(-128 * *acts.sum.get_unchecked(ab))
                            } else {
                                _mm512_setzero_si512()
                            };
                            // Integer sums are exact in any order: the bits are the same either way.
                            if R < 4 {
                                let mut isum_hi = _mm512_setzero_si512();
                                for i in 0..4 {
                                    isum = _mm512_dpbusd_epi32(isum, w[i], bc!(a, 4 * i));
                                    isum_hi = _mm512_dpbusd_epi32(isum_hi, w[4 + i], bc!(a, 16 + 4 * i));
                                }
                                isum = _mm512_add_epi32(isum, isum_hi);
                            } else {
                                for (i, &w) in w.iter().enumerate() {
                                    isum = _mm512_dpbusd_epi32(isum, w, bc!(a, 4 * i));
                                }
                            }
                            let s = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(ab)));
                            acc[$r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), acc[$r]);
                            if !xs {
                                let dsum = _mm512_set1_ps(*acts.dsum.get_unchecked(ab));
                                acc[$r] = _mm512_fnmadd_ps(mw, dsum, acc[$r]);
                            }
                        }
                    };
                }
                // Not a loop over the rows: LLVM leaves that rolled for some (format, R), and the
                // accumulators then live on the stack (the module docs). ROWS = 8 (asserted below).
                row!(0);
                row!(1);
                row!(2);
                row!(3);
                row!(4);
                row!(5);
                row!(6);
                row!(7);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut out[(m0 + r) * TILE..(m0 + r + 1) * TILE];
        // SAFETY: `o` has exactly 16 f32, room for one unaligned 16-lane store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *acc) };
    }
}
