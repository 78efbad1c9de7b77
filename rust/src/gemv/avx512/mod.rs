//! The AVX-512 VNNI kernel (`vpdpbusd`): one 16-row tile, one row per 32-bit lane of a zmm.
//!
//! `dpbusd` multiplies unsigned by signed bytes and adds groups of four into 32 bits without
//! saturation. Q4: nibbles are the unsigned operand. Q8_0: weights `w ^ 0x80` (= w + 128) are
//! the unsigned operand and `128 * sum(a)` is subtracted after. Float steps as in `scalar.rs`.
//!
//! The AVX-512 intrinsics are stable since Rust 1.89: this file needs that compiler although the
//! crate still declares 1.82 (raising `rust-version` turns on lints across other modules).

/// `$f::<R, $format>($args)` with `R` the row count `$rows` (1..=ROWS) as a constant: one instance per
/// (format, rows), so a kernel's format branches and row loop fold away and each row's accumulator
/// stays in a register. Used by every file of this kernel (the row-group loop of its `tile`).
macro_rules! by_rows {
    ($f:ident, $rows:expr, $format:literal, ($($arg:expr),*)) => {
        match $rows {
            1 => $f::<1, $format>($($arg),*),
            2 => $f::<2, $format>($($arg),*),
            3 => $f::<3, $format>($($arg),*),
            4 => $f::<4, $format>($($arg),*),
            5 => $f::<5, $format>($($arg),*),
            6 => $f::<6, $format>($($arg),*),
            7 => $f::<7, $format>($($arg),*),
            _ => $f::<ROWS, $format>($($arg),*),
        }
    };
}

/// Four activation bytes at `$a + $i` broadcast to every 32-bit lane, `dpbusd`'s signed operand (a
/// macro: closures lose the target features). Used by every file of this kernel.
macro_rules! bc {
    ($a:expr, $i:expr) => {
        _mm512_set1_epi32(($a.add($i) as *const i32).read_unaligned())
    };
}

mod blocks32;
mod q3k;
mod superblock;

use std::arch::x86_64::*;

use super::format::{Format, QK};
use super::pack::TILE;
use super::prefetch::{avx512_distance, prefetch_ahead};
use super::quantize::QuantizedActs;

/// Whether this CPU can run the kernel.
pub fn supported() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
}

/// Activation rows multiplied together per pass over a tile: each block's weights are loaded and
/// unpacked once for all of them (a verify step's k + 1 rows, a small batch), instead of once per
/// row. 8 (the most `matmul`'s callers send) keeps the unpacked block (8 zmm), the 8
/// accumulators and the temporaries in the 32 zmm registers.
const ROWS: usize = 8;

/// Same contract as `scalar::tile`.
///
/// Q4_0, Q4_1 and Q8_0 run here (`tile_from`); the super-block formats Q4_K, Q5_K and IQ4_XS in
/// `superblock.rs`; Q6_K, Q5_0, Q5_1 and IQ4_NL (blocks of 32) in `blocks32.rs`; Q3_K in `q3k.rs`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI (`supported()`); slice lengths as in
/// `avx2::tile`'s `# Safety`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    match format {
        // SAFETY: this function's own contract (the same as theirs).
        Format::Q4K | Format::Q5K | Format::IQ4XS => return unsafe { superblock::tile(format, tile, blocks, acts, out) },
        // SAFETY: as above.
        Format::Q6K | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => {
            return unsafe { blocks32::tile(format, tile, blocks, acts, out) }
        }
        // SAFETY: as above.
        Format::Q3K => return unsafe { q3k::tile(format, tile, blocks, acts, out) },
        Format::Q4_0 | Format::Q4_1 | Format::Q8_0 => {}
    }
    // SAFETY: this function's own contract.
    unsafe { tile_from(format, tile, blocks, acts, 0, out) }
}

/// `tile` for the activation rows `m0..acts.m` alone (the AMX kernel's rows past its groups of 16),
/// in Q4_0, Q4_1 or Q8_0 (the others go through `tile`).
///
/// # Safety
/// As `tile`, `m0 <= acts.m`, and `format` is Q4_0, Q4_1 or Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_from(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize,
                               out: &mut [f32]) {
    let mut m0 = m0;
    while m0 < acts.m {
        let rows = (acts.m - m0).min(ROWS);
        // SAFETY: this function's own contract, and m0 + rows <= acts.m.
        unsafe {
            match format {
                Format::Q4_0 => by_rows!(tile_rows, rows, 0, (tile, blocks, acts, m0, out)),
                Format::Q4_1 => by_rows!(tile_rows, rows, 1, (tile, blocks, acts, m0, out)),
                Format::Q8_0 => by_rows!(tile_rows, rows, 2, (tile, blocks, acts, m0, out)),
                Format::Q6K | Format::Q4K | Format::Q5K | Format::Q5_0 | Format::Q5_1
                | Format::IQ4NL | Format::IQ4XS | Format::Q3K => unreachable!("runs in its family's file (`tile`)"),
            }
        }
        m0 += rows;
    }
}

