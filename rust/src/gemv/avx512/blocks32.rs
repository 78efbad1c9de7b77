//! The AVX-512 VNNI kernel for the block-of-32 formats Q6_K, Q5_0, Q5_1 and IQ4_NL.
//!
//! The shape of `super::tile_rows` (Q4_0, Q4_1, Q8_0): one 16-row tile, one row per 32-bit lane of
//! a zmm; each block's weights loaded and unpacked once into eight vectors of unsigned bytes, vector
//! `v` holding elements `4v .. 4v + 4` of every lane (Q8_0's order), then for up to 8 activation
//! rows a pass `dpbusd` (unsigned weights times the row's four signed bytes broadcast, summed into
//! 32 bits with no saturation) and the float steps of `scalar.rs`, in its order. Every integer sum
//! is exact, so its order is free; every float operation is `scalar.rs`'s, so the bits are.
//!
//! - Q5_0 (Q5_1): the eight vectors of 5-bit codes (0..31) unpacked from the five of `pack.rs`;
//!   the chain starts at `-16 * sum(a)` (at 0), so it ends at `isum` of `q - 16` (of `q`); then
//!   Q4_0's (Q4_1's) float steps. Every partial sum lies below 2^18 in magnitude.
//! - IQ4_NL: the nibbles (Q4_0's layout) looked up with `vpshufb` in the table of the values plus
//!   128 (1..241, unsigned), the chain started at `-128 * sum(a)`; then Q8_0's float step. (The AVX2
//!   kernel's `maddubs(|w|, sign(a, w))` has no AVX-512 `sign`.)
//! - Q6_K: the four vectors of each group's q (0..63) from its three (`pack.rs`), one chain per
//!   group of 16 started at `-32 * sum_g(a)`, so they end at `isum_0` and `isum_1`, each at most 16
//!   x 32 x 127 = 65024 in magnitude. `T = sc_0 * isum_0 + sc_1 * isum_1` is formed in f32 as
//!   `fma(isum_0, sc_0, isum_1 * sc_1)`: every operand, product and sum is an integer below 2^24 in
//!   magnitude (|T| <= 2 x 65024 x 128 = 16646144), so every step is exact and `T` is scalar's
//!   integer `T`, converted. That is two conversions, a multiply and an `fma` a row, against two
//!   `vpmulld` (two uops each, 10 cycles' latency), an add and a conversion.
//!
//! The unpacking uses `vpternlogd` where it saves an op over AVX2's `and`/`or` pairs: a Q5 block
//! costs 19 vector ops besides its 5 loads (AVX2: 23 a half-tile), a Q6_K block 20 besides its 6
//! loads and 6 for the scales, an IQ4_NL block 20 (an `and`, a shift, an `and` and two `pshufb` a
//! load). A row then costs 8 `dpbusd` (the fewest for 16 lanes x 32 byte products) and 4 other ops
//! (the start's broadcast, a conversion, the scale's multiply and the `fma`; Q5_1 the minimum's
//! `fma` instead of the start; Q6_K 8), so from 4 rows on a block is bound by the rows'
//! multiplies, not the unpacking, as in `super::tile_rows`.
//!
//! Measured (Intel Xeon @ 2.60GHz with AVX-512 VNNI, 2 cores, 1 thread, other sessions' builds and
//! benches on the cores, so each number the median of 3 runs of each kernel, alternated; `cargo
//! bench --bench gemv_rows -- KERNEL 1 1,2,4,8 4096x4096 q6_k,q5_0,q5_1,iq4_nl`, KERNEL `avx2` or
//! `avx512_vnni`, and the same at 1536x768): streaming a 4096 x 4096 matrix, GB/s of the bytes a
//! product reads, AVX2 -> this kernel:
//!
//! | format | M = 1       | M = 2      | M = 4      | M = 8      |
//! |--------|-------------|------------|------------|------------|
//! | Q6_K   | 7.7 -> 10.1 | 7.1 -> 7.7 | 5.1 -> 9.8 | 3.0 -> 5.6 |
//! | Q5_0   | 7.9 -> 7.7  | 7.0 -> 7.7 | 5.1 -> 7.7 | 3.0 -> 5.1 |
//! | Q5_1   | 7.7 -> 7.6  | 7.3 -> 7.4 | 5.2 -> 7.1 | 3.2 -> 5.7 |
//! | IQ4_NL | 6.8 -> 7.6  | 5.5 -> 7.6 | 3.9 -> 6.7 | 2.0 -> 4.3 |
//!
//! and from the cache (1536 x 768), ns a (row, 16 x 32 tile block), AVX2 -> this kernel:
//!
//! | format | M = 1       | M = 2       | M = 4       |
//! |--------|-------------|-------------|-------------|
//! | Q6_K   | 24.4 -> 8.6 | 21.4 -> 6.1 | 11.5 -> 6.0 |
//! | Q5_0   | 13.0 -> 6.9 | 9.4 -> 5.2  | 8.8 -> 4.8  |
//! | Q5_1   | 14.1 -> 6.9 | 9.6 -> 5.7  | 15.2 -> 4.8 |
//! | IQ4_NL | 14.9 -> 6.8 | 13.3 -> 5.3 | 20.4 -> 4.6 |
//!
//! At M = 1 both kernels stream at the bound the load left (single runs reached 10-11 GB/s). From
//! M = 2 on the AVX2 kernel is bound by its multiplies, and this one stays near the bound up to
//! M = 4; at M = 8 a block's multiplies take about as long as its bytes take to arrive. (From the
//! cache this kernel took 4.5-5.8 ns at M = 8 in some runs and 9-10 in others, as `super::tile_rows`'s
//! Q4_0 did in the same runs.) Tried and dropped: the chains' starts computed ahead for 16 blocks
//! at a time into a buffer on the stack (a broadcast load each instead of scalar arithmetic and a
//! broadcast from a general register): from the cache Q6_K took 6.0 ns at M = 8 against 5.3-5.4,
//! and 6.7 at M = 2 against 5.6; Q5_0 and IQ4_NL within the noise.

