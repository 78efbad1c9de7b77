//! A block's float steps over its stored C tile, for a group's 16 activation rows (AVX-512).
//!
//! Why separate: this is where the kernel's bits are decided (`scalar.rs`'s float steps, lane by
//! lane, in block order); everything before it computes exact integer sums.

use std::arch::x86_64::*;

use crate::gemv::format::Format;
use crate::gemv::pack::TILE;
use crate::gemv::quantize::QuantizedActs;
use super::FORMATS;

/// Block `b`'s float steps for the group's 16 rows, as `scalar.rs` (lane `j` = weight row `j`):
/// `acc[r] = fma(d_w * d_a, isum, acc[r])`, then for Q4_1 `acc[r] = fma(m_w, dsum_a, acc[r])`.
///
/// # Safety
/// AVX-512 F; `blk` the block's tile bytes, `c` its stored C tile (64-byte aligned, 16 x 16
/// int32), `(m0 + 16) * blocks <= acts.d.len()` (and `dsum`'s), b < blocks.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn float_steps<const F: usize>(acc: &mut [__m512; TILE], blk: *const u8, c: *const i32, acts: &QuantizedActs,
                                                 m0: usize, blocks: usize, b: usize) {
    let format = FORMATS[F];
    // SAFETY: the caller's contract: every read lies in `blk`'s scales, `c`'s 1 KB or `acts`' (row, block) values.
    unsafe {
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let mw = if format == Format::Q4_1 {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * TILE) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            let ab = (m0 + r) * blocks + b;
            let isum = _mm512_load_si512(c.add(r * TILE) as *const __m512i);
            let s = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(ab)));
            *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), *acc);
            if format == Format::Q4_1 {
                *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*acts.dsum.get_unchecked(ab)), *acc);
            }
        }
    }
}