/// The format of `tile_rows`'s constant `F`.
const FORMATS: [Format; 3] = [Format::Q4_0, Format::Q4_1, Format::Q8_0];

/// Rows `m0 .. m0 + R` of `tile`'s contract, for the format `FORMATS[F]`. Per row the f32 operations are those of
/// `scalar::tile`, in the same order: only the weights' loads and unpacking are shared.
///
/// # Safety
/// As `tile`, and `m0 + R <= acts.m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_rows<const R: usize, const F: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize,
                                                    out: &mut [f32]) {
    let format = FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let qoff = if format.has_min() { 4 * TILE } else { 2 * TILE };
    let low = _mm512_set1_epi8(0x0f);
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..blocks {
        // SAFETY: b < blocks and every ab = mi * blocks + b < m * blocks (mi < m0 + R <= m), so
        // every offset below stays inside the slices whose lengths the caller guarantees; all
        // loads are unaligned.
        unsafe {
            let blk = tile.as_ptr().add(b * tbb);
            if m0 == 0 {
                prefetch_ahead(blk, tbb, avx512_distance(R));
            }
            let q = blk.add(qoff);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mw = if format == Format::Q4_1 {
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * TILE) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            // the block's weights, unpacked once: Q4 as low and high nibbles, Q8_0 offset by 128
            let mut w = [_mm512_setzero_si512(); 8];
            match format {
                Format::Q4_0 | Format::Q4_1 => {
                    for v in 0..4 {
                        let raw = _mm512_loadu_si512(q.add(v * 64) as *const __m512i);
                        w[2 * v] = _mm512_and_si512(raw, low);
                        w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    }
                }
                Format::Q8_0 => {
                    for (v, w) in w.iter_mut().enumerate() {
                        *w = _mm512_xor_si512(_mm512_loadu_si512(q.add(v * 64) as *const __m512i), flip);
                    }
                }
                Format::Q6K | Format::Q4K | Format::Q5K | Format::Q5_0 | Format::Q5_1
                | Format::IQ4NL | Format::IQ4XS | Format::Q3K => unreachable!("not in FORMATS"),
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let ab = (m0 + r) * blocks + b;
                let a = acts.qs.as_ptr().add(ab * QK);
                let mut isum = _mm512_setzero_si512();
                match format {
                    Format::Q4_0 | Format::Q4_1 => {
                        // Q4: with few rows, two integer chains (low and high nibbles), joined after, so
                        // each chain is half as long; from 4 rows on the rows' chains overlap, and one
                        // chain saves the join. Integer sums are exact in any order: the bits are the same.
                        if R < 4 {
                            let mut isum_hi = _mm512_setzero_si512();
                            for v in 0..4 {
                                isum = _mm512_dpbusd_epi32(isum, w[2 * v], bc!(a, 8 * v));
                                isum_hi = _mm512_dpbusd_epi32(isum_hi, w[2 * v + 1], bc!(a, 8 * v + 4));
                            }
                            isum = _mm512_add_epi32(isum, isum_hi);
                        } else {
                            for v in 0..4 {
                                isum = _mm512_dpbusd_epi32(isum, w[2 * v], bc!(a, 8 * v));
                                isum = _mm512_dpbusd_epi32(isum, w[2 * v + 1], bc!(a, 8 * v + 4));
                            }
                        }
                        if format == Format::Q4_0 {
                            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * *acts.sum.get_unchecked(ab)));
                        }
                    }
                    Format::Q8_0 => {
                        for (v, &w) in w.iter().enumerate() {
                            isum = _mm512_dpbusd_epi32(isum, w, bc!(a, 4 * v));
                        }
                        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * *acts.sum.get_unchecked(ab)));
                    }
                    Format::Q6K | Format::Q4K | Format::Q5K | Format::Q5_0 | Format::Q5_1
                    | Format::IQ4NL | Format::IQ4XS | Format::Q3K => unreachable!("not in FORMATS"),
                }
                let s = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(ab)));
                *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), *acc);
                if format == Format::Q4_1 {
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*acts.dsum.get_unchecked(ab)), *acc);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut out[(m0 + r) * TILE..(m0 + r + 1) * TILE];
        // SAFETY: `o` has exactly 16 f32, room for one unaligned 16-lane store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *acc) };
    }
}