use std::arch::x86_64::*;

use super::super::format::{Format, IQ4NL_VALUES, QK};
use super::super::pack::TILE;
use super::super::prefetch::{avx512_distance, prefetch_ahead};
use super::super::quantize::QuantizedActs;
use super::ROWS;

/// `super::tile` for Q6_K, Q5_0, Q5_1 and IQ4_NL.
///
/// # Safety
/// As `super::tile`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let mut m0 = 0;
    while m0 < acts.m {
        let rows = (acts.m - m0).min(ROWS);
        // SAFETY: this function's own contract, and m0 + rows <= acts.m.
        unsafe {
            match format {
                Format::Q6K => by_rows!(tile_rows, rows, 0, (tile, blocks, acts, m0, out)),
                Format::Q5_0 => by_rows!(tile_rows, rows, 1, (tile, blocks, acts, m0, out)),
                Format::Q5_1 => by_rows!(tile_rows, rows, 2, (tile, blocks, acts, m0, out)),
                Format::IQ4NL => by_rows!(tile_rows, rows, 3, (tile, blocks, acts, m0, out)),
                Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q4K | Format::Q5K | Format::IQ4XS | Format::Q3K => {
                    unreachable!("not a format of this file (`super::tile`)")
                }
            }
        }
        m0 += rows;
    }
}

/// The format of `tile_rows`'s constant `F`.
const FORMATS: [Format; 4] = [Format::Q6K, Format::Q5_0, Format::Q5_1, Format::IQ4NL];

