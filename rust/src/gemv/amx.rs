//! The Intel AMX kernel (`tdpbssd`): many activation rows (prefill, M >= 16) against one 16-row tile.
//!
//! Why: the VNNI kernel spends 8 `vpdpbusd` per (activation row, block) on the integer sums, and a
//! row's float steps are only 3 or 4 more; one `tdpbssd` computes a whole block's sums for 16
//! activation rows x 16 weight rows (the C tile), so what is left per row is the float work.
//!
//! Tiles (configured per thread's run of tiles, see `Tiles`; all 8 registers, see `RING`): A =
//! 16 activation rows x 32 bytes of one block, loaded straight from `acts.qs` with stride `k`;
//! B = the block's weights as 8 rows (4-byte groups of K) x 64 bytes (16 weight rows x 4 bytes),
//! which is the packed Q8_0 layout itself (`pack.rs`) and, for Q4, the nibbles unpacked into a
//! scratch block: B row `2v` = low nibbles (elements `8v + i`), row `2v + 1` = high nibbles
//! (`8v + 4 + i`), minus 8 for Q4_0, so every format is signed x signed with no correction after
//! (`sum (q - 8) a = sum q a - 8 sum a` exactly). C = 16 x 16 int32, zeroed per block (scales
//! differ per block, so integer sums cannot run across blocks), stored, and read back row by row:
//! C's row `r` is activation row `r` with weight row `j` in lane `j`, the VNNI kernel's layout, so
//! the float steps are `scalar.rs`'s, lane by lane, in block order (the same bits).
//!
//! The integer sums are exact (|sum| <= 32 * 128 * 127 < 2^31), so any kernel's bits are these.
//! Rows past the last group of 16 run on the AVX-512 kernel (every CPU with AMX has AVX-512).
//!
//! Q6_K runs wholly on the AVX-512 kernel's entry (`avx512::tile`, its VNNI kernel): a
//! block's C tile sums all 32 weights of a row, and Q6_K needs the sums of its two groups of 16
//! apart (each has its own int8 scale, applied to the exact group sum before the float step). Two
//! half-depth `tdpbssd` per block (B tiles of 4 rows) with twice the stores and float-step reads
//! would be needed.
//!
//! Q4_K and Q5_K, too, run wholly on `avx512::tile` (VNNI): their tile blocks are super-blocks
//! (`pack.rs`), whose sub-blocks this schedule could unpack as Q4_1 blocks, but no machine with AMX
//! has run tests here, and a kernel nobody ran is not shipped. So do Q5_0 and Q5_1 (their codes, or
//! Q5_0's minus 16, fit a signed B tile as Q4's do, unpacked from the 5-bit layout: not written), and
//! IQ4_NL (its table values, -127..113, fit a signed B tile as Q8_0's do, looked up from the
//! nibbles with a `pshufb` where Q4 subtracts 8: not written), and IQ4_XS (a super-block, as Q4_K).
//! Q3_K too (`avx512::tile`'s own VNNI kernel, `avx512/q3k.rs`): its blocks need Q6_K's two group
//! sums apart, as above.
//!
//! Files: this one (the schedule of passes: [`tile`] and `group`), `detect` ([`supported`]),
//! `tiles` (register assignment, configuration, the `Tiles` guard), `passes` (a pass's tile
//! instructions), `unpack` (Q4 quants into B tiles), `float_steps` (a block's float steps).

mod detect;
mod float_steps;
mod passes;
mod tiles;
mod unpack;

use std::arch::x86_64::*;

use super::avx512;
use super::prefetch;
use super::format::{Format, QK};
use super::pack::TILE;
use super::quantize::QuantizedActs;

pub use detect::supported;
pub(crate) use tiles::Tiles;

use float_steps::float_steps;
use passes::{load_pass, multiply_pass, store_pass};
use unpack::unpack_pass;

/// Blocks per pass: two (A, B) pairs, with the two C sets all 8 tile registers.
const BLOCKS_PER_PASS: usize = 2;

