//! The AVX2 kernel for Q3_K: one 16-row tile as two halves of 8 lanes, as `mod.rs`'s.
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

use std::arch::x86_64::*;

use super::super::format::{Format, Q4_K_SUBS, QK};
use super::super::pack::{Q3_K_CODES, Q3_K_SC, Q3_K_SUB_CODES, TILE};
use super::super::prefetch::{prefetch_ahead, Q3_K_DISTANCE};
use super::super::quantize::QuantizedActs;
use super::{store_rows, HALF};

/// Rows `m0 .. m0 + R` of `super::tile`'s contract for Q3_K (`NH` as `tile_rows`, `blocks32.rs`):
/// blocks of 32 in order (block `b` is sub-block `b % 8` of super-block `b / 8`, `pack.rs`), each
/// Q6_K's integer step (`blocks32.rs`) over its two groups (see the module docs) and Q8_0's float
/// step with the super-block's `d`, per row and lane the f32 operations of `scalar::tile`, in the
/// same order.
///
/// # Safety
/// As `super::tile`, `m0 + R <= acts.m`, `NH` is 1 or 2, and `blocks` a multiple of 8.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn tile_rows_q3_k<const R: usize, const NH: usize>(tile: &[u8], blocks: usize,
                                                                     acts: &QuantizedActs, m0: usize, out: &mut [f32]) {
    let tbb = TILE * Format::Q3K.block_bytes();
    let sub = tbb / Q4_K_SUBS; // the stream's share of a block, for the prefetch
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
                    let (_, sc) = scale_pairs!(sb.add(Q3_K_SC + 2 * TILE * u + h * 2 * HALF));
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
