//! Q5_K's tests (a module of `gemv_proptest`, whose `check` and `check_raw` they share): hand-built
//! super-blocks at the edges of the format (every 6-bit scale and minimum 0..63 in every one of the
//! 8 packed positions, every byte of fifth bits `qh[l]`, codes 0 and 31, subnormal, negative, zero and
//! largest `d` and `dmin`) against ggml's own dequantization loop, ported below as the float64
//! reference; random shapes; every kernel the scalar bits; the largest integer sums; the packer's refusals.
//!
//! Why ggml's loop and not the packer's reading of the bits (`format::q5_k_code`): the reference
//! must not share the code it checks, and the loop is the definition llama.cpp's files are written to.

use super::gemv_q4_k::{
    assert_extreme_codes_exact, assert_extremes_agree_with_scalar, assert_second_row_groups_agree, encode_scales,
    get_scale_min_k4,
};
use super::*;

/// Bytes of a GGUF Q5_K super-block (256 weights).
const SB: usize = 176;

/// ggml's `dequantize_row_q5_K` for one super-block (f16 `d`, f16 `dmin`, `scales[12]`, `qh[32]`,
/// `qs[128]`), as it is written, in float64 (exact: `d * sc * q` has at most 11 + 6 + 5 significant
/// bits and `dmin * m` 17, both multiples of 2^-24 below 2^27, so their difference fits 53 bits).
pub(super) fn dequantize_q5_k(sb: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([sb[0], sb[1]])) as f64;
    let min = f16_to_f32(u16::from_le_bytes([sb[2], sb[3]])) as f64;
    let (scales, qh, mut ql) = (&sb[4..16], &sb[16..48], &sb[48..176]);
    let mut y = Vec::with_capacity(256);
    let (mut is, mut u1, mut u2) = (0, 1u32, 2u32);
    for _j in (0..256).step_by(64) {
        let (sc, m) = get_scale_min_k4(is, scales);
        let (d1, m1) = (d * sc as f64, min * m as f64);
        let (sc, m) = get_scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * sc as f64, min * m as f64);
        for l in 0..32 {
            y.push(d1 * ((ql[l] & 0xF) as f64 + if qh[l] as u32 & u1 != 0 { 16.0 } else { 0.0 }) - m1);
        }
        for l in 0..32 {
            y.push(d2 * ((ql[l] >> 4) as f64 + if qh[l] as u32 & u2 != 0 { 16.0 } else { 0.0 }) - m2);
        }
        ql = &ql[32..];
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
    y
}

/// A super-block whose weight `32 s + l` is `d * sc[s] * q[32 s + l] - dmin * m[s]` (scales, minima
/// 0..63; codes 0..31): the bits put where the loop above reads them.
fn encode_q5_k(q: &[u8; 256], sc: &[u8; 8], m: &[u8; 8], d: u16, dmin: u16) -> Vec<u8> {
    let mut sb = vec![0u8; SB];
    sb[0..2].copy_from_slice(&d.to_le_bytes());
    sb[2..4].copy_from_slice(&dmin.to_le_bytes());
    sb[4..16].copy_from_slice(&encode_scales(sc, m));
    for (e, &q) in q.iter().enumerate() {
        let (s, l) = (e / 32, e % 32);
        sb[16 + l] |= (q >> 4) << s;
        sb[48 + 32 * (s / 2) + l] |= (q & 0xF) << (4 * (s % 2));
    }
    sb
}

/// Hand-built super-blocks (19 rows of 4, all of them): for every sub-block position `j` scale and
/// minimum run through all of 0..63 over the super-blocks; in the first 64 the fifth bits of
/// element `l` are the byte `(32 s + l) % 256` of super-block `s` (every `qh[l]` value 0..255, 8
/// times each) over low nibbles 0, 15, ramps and a mix; the last 12 whole sub-blocks of code 0 and of
/// code 31, and ramps 0..31; `d` and `dmin` the smallest and largest subnormal, 65504, 1, negative
/// and zero. The port and the encoder agree with the definition; then M = 1..9 and 17 (AVX2: passes
/// of 4 rows) against the float64 reference, every kernel the bits.
#[test]
fn hand_built_super_blocks_meet_the_bound() {
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0x3c00, 0xb800, 0x0000, 0x2e66, 0x8001];
    let dmins = [0x7bffu16, 0x0001, 0x3c00, 0x0000, 0x03ff, 0xbc00, 0x2a00, 0x5bff, 0x8000];
    let codes = |s: usize| -> [u8; 256] {
        std::array::from_fn(|e| {
            let (u, l) = (e / 32, e % 32);
            if s >= 64 {
                return match (u + s) % 3 {
                    0 => 0,
                    1 => 31,
                    _ => l as u8,
                };
            }
            let high = (((32 * s + l) % 256) >> u) as u8 & 1;
            let low = match (u + s) % 4 {
                0 => 0,
                1 => 15,
                2 => (l % 16) as u8,
                _ => ((e * 7 + s) % 16) as u8,
            };
            low | (high << 4)
        })
    };
    let (rows, cols) = (19, 1024);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut raw = Vec::with_capacity(rows * cols / 256 * SB);
    let mut qh_seen = [0usize; 256];
    for s in 0..rows * cols / 256 {
        let sc: [u8; 8] = std::array::from_fn(|j| ((s + 5 * j) % 64) as u8);
        let m: [u8; 8] = std::array::from_fn(|j| ((63 + 3 * j + 64 - s % 64) % 64) as u8);
        let (q, d, dmin) = (codes(s), ds[s % ds.len()], dmins[s % dmins.len()]);
        let sb = encode_q5_k(&q, &sc, &m, d, dmin);
        if s < 64 {
            sb[16..48].iter().for_each(|&b| qh_seen[b as usize] += 1);
        }
        let y = dequantize_q5_k(&sb);
        let (dv, mv) = (f16_to_f32(d) as f64, f16_to_f32(dmin) as f64);
        for e in 0..256 {
            let (u, want) = (e / 32, dv * sc[e / 32] as f64 * q[e] as f64 - mv * m[e / 32] as f64);
            assert_eq!(y[e], want, "super-block {s}, weight {e} (sub-block {u})");
        }
        raw.extend_from_slice(&sb);
    }
    assert!(qh_seen.iter().all(|&n| n == 8), "every fifth-bit byte 8 times: {qh_seen:?}");
    for m in (1..=9).chain([17]) {
        check_raw(Format::Q5K, &raw, rows, cols, m, &mut rng);
    }
}