/// Rows `m0 .. m0 + R` of `tile`'s contract, for the format `FORMATS[F]`. Per row the f32 operations
/// are those of `scalar::tile`, in the same order (Q6_K's `T` is formed in f32, exactly: see the
/// module docs): only the weights' loads and unpacking are shared.
///
/// # Safety
/// As `tile`, and `m0 + R <= acts.m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_rows<const R: usize, const F: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize,
                                                    out: &mut [f32]) {
    let format = FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let qoff = TILE * format.header_bytes();
    // how far the unsigned bytes lie above the integers they stand for (Q5_0's `q - 16`, IQ4_NL's
    // values + 128): the chain starts at `-offset * sum(a)`
    let offset = match format {
        Format::Q5_0 => 16,
        Format::IQ4NL => 128,
        _ => 0,
    };
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..blocks {
        // SAFETY: b < blocks and every ab = mi * blocks + b < m * blocks (mi < m0 + R <= m), so
        // every offset below stays inside the slices whose lengths the caller guarantees (see
        // `avx2::tile`'s `# Safety`); all loads are unaligned.
        unsafe {
            let blk = tile.as_ptr().add(b * tbb);
            if m0 == 0 {
                prefetch_ahead(blk, tbb, avx512_distance(R));
            }
            let q = blk.add(qoff);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mw = if format.has_min() {
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * TILE) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            // the block's weights, unpacked once: vector v = elements 4v .. 4v + 4 of every lane
            let w = match format {
                Format::Q6K => {
                    let (g0, g1) = (unpack_q6_k(q), unpack_q6_k(q.add(3 * 64)));
                    [g0[0], g0[1], g0[2], g0[3], g1[0], g1[1], g1[2], g1[3]]
                }
                Format::Q5_0 | Format::Q5_1 => unpack_q5(q),
                _ => unpack_iq4(q),
            };
            // Q6_K: lane j's group scales (sc_0, sc_1) as f32
            let sc = if format == Format::Q6K {
                let pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(blk.add(2 * TILE) as *const __m256i));
                [_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16)),
                 _mm512_cvtepi32_ps(_mm512_srai_epi32(pair, 16))]
            } else {
                [_mm512_setzero_ps(); 2]
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let ab = (m0 + r) * blocks + b;
                let a = acts.qs.as_ptr().add(ab * QK);
                let s = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(ab)));
                let sum = *acts.sum.get_unchecked(ab);
                if format == Format::Q6K {
                    let lo = *acts.sum_lo.get_unchecked(ab);
                    let (mut i0, mut i1) = (_mm512_set1_epi32(-32 * lo), _mm512_set1_epi32(-32 * (sum - lo)));
                    for v in 0..4 {
                        i0 = _mm512_dpbusd_epi32(i0, w[v], bc!(a, 4 * v));
                        i1 = _mm512_dpbusd_epi32(i1, w[4 + v], bc!(a, 4 * (4 + v)));
                    }
                    // T, exact (see the module docs)
                    let t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), sc[0],
                                            _mm512_mul_ps(_mm512_cvtepi32_ps(i1), sc[1]));
                    *acc = _mm512_fmadd_ps(s, t, *acc);
                    continue;
                }
                // With few rows two chains (the block's halves), joined after, so each is half as
                // long; from 4 rows on the rows' chains overlap, and one chain saves the join.
                let mut isum = _mm512_set1_epi32(-offset * sum);
                if R < 4 {
                    let mut isum_hi = _mm512_setzero_si512();
                    for v in 0..4 {
                        isum = _mm512_dpbusd_epi32(isum, w[v], bc!(a, 4 * v));
                        isum_hi = _mm512_dpbusd_epi32(isum_hi, w[4 + v], bc!(a, 4 * (4 + v)));
                    }
                    isum = _mm512_add_epi32(isum, isum_hi);
                } else {
                    for (v, &w) in w.iter().enumerate() {
                        isum = _mm512_dpbusd_epi32(isum, w, bc!(a, 4 * v));
                    }
                }
                *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), *acc);
                if format.has_min() {
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

/// `vpternlogd`'s table for `c ? a : b`, bit by bit (`a`, `b`, `c` are the tables 0xf0, 0xcc, 0xaa).
const SELECT: i32 = (0xf0 & 0xaa) | (0xcc & !0xaa);

/// `vpternlogd`'s table for `a | b | c`.
const OR3: i32 = 0xf0 | 0xcc | 0xaa;

/// One Q6_K group's three packed vectors at `p` (`pack.rs`) as its four vectors of q (0..63):
/// elements `4u + i` of the group in vector `u`, Q8_0's order (as `avx2::blocks32::unpack_q6_k`).
///
/// # Safety
/// AVX-512 F/BW; `p` readable for 192 bytes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q6_k(p: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller's contract; all loads unaligned.
    let raw = unsafe {
        [_mm512_loadu_si512(p as *const __m512i), _mm512_loadu_si512(p.add(64) as *const __m512i),
         _mm512_loadu_si512(p.add(128) as *const __m512i)]
    };
    let low6 = _mm512_set1_epi8(0x3f);
    // the fourth vector's bits 0-1, 2-3, 4-5 are the top bit pairs of the three: each vector's top
    // pair masked first, so the 16-bit shifts move only zeros in from the next byte; one
    // `vpternlogd` ors the three
    let top2 = _mm512_set1_epi8(-64);
    let t = [_mm512_srli_epi16(_mm512_and_si512(raw[0], top2), 6), _mm512_srli_epi16(_mm512_and_si512(raw[1], top2), 4),
             _mm512_srli_epi16(_mm512_and_si512(raw[2], top2), 2)];
    let top = _mm512_ternarylogic_epi32(t[0], t[1], t[2], OR3);
    [_mm512_and_si512(raw[0], low6), _mm512_and_si512(raw[1], low6), _mm512_and_si512(raw[2], low6), top]
}

