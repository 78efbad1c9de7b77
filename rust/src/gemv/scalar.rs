//! The portable kernel: one 16-row tile, any CPU. The reference the SIMD kernels must equal bit for bit.
//!
//! Per row and block: the exact integer dot product `isum` (Q4_0: of `q - 8`; Q5_0: of `q - 16`; Q6_K: `T = sc_0 *
//! isum_0 + sc_1 * isum_1` over its two groups of 16, `isum_g` of `q - 32`, |T| <= 2 * 16 * 32 *
//! 127 * 128 < 2^24 so exact as an f32), then, in this order, `acc = fma(d_w * d_a, isum, acc)`
//! and for Q4_1 and Q5_1 `acc = fma(m_w, d_a * sum_a, acc)` (fused multiply-adds: one rounding each, and
//! one instruction each on the SIMD paths, where a pass over several activation rows is bound by
//! its per-row float work), blocks in order. The SIMD kernels do the same f32 operations lane by
//! lane.
//!
//! Q4_K (a tile block a super-block, `pack.rs`): each sub-block `u` is a Q4_1 block, its `isum` of
//! the codes (0..15), with `d_w = d * sc_u` and `m_w = -(dmin * m_u)`, both exact in f32 (an f16
//! times a 6-bit integer: at most 17 significant bits), so no rounding is added to Q4_1's steps.
//! Q5_K is the same with 5-bit codes (0..31; `isum` at most 32 * 31 * 127 < 2^24, exact as an f32).
//!
//! IQ4_NL: `isum` = `T` = the sum of the codes' table values ([`IQ4NL_VALUES`], -127..113) times the
//! activations (|T| <= 32 * 127 * 127 < 2^24, exact as an f32), then Q8_0's float step with `d`.
//! IQ4_XS (a tile block a super-block, as Q4_K): each sub-block `u` is an IQ4_NL block with `d_w = d *
//! (ls_u - 32)`, exact in f32 (an f16 times an integer in -32..31: at most 11 + 5 significant bits,
//! and a subnormal f16 times it is a normal or subnormal f32 multiple of 2^-24), and no minimum.
//!
//! Q3_K (a tile block a super-block, read a block of 32 at a time): Q6_K's steps, `T = sc_0 *
//! isum_0 + sc_1 * isum_1` over the block's two groups of 16, `isum_g` of the codes minus 4 (q in
//! -4..3), `sc_g` the group's scale minus 32 (-32..31); |T| <= 2 * 16 * 4 * 128 * 32 < 2^24, exact as
//! an f32; then Q8_0's float step with the super-block's `d`.

use super::format::{f16_to_f32, Format, IQ4NL_VALUES, Q4_K_SUBS, QK};
use super::pack::{
    IQ4_XS_CODES, IQ4_XS_SC, Q3_K_CODES, Q3_K_SC, Q3_K_SUB_CODES, Q4_K_CODES, Q4_K_DMIN, Q4_K_M, Q4_K_SC,
    Q4_K_SUB_CODES, Q5_SUB_CODES, TILE,
};
use super::quantize::QuantizedActs;

/// `out[mi * 16 + j]` = row `j` of the tile times activation row `mi`.
pub fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    if matches!(format, Format::Q4K | Format::Q5K | Format::IQ4XS) {
        return tile_k(format, tile, blocks, acts, out);
    }
    if format == Format::Q3K {
        return tile_q3_k(tile, blocks, acts, out);
    }
    let tbb = TILE * format.block_bytes();
    let qoff = TILE * format.header_bytes();
    for mi in 0..acts.m {
        let mut acc = [0f32; TILE];
        for b in 0..blocks {
            let blk = &tile[b * tbb..(b + 1) * tbb];
            let ab = mi * blocks + b;
            let a = &acts.qs[ab * QK..(ab + 1) * QK];
            let q = &blk[qoff..];
            for (j, acc) in acc.iter_mut().enumerate() {
                let isum = match format {
                    Format::Q4_0 | Format::Q4_1 => {
                        let s = q4_isum(q, j, a);
                        if format == Format::Q4_0 {
                            s - 8 * acts.sum[ab]
                        } else {
                            s
                        }
                    }
                    Format::Q5_0 => q5_isum(q, j, a) - 16 * acts.sum[ab],
                    Format::Q5_1 => q5_isum(q, j, a),
                    Format::IQ4NL => iq4_isum(q, j, a),
                    Format::Q8_0 => {
                        let mut s = 0i32;
                        for v in 0..8 {
                            for i in 0..4 {
                                s += q[v * 64 + j * 4 + i] as i8 as i32 * a[4 * v + i] as i32;
                            }
                        }
                        s
                    }
                    Format::Q6K => {
                        let sc = |g: usize| blk[2 * TILE + 2 * j + g] as i8 as i32;
                        let mut isum = [0i32; 2];
                        for (e, &a) in a.iter().enumerate() {
                            isum[e / 16] += (tile_q6_k_quant(q, j, e) as i32 - 32) * a as i32;
                        }
                        sc(0) * isum[0] + sc(1) * isum[1]
                    }
                    Format::Q4K | Format::Q5K | Format::IQ4XS => unreachable!("tile_k computes the super-blocks"),
                    Format::Q3K => unreachable!("tile_q3_k computes Q3_K"),
                };
                let dw = f16_to_f32(u16::from_le_bytes([blk[2 * j], blk[2 * j + 1]]));
                *acc = (dw * acts.d[ab]).mul_add(isum as f32, *acc);
                if format.has_min() {
                    let mw = f16_to_f32(u16::from_le_bytes([blk[2 * TILE + 2 * j], blk[2 * TILE + 2 * j + 1]]));
                    *acc = mw.mul_add(acts.dsum[ab], *acc);
                }
            }
        }
        out[mi * TILE..(mi + 1) * TILE].copy_from_slice(&acc);
    }
}

