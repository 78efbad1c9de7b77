//! The AVX-512 VNNI kernel for the super-block formats Q4_K, Q5_K and IQ4_XS.

use super::super::format::Format;
use super::super::quantize::QuantizedActs;

/// `super::tile` for Q4_K, Q5_K and IQ4_XS.
///
/// # Safety
/// As `super::tile`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    // Not written yet: the AVX2 kernel's bits (scalar where a CPU lacks AVX2).
    if super::super::avx2::supported() {
        // SAFETY: AVX2, F16C and FMA were detected just above; the slices are the caller's.
        return unsafe { super::super::avx2::tile(format, tile, blocks, acts, out) };
    }
    super::super::scalar::tile(format, tile, blocks, acts, out)
}
