//! Q6_K's tests (a module of `gemv_proptest`, whose `check` and `check_raw` they share): hand-built
//! super-blocks at the edges of the format (q 0 and 63, scales -128 and 127, subnormal and largest
//! `d`) against ggml's own dequantization loop, ported below as the float64 reference; random
//! shapes; every kernel the scalar bits; the largest integer sums; the packer's refusals.
//!
//! Why ggml's loop and not the packer's reading of the bits (`format::q6_k_quant`): the reference
//! must not share the code it checks, and the loop is the definition llama.cpp's files are written to.

use super::*;

/// Bytes of a GGUF Q6_K super-block (256 weights).
const SB: usize = 210;

/// ggml's `dequantize_row_q6_K` for one super-block (`ql[128]`, `qh[64]`, `scales[16]`, f16 `d`),
/// as it is written, in float64 (exact: d * scale * (q - 32) has at most 11 + 8 + 6 significant bits).
pub(super) fn dequantize_q6_k(sb: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([sb[208], sb[209]])) as f64;
    let mut y = vec![0f64; 256];
    for half in 0..2 {
        let (ql, qh, sc) = (&sb[64 * half..], &sb[128 + 32 * half..], &sb[192 + 8 * half..]);
        let y = &mut y[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| sc[is + k] as i8 as f64;
            y[l] = d * s(0) * q1 as f64;
            y[l + 32] = d * s(2) * q2 as f64;
            y[l + 64] = d * s(4) * q3 as f64;
            y[l + 96] = d * s(6) * q4 as f64;
        }
    }
    y
}

/// A super-block whose weight `e` is `d * scales[e / 16] * (q[e] - 32)`: the bits put where the loop
/// above reads them.
fn encode_q6_k(q: &[u8; 256], scales: &[i8; 16], d: u16) -> Vec<u8> {
    let mut sb = vec![0u8; SB];
    for (e, &q) in q.iter().enumerate() {
        let (half, quarter, l) = (e / 128, e % 128 / 32, e % 32);
        sb[64 * half + l + 32 * (quarter & 1)] |= (q & 0xf) << (4 * (quarter >> 1));
        sb[128 + 32 * half + l] |= (q >> 4) << (2 * quarter);
    }
    for (dst, &s) in sb[192..208].iter_mut().zip(scales) {
        *dst = s as u8;
    }
    sb[208..].copy_from_slice(&d.to_le_bytes());
    sb
}

/// Random Q6_K bytes of a [rows, cols] tensor (`random_d_last`: every code and scale byte random, `d` last).
pub(super) fn random_q6_k(rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    random_d_last(rows, cols, SB, rng)
}

/// Hand-built super-blocks (rows 0..4 of 19, two super-blocks a row, the rest random): every code
/// 0..63 with 0 and 63 in runs, scales -128 and 127 among others, `d` the smallest and largest
/// subnormal, 65504 and negative. The port and the encoder agree with the definition; then M = 1..9
/// and 17 (AVX2: passes of 4 rows; AVX-512: 8) against the float64 reference, every kernel the bits.
#[test]
fn hand_built_super_blocks_meet_the_bound() {
    let scales: [i8; 16] = [-128, 127, -1, 0, 1, 64, -64, 127, -128, 3, -3, 100, -100, 127, -128, 5];
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0xb800];
    let codes = |s: usize| -> [u8; 256] {
        std::array::from_fn(|e| match (e / 16 + s) % 4 {
            0 => 0,
            1 => 63,
            2 => (e % 64) as u8,
            _ => ((e * 37 + s) % 64) as u8,
        })
    };
    let (rows, cols) = (19, 512);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut raw = random_q6_k(rows, cols, &mut rng);
    for (s, &d) in ds.iter().enumerate() {
        for half in 0..2 {
            let (q, mut sc) = (codes(s + half), scales);
            sc.rotate_left(s + half);
            let sb = encode_q6_k(&q, &sc, d);
            let y = dequantize_q6_k(&sb);
            let dv = f16_to_f32(d) as f64;
            for e in 0..256 {
                assert_eq!(y[e], dv * sc[e / 16] as f64 * (q[e] as f64 - 32.0), "super-block {s}, weight {e}");
            }
            raw[(2 * s + half) * SB..][..SB].copy_from_slice(&sb);
        }
    }
    for m in (1..=9).chain([17]) {
        check_raw(Format::Q6K, &raw, rows, cols, m, &mut rng);
    }
}

/// The largest integer sums: every q 0 (q - 32 = -32) with scale -128, and every q 63 with scale
/// 127, against activations of one sign (|T| = 2 * 16 * 32 * 127 * 128 = 16646144 < 2^24, and
/// 15999968): each kernel gives the exact product.
#[test]
fn extreme_quants_do_not_overflow() {
    let (rows, cols) = (17, 512);
    for (q, scale, x, weight) in [(0u8, -128i8, -1.0f32, 4096.0f32), (63, 127, 1.0, 127.0 * 31.0)] {
        let sb = encode_q6_k(&[q; 256], &[scale; 16], 0x3c00);
        let raw = sb.repeat(rows * cols / 256);
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, Format::Q6K).unwrap();
        assert_exact(&w, x, &[1, 5, 17], weight * x * cols as f32, &format!("q={q}"));
    }
}

/// What one product streams: 28 bytes a row per 32 weights (the tiles without padding rows).
#[test]
fn q6_k_weight_bytes_are_the_tiles() {
    let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 2 * SB], 37, 512, Format::Q6K).unwrap();
    assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks()), (37 * 16 * 28, 16 * 28, 16));
}

#[test]
fn q6_k_bad_input_names_the_tensor() {
    let name = "blk.3.ffn_down.weight";
    assert_super_block_columns_refused(Format::Q6K);
    let raw = vec![0u8; 2 * 2 * SB];
    let err = PackedMatrix::from_gguf(name, &raw[1..], 2, 512, Format::Q6K).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 840, got: 839, format: "q6_k", .. }), "{err:?}");
    assert!(err.to_string().contains(name));
    let err = PackedMatrix::from_gguf(name, &raw[..2 * 18 * 16], 2, 512, Format::Q6K).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 840, .. }), "a Q8_0-sized tensor: {err:?}");
    for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
        let mut bad = raw.clone();
        bad[3 * SB + 208..3 * SB + 210].copy_from_slice(&bits.to_le_bytes()); // row 1, super-block 1
        let err = PackedMatrix::from_gguf(name, &bad, 2, 512, Format::Q6K).unwrap_err();
        assert!(matches!(err, GemvError::NonFiniteScale { field: "d", row: 1, block: 1, .. }), "{err:?}");
        assert!(err.to_string().contains(name));
    }
    // a zero `d` is finite: the matrix is zero
    let w = PackedMatrix::from_gguf(name, &raw, 2, 512, Format::Q6K).unwrap();
    assert!(run(&w, &[1.0; 512], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
}
