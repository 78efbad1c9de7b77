//! Q4 blocks' packed quants unpacked into the B tile layout (AVX-512), so every format is signed x
//! signed for `tdpbssd`.
//!
//! Why separate: Q8_0's packed layout is already a B tile; only Q4 needs this step, run a pass
//! ahead of the tile loads that read it.

use std::arch::x86_64::*;

use crate::gemv::format::QK;
use crate::gemv::pack::TILE;

/// The `n` Q4 blocks of one pass (quants at `q`, `q + tbb`) unpacked by `unpack_q4` into `dst`
/// (and `dst + 512`).
///
/// # Safety
/// As `unpack_q4`, for each of the `n <= 2` blocks.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn unpack_pass(q: *const u8, tbb: usize, n: usize, dst: *mut i8, minus8: bool) {
    for u in 0..n {
        // SAFETY: the caller's contract.
        unsafe { unpack_q4(q.add(u * tbb), dst.add(u * QK * TILE), minus8) };
    }
}

/// A Q4 block's packed quants (4 x 64 bytes at `q`) as the B tile (8 x 64 bytes at `dst`): row
/// `2v` the low nibbles of vector `v`, row `2v + 1` the high ones, each minus 8 if `minus8` (Q4_0).
///
/// # Safety
/// AVX-512 F/BW; `q` readable for 256 bytes, `dst` writable for 512.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q4(q: *const u8, dst: *mut i8, minus8: bool) {
    let low = _mm512_set1_epi8(0x0f);
    let eight = _mm512_set1_epi8(if minus8 { 8 } else { 0 });
    for v in 0..4 {
        // SAFETY: v < 4, so the reads lie in q's 256 bytes and the writes in dst's 512 (unaligned).
        unsafe {
            let raw = _mm512_loadu_si512(q.add(v * 64) as *const __m512i);
            let lo = _mm512_sub_epi8(_mm512_and_si512(raw, low), eight);
            let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), eight);
            _mm512_storeu_si512(dst.add(128 * v) as *mut __m512i, lo);
            _mm512_storeu_si512(dst.add(128 * v + 64) as *mut __m512i, hi);
        }
    }
}