/// A block's five vectors of 5-bit codes at `q` (`pack.rs`) as eight vectors of codes (0..31):
/// elements `4v + i` in vector `v`, Q8_0's order.
///
/// # Safety
/// AVX-512 F/BW; `q` readable for 320 bytes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q5(q: *const u8) -> [__m512i; 8] {
    // SAFETY: the caller's contract; all loads unaligned.
    let raw: [__m512i; 5] = unsafe { std::array::from_fn(|k| _mm512_loadu_si512(q.add(k * 64) as *const __m512i)) };
    let (low5, top3) = (_mm512_set1_epi8(0x1f), _mm512_set1_epi8(0x1c));
    // vector 4's bit pairs 2k .. 2k + 2 at bits 0..2 (16-bit shifts: what moves in from the next
    // byte is masked off at the end)
    let pairs = [raw[4], _mm512_srli_epi16(raw[4], 2), _mm512_srli_epi16(raw[4], 4), _mm512_srli_epi16(raw[4], 6)];
    let mut w = [_mm512_setzero_si512(); 8];
    for k in 0..4 {
        w[k] = _mm512_and_si512(raw[k], low5);
        // the top 3 bits at 2..5 over the pair (one select), then the bits above 5 cleared
        let c16 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw[k], 3), pairs[k], top3, SELECT);
        w[4 + k] = _mm512_and_si512(c16, low5);
    }
    w
}

/// A block's IQ4_NL codes at `q` (Q4's nibble layout, `pack.rs`) as eight vectors of their table
/// values plus 128 (1..241, unsigned): elements `4v + i` in vector `v`, Q8_0's order (vector `2u` the
/// low nibbles of load `u`, `2u + 1` its high nibbles).
///
/// # Safety
/// AVX-512 F/BW; `q` readable for 256 bytes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_iq4(q: *const u8) -> [__m512i; 8] {
    let low = _mm512_set1_epi8(0x0f);
    // SAFETY: IQ4NL_VALUES is 16 bytes, one unaligned 128-bit load. `^ 0x80` adds 128 to an int8.
    let table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i) }),
        _mm512_set1_epi8(-128));
    let mut w = [_mm512_setzero_si512(); 8];
    for u in 0..4 {
        // SAFETY: the caller's contract; an unaligned load inside `q`'s 256 bytes.
        let raw = unsafe { _mm512_loadu_si512(q.add(u * 64) as *const __m512i) };
        // codes 0..15: `vpshufb` indexes each 128-bit lane's copy of the table (bit 7 clear, so no byte is zeroed)
        w[2 * u] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
        w[2 * u + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
    w
}