/// `tile` for Q4_K, Q5_K and IQ4_XS: super-blocks in order and, inside, their 8 sub-blocks (activation
/// blocks `8t + u`), each Q4_1's steps with the sub-block's exact scale and minimum (IQ4_XS: IQ4_NL's
/// step with its exact scale; see the module docs).
fn tile_k(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let tbb = TILE * format.block_bytes();
    let (sc_off, codes, sub_codes) = match format {
        Format::Q5K => (Q4_K_SC, Q4_K_CODES, Q5_SUB_CODES),
        Format::IQ4XS => (IQ4_XS_SC, IQ4_XS_CODES, Q4_K_SUB_CODES),
        _ => (Q4_K_SC, Q4_K_CODES, Q4_K_SUB_CODES),
    };
    for mi in 0..acts.m {
        let mut acc = [0f32; TILE];
        for (t, sb) in tile.chunks_exact(tbb).take(blocks / Q4_K_SUBS).enumerate() {
            let f16 = |off: usize| f16_to_f32(u16::from_le_bytes([sb[off], sb[off + 1]]));
            for u in 0..Q4_K_SUBS {
                let ab = mi * blocks + t * Q4_K_SUBS + u;
                let a = &acts.qs[ab * QK..(ab + 1) * QK];
                let q = &sb[codes + sub_codes * u..];
                for (j, acc) in acc.iter_mut().enumerate() {
                    let sc = sb[sc_off + TILE * u + j];
                    if format == Format::IQ4XS {
                        let dw = f16(2 * j) * sc as i8 as f32;
                        *acc = (dw * acts.d[ab]).mul_add(iq4_isum(q, j, a) as f32, *acc);
                        continue;
                    }
                    let dw = f16(2 * j) * sc as f32;
                    let mw = -(f16(Q4_K_DMIN + 2 * j) * sb[Q4_K_M + TILE * u + j] as f32);
                    let isum = if format == Format::Q5K { q5_isum(q, j, a) } else { q4_isum(q, j, a) };
                    *acc = (dw * acts.d[ab]).mul_add(isum as f32, *acc);
                    *acc = mw.mul_add(acts.dsum[ab], *acc);
                }
            }
        }
        out[mi * TILE..(mi + 1) * TILE].copy_from_slice(&acc);
    }
}

/// `tile` for Q3_K: blocks of 32 in order (block `b` is sub-block `b % 8` of super-block `b / 8`),
/// each Q6_K's integer step over its two groups and Q8_0's float step with the super-block's `d`.
fn tile_q3_k(tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let tbb = TILE * Format::Q3K.block_bytes();
    for mi in 0..acts.m {
        let mut acc = [0f32; TILE];
        for b in 0..blocks {
            let (sb, u) = (&tile[b / Q4_K_SUBS * tbb..][..tbb], b % Q4_K_SUBS);
            let ab = mi * blocks + b;
            let a = &acts.qs[ab * QK..(ab + 1) * QK];
            let q = &sb[Q3_K_CODES + Q3_K_SUB_CODES * u..][..Q3_K_SUB_CODES];
            for (j, acc) in acc.iter_mut().enumerate() {
                let sc = |g: usize| sb[Q3_K_SC + 2 * TILE * u + 2 * j + g] as i8 as i32;
                let mut isum = [0i32; 2];
                for (e, &a) in a.iter().enumerate() {
                    isum[e / 16] += (tile_q3_k_code(q, j, e) as i32 - 4) * a as i32;
                }
                let t = sc(0) * isum[0] + sc(1) * isum[1];
                let dw = f16_to_f32(u16::from_le_bytes([sb[2 * j], sb[2 * j + 1]]));
                *acc = (dw * acts.d[ab]).mul_add(t as f32, *acc);
            }
        }
        out[mi * TILE..(mi + 1) * TILE].copy_from_slice(&acc);
    }
}