/// Passes in flight in the scratch ring. Why this schedule (Intel Xeon, 4.1 GHz, 2026-12-04, in a
/// loop of tile instructions alone): one `tdpbssd` per ~18 cycles at best, but a tile load waits
/// until every older tile store has reached the cache, so "load, multiply, store" costs ~108 cycles
/// a round whatever it holds (1 or 3 blocks), and a load of C right after its store stalls too.
/// So pass `p` is: load its A / B tiles; store pass `p - 1`'s C tiles (multiplied a pass ago);
/// zero and multiply pass `p` into the other C set; the float steps of pass `p - 2` (stored a pass
/// ago); unpack pass `p + 1`'s Q4 quants (vector stores read by the next pass's tile loads). Alone,
/// the tile part then costs ~32 cycles a block instead of ~54. In the kernel the float steps
/// (~2.1 cycles a row and block alone) overlap the tile part little: 5-8 cycles a (row, block)
/// against AVX-512 VNNI's 9-10 (`cargo bench --bench gemv_rows`); the schedules tried (one block a
/// pass; float steps one pass behind, before or after the store) all measured within 10% of this.
const RING: usize = 2;

/// A 64-byte-aligned scratch ring by pass: the C tiles as stored (one row of 16 int32 per activation
/// row) and the unpacked Q4 B tiles, per block of the pass.
#[repr(C, align(64))]
struct Scratch {
    c: [[[i32; TILE * TILE]; BLOCKS_PER_PASS]; RING],
    b: [[[i8; QK * TILE]; BLOCKS_PER_PASS]; RING],
}

/// Same contract as `scalar::tile`. Uses this thread's `Tiles` if one lives, else configures its own.
///
/// # Safety
/// The CPU and OS must run the kernel (`supported()`); slice lengths as in `avx2::tile`'s `# Safety`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    if matches!(format,
                Format::Q6K | Format::Q4K | Format::Q5K | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL | Format::IQ4XS
                | Format::Q3K) {
        // SAFETY: AVX-512 F/BW/VNNI is part of `supported()`; the slices are this function's.
        return unsafe { avx512::tile(format, tile, blocks, acts, out) };
    }
    let full = acts.m / TILE * TILE;
    if full > 0 {
        // SAFETY: `supported()` is this function's contract.
        let _own = unsafe { Tiles::configure() };
        for m0 in (0..full).step_by(TILE) {
            // SAFETY: this function's contract, the tiles configured (by `_own` or the thread's
            // guard), and m0 + 16 <= acts.m.
            unsafe {
                match format {
                    Format::Q4_0 => group::<0>(tile, blocks, acts, m0, out),
                    Format::Q4_1 => group::<1>(tile, blocks, acts, m0, out),
                    Format::Q8_0 => group::<2>(tile, blocks, acts, m0, out),
                    Format::Q6K | Format::Q4K | Format::Q5K | Format::Q5_0 | Format::Q5_1
                    | Format::IQ4NL | Format::IQ4XS | Format::Q3K => unreachable!("runs on avx512::tile (above)"),
                }
            }
        }
    }
    if full < acts.m {
        // SAFETY: AVX-512 F/BW/VNNI is part of `supported()`; the slices are this function's.
        unsafe { avx512::tile_from(format, tile, blocks, acts, full, out) };
    }
}

/// The format of `group`'s constant `F`.
const FORMATS: [Format; 3] = [Format::Q4_0, Format::Q4_1, Format::Q8_0];