/// The largest integer sums: every code 31 (and every code 0) with scale and minimum 63, against
/// activations of +-127 (so `d_a` = 1 and every step is exact): |isum| = 31 * 127 * 32 = 125984 a
/// sub-block, 16-bit partial sums up to 31496 (AVX2 sums each half of a block apart: the whole
/// block's 62992 would wrap). Each kernel gives the exact product.
#[test]
fn extreme_codes_do_not_overflow() {
    assert_extreme_codes_exact(Format::Q5K, 31, encode_q5_k);
}

/// Every kernel against scalar, bit for bit, at the edges of the value ranges: `d` and `dmin` from
/// f16 subnormals to 65504 of either sign (and zero), scales and minima 0 and 63, codes 0 and 31 in
/// half the super-blocks; activations that quantize to +-127, one value and zeros, tiny blocks; N not
/// a tile multiple and M around the AVX2 passes of 4 rows and the AMX groups of 16.
#[test]
fn q5_k_extreme_values_agree_with_scalar() {
    assert_extremes_agree_with_scalar(Format::Q5K, 31, encode_q5_k, SB);
}

/// Every row count of a second pass over the tiles (`gemv_q4_k::q4_k_second_row_groups_agree`).
#[test]
fn q5_k_second_row_groups_agree() {
    assert_second_row_groups_agree(Format::Q5K);
}

/// What one product streams: 180 bytes a row per super-block (the tiles without padding rows), at
/// most the 5.625 bits a weight promised, under Q8_0's 272 (the format Q5_K was converted to).
#[test]
fn q5_k_weight_bytes_are_the_tiles() {
    let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 2 * SB], 37, 512, Format::Q5K).unwrap();
    assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks(), w.tile_blocks()), (37 * 2 * 180, 16 * 180, 16, 2));
    assert!(w.weight_bytes() * 8 * 8 <= 37 * 512 * 45, "at most 5.625 bits a weight");
}

#[test]
fn q5_k_bad_input_names_the_tensor() {
    let name = "blk.3.ffn_gate.weight";
    assert_super_block_columns_refused(Format::Q5K);
    let raw = vec![0u8; 2 * 2 * SB];
    let err = PackedMatrix::from_gguf(name, &raw[1..], 2, 512, Format::Q5K).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 704, got: 703, format: "q5_k", .. }), "{err:?}");
    assert!(err.to_string().contains(name));
    for wrong in [2 * 2 * 144, 2 * 16 * 34, 2 * 2 * 180, 705] {
        // a Q4_K-sized tensor, a Q8_0-sized one, the packed size, one byte more
        let err = PackedMatrix::from_gguf(name, &vec![0u8; wrong], 2, 512, Format::Q5K).unwrap_err();
        assert!(matches!(err, GemvError::ByteCount { expected: 704, .. }), "{wrong} bytes: {err:?}");
    }
    for (field, off) in [("d", 0), ("dmin", 2)] {
        for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
            let mut bad = raw.clone();
            bad[3 * SB + off..3 * SB + off + 2].copy_from_slice(&bits.to_le_bytes()); // row 1, super-block 1
            let err = PackedMatrix::from_gguf(name, &bad, 2, 512, Format::Q5K).unwrap_err();
            assert!(matches!(err, GemvError::NonFiniteScale { field: f, row: 1, block: 1, .. } if f == field), "{err:?}");
            assert!(err.to_string().contains(name));
        }
    }
    // zero `d` and `dmin` are finite: the matrix is zero
    let w = PackedMatrix::from_gguf(name, &raw, 2, 512, Format::Q5K).unwrap();
    assert!(run(&w, &[1.0; 512], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
    let err = GemvError::UnknownFormat { tensor: name.into(), format: "q2_k".into() };
    assert!(err.to_string().contains("\"q5_k\""), "{err}");
}