/// Element `e` (0..32)'s code (0..7) of lane `j` in a Q3_K block's packed codes `q` (`pack.rs`):
/// vector `v = e / 4`, byte `i = e % 4` of the lane in vectors `k` = 0..3.
fn tile_q3_k_code(q: &[u8], j: usize, e: usize) -> u8 {
    let (v, i) = (e / 4, e % 4);
    let byte = |k: usize| q[k * 64 + 4 * j + i];
    match v {
        0..=2 => byte(v) & 7,
        3..=5 => (byte(v - 3) >> 3) & 7,
        6 => (byte(0) >> 6) | (((byte(2) >> 6) & 1) << 2),
        _ => (byte(1) >> 6) | ((byte(2) >> 7) << 2),
    }
}

/// Lane `j`'s sum of its 32 codes (0..15, the Q4 nibble layout of `pack.rs` at `q`) times `a`, exact.
fn q4_isum(q: &[u8], j: usize, a: &[i8]) -> i32 {
    let mut s = 0i32;
    for v in 0..4 {
        for i in 0..4 {
            let byte = q[v * 64 + j * 4 + i];
            s += (byte & 0x0f) as i32 * a[8 * v + i] as i32;
            s += (byte >> 4) as i32 * a[8 * v + 4 + i] as i32;
        }
    }
    s
}

/// Lane `j`'s sum of its 32 codes' IQ4_NL values (the codes 0..15 in the Q4 nibble layout of
/// `pack.rs` at `q`, each looked up in [`IQ4NL_VALUES`]) times `a`, exact.
fn iq4_isum(q: &[u8], j: usize, a: &[i8]) -> i32 {
    let value = |c: u8| IQ4NL_VALUES[c as usize] as i32;
    let mut s = 0i32;
    for v in 0..4 {
        for i in 0..4 {
            let byte = q[v * 64 + j * 4 + i];
            s += value(byte & 0x0f) * a[8 * v + i] as i32;
            s += value(byte >> 4) * a[8 * v + 4 + i] as i32;
        }
    }
    s
}

/// Lane `j`'s sum of its 32 codes (0..31, the 5-bit layout of `pack.rs` at `q`) times `a`, exact.
fn q5_isum(q: &[u8], j: usize, a: &[i8]) -> i32 {
    a.iter().enumerate().map(|(e, &a)| tile_q5_code(q, j, e) as i32 * a as i32).sum()
}

/// Element `e` (0..32)'s 5-bit code (0..31) of lane `j` in a block's packed codes `q` (`pack.rs`):
/// for `e < 16` the low 5 bits of byte `e % 4` of vector `e / 4`; above, that byte's top 3 bits for
/// vector `(e - 16) / 4` over the 2 bits of vector 4's byte at `2 ((e - 16) / 4)`.
fn tile_q5_code(q: &[u8], j: usize, e: usize) -> u8 {
    let (k, i) = (e % 16 / 4, e % 4);
    let byte = q[k * 64 + 4 * j + i];
    if e < 16 {
        byte & 0x1f
    } else {
        ((byte >> 5) << 2) | ((q[4 * 64 + 4 * j + i] >> (2 * k)) & 3)
    }
}

/// Element `e` (0..32)'s quant (0..63) of lane `j` in a Q6_K block's packed quants `q` (`pack.rs`).
pub(super) fn tile_q6_k_quant(q: &[u8], j: usize, e: usize) -> u8 {
    let (g, k, i) = (e / 16, e % 16 / 4, e % 4);
    let byte = |k: usize| q[(3 * g + k) * 64 + 4 * j + i];
    if k < 3 {
        byte(k) & 0x3f
    } else {
        (0..3).map(|k| (byte(k) >> 6) << (2 * k)).fold(0, |acc, bits| acc | bits)
    }
}
