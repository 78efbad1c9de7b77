//! Software prefetch of the weight stream, shared by the x86 kernels.
//!
//! Why: a decode step's GEMV reads each weight once, from DRAM; the hardware prefetcher alone
//! leaves the multiply waiting on each block's loads, so the pass costs the compute time plus
//! the memory time instead of the larger of the two (AVX2 on an AMD EPYC Zen 3, 2026-12-06:
//! 35 GB/s from the cache, 24 GB/s of read bandwidth, 13.7 GB/s streaming without a prefetch,
//! `1 / (1/35 + 1/24)` = 14.2). Asking for the lines a fixed distance ahead overlaps the two.

use std::arch::x86_64::*;

/// Bytes ahead of the block being read that the AVX-512 and AMX kernels ask for, by the rows of
/// the pass. Measured on an Intel Xeon (10.4 GB/s read bound, 1 thread, SmolLM2's linear layers at M = 1,
/// the other core busy): 0: 63-72% of the bound, 256: 72-74%, 512: 73-77%, 1024: 75%, 4096:
/// 59-78%. With more rows a block takes longer to multiply and the stream needs to be asked for
/// further ahead (`cargo bench --bench gemv_rows`, 2026-12-04, same Xeon, Q4_1 streaming, GB/s
/// at 512 / 2048 / 4096 bytes: M = 1 12.7 / 11.9 / 9.5; M = 5 7.5 / 8.9 / 8.5; M = 8 6.1 / 6.8 / 7.0).
pub(super) const fn avx512_distance(rows: usize) -> usize {
    match rows {
        1 => 512,
        2 => 1024,
        3 | 4 => 2048,
        _ => 4096,
    }
}

/// The same for the AVX2 kernel, whose block takes longer to multiply, so the stream must be
/// asked for further ahead at one row (AMD EPYC Zen 3, 24 GB/s read bound, 1 thread,
/// `cargo bench --bench gemv_rows -- avx2 1 1`, Q4_1 streaming GB/s, runs alternated: 0: 14.5;
/// 512: 14.3-14.7; 1024: 15.6; 1536: 15.4-17.2; 2048: 16.3-18.3; 2560: 16.6; 3072: 16.6-18.2;
/// 4096: 13.9). From two rows on a pass is bound by its multiply; the distances there (1024 to
/// 8192 tried) are within the noise of each other, so they follow the AVX-512 table.
pub(super) const fn avx2_distance(rows: usize) -> usize {
    match rows {
        1 => 2048,
        _ => avx512_distance(rows),
    }
}

/// Bytes ahead that the Q3_K kernels (AVX2 and AVX-512, any rows) ask for. A Q3_K block streams 228
/// bytes (a super-block's 1824 / 8), under half Q8_0's 544, so the tables above ask for too few blocks
/// ahead: streaming a 4096 x 14336 matrix on 1 thread (Intel Xeon, 2 cores shared with other builds,
/// `cargo bench --bench gemv_rows -- KERNEL 1 1,4 4096x14336 q3_k`, runs alternated), AVX-512 at M = 1
/// streamed 9.1-9.9 GB/s at 512 bytes (the table's), 10.0-10.7 at 1024, 10.3-12.3 at 2048, 10.6-13.0
/// at 4096 and 12.5-12.8 at 8192; at M = 4 7.7 at 512, 8.7-10.0 at 2048 (the table's), 9.8-10.3 at
/// 4096, 10.1-10.4 at 8192; AVX2 at M = 1 11.1-11.3 GB/s at 2048 (its table's), 11.9-12.5 at 4096,
/// 12.5 at 8192 (at M = 4 it is bound by its multiply: 5.3-5.8 at every distance).
pub(super) const Q3_K_DISTANCE: usize = 4096;

/// Asks for the cache lines of the block `distance` bytes ahead, so the weight stream is in
/// flight while this block is multiplied. A prefetch of an address past the matrix is harmless
/// (it never faults; `wrapping_add` keeps the pointer arithmetic defined).
#[inline(always)]
pub(super) fn prefetch_ahead(blk: *const u8, block_bytes: usize, distance: usize) {
    let d = distance;
    let mut off = 0;
    while off < block_bytes {
        // SAFETY: _mm_prefetch never faults, whatever the address; it is only a hint.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(d + off) as *const i8) };
        off += 64;
    }
}