/// Activation rows `m0 .. m0 + 16` of `tile`'s contract, for the format `FORMATS[F]`.
///
/// # Safety
/// As `tile`, `m0 + 16 <= acts.m`, and this thread's tiles configured as `TileConfig::new()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group<const F: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize, out: &mut [f32]) {
    let format = FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let qoff = TILE * format.header_bytes();
    let k = blocks * QK;
    // Not zeroed (6 KB a group): every C tile is stored, and every B tile unpacked, before it is read.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    let sp = scratch.as_mut_ptr();
    // SAFETY: places inside `scratch` (no reference to its uninitialized bytes is made).
    let (cs, bs) = unsafe { (&raw mut (*sp).c as *mut i32, &raw mut (*sp).b as *mut i8) };
    // the C tile (slot, u) and the B tile (slot, u) of the ring
    let c_at = |slot: usize, u: usize| cs.wrapping_add((slot * BLOCKS_PER_PASS + u) * TILE * TILE);
    let b_at = |slot: usize, u: usize| bs.wrapping_add((slot * BLOCKS_PER_PASS + u) * QK * TILE);
    let mut acc = [_mm512_setzero_ps(); TILE];
    let passes = blocks.div_ceil(BLOCKS_PER_PASS);
    // (first block, blocks) of pass `p`
    let pass = |p: usize| (p * BLOCKS_PER_PASS, (blocks - p * BLOCKS_PER_PASS).min(BLOCKS_PER_PASS));
    // SAFETY (all blocks below): every pass p < passes has b0 + n <= blocks, so each block's tile
    // bytes (`tbb` from `b * tbb`) lie inside `tile`, and each A tile (16 rows of 32 bytes at
    // `(m0 + r) * k + b * 32`, r < 16, m0 + 16 <= m) inside `acts.qs` (`m * k` bytes); the scratch
    // is this frame's, 64-byte aligned, and indexed below its ring and pass sizes.
    if format != Format::Q8_0 {
        let (b0, n) = pass(0);
        // SAFETY: as above.
        unsafe { unpack_pass(tile.as_ptr().add(b0 * tbb + qoff), tbb, n, b_at(0, 0), format == Format::Q4_0) };
    }
    for p in 0..passes + 2 {
        if p < passes {
            let (b0, n) = pass(p);
            // SAFETY: as above.
            unsafe {
                let blk = tile.as_ptr().add(b0 * tbb);
                if m0 == 0 {
                    prefetch::prefetch_ahead(blk, n * tbb, prefetch::avx512_distance(8)); // the first group streams the weights
                }
                let bq: [*const i8; 2] = if format == Format::Q8_0 {
                    [blk.add(qoff) as *const i8, blk.add((tbb + qoff) * (n - 1)) as *const i8]
                } else {
                    [b_at(p % RING, 0) as *const i8, b_at(p % RING, n - 1) as *const i8]
                };
                load_pass(n, acts.qs.as_ptr().add(m0 * k + b0 * QK), k, bq);
            }
        }
        if (1..=passes).contains(&(p)) {
            let n = pass(p - 1).1;
            // SAFETY: as above; pass p - 1's C set was multiplied in the last iteration.
            unsafe { store_pass((p - 1) % 2, n, c_at((p - 1) % RING, 0)) };
        }
        if p < passes {
            // SAFETY: the tiles are configured and this pass's A / B tiles loaded.
            unsafe { multiply_pass(p % 2, pass(p).1) };
        }
        if (2..passes + 2).contains(&p) {
            let (b0, n) = pass(p - 2);
            for u in 0..n {
                // SAFETY: as above; the C tile of block b0 + u was stored in the last iteration.
                unsafe {
                    float_steps::<F>(&mut acc, tile.as_ptr().add((b0 + u) * tbb), c_at((p - 2) % RING, u), acts,
                                     m0, blocks, b0 + u)
                };
            }
        }
        if format != Format::Q8_0 && p + 1 < passes {
            let (b1, n1) = pass(p + 1);
            // SAFETY: as above; this ring slot's last reader (pass p - 1's tile loads) came before.
            unsafe { unpack_pass(tile.as_ptr().add(b1 * tbb + qoff), tbb, n1, b_at((p + 1) % RING, 0), format == Format::Q4_0) };
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut out[(m0 + r) * TILE..(m0 + r + 1) * TILE];
        // SAFETY: `o` has exactly 16 f32, room for one unaligned 16-lane store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *acc) };
    }
}
