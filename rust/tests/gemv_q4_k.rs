//! Q4_K's tests (a module of `gemv_proptest`, whose `check` and `check_raw` they share): hand-built
//! super-blocks at the edges of the format (every 6-bit scale and minimum 0..63 in every one of the
//! 8 packed positions, codes 0 and 15, subnormal, negative, zero and largest `d` and `dmin`) against
//! ggml's own dequantization loop, ported below as the float64 reference; random shapes; every
//! kernel the scalar bits; the largest integer sums; the packer's refusals.
//!
//! Why ggml's loop and not the packer's reading of the bits (`format::q4_k_scale_min`): the
//! reference must not share the code it checks, and the loop is the definition llama.cpp's files
//! are written to.

use super::*;

/// Bytes of a GGUF Q4_K super-block (256 weights).
const SB: usize = 144;

/// ggml's `get_scale_min_k4`, as it is written.
pub(super) fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// ggml's `dequantize_row_q4_K` for one super-block (f16 `d`, f16 `dmin`, `scales[12]`, `qs[128]`),
/// as it is written, in float64 (exact: `d * sc * q` and `dmin * m` are multiples of 2^-24 below
/// 2^23, so their difference has at most 47 significant bits).
pub(super) fn dequantize_q4_k(sb: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([sb[0], sb[1]])) as f64;
    let min = f16_to_f32(u16::from_le_bytes([sb[2], sb[3]])) as f64;
    let (scales, q) = (&sb[4..16], &sb[16..]);
    let mut y = vec![0f64; 256];
    for c in 0..4 {
        let (sc1, m1) = get_scale_min_k4(2 * c, scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f64, min * m1 as f64);
        let (d2, m2) = (d * sc2 as f64, min * m2 as f64);
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[32 * c + l] & 0xF) as f64 - m1;
        }
        for l in 0..32 {
            y[64 * c + 32 + l] = d2 * (q[32 * c + l] >> 4) as f64 - m2;
        }
    }
    y
}

/// A super-block whose weight `32 s + l` is `d * sc[s] * q[32 s + l] - dmin * m[s]` (scales, minima
/// 0..63; codes 0..15): the bits put where the loop above reads them.
fn encode_q4_k(q: &[u8; 256], sc: &[u8; 8], m: &[u8; 8], d: u16, dmin: u16) -> Vec<u8> {
    let mut sb = vec![0u8; SB];
    sb[0..2].copy_from_slice(&d.to_le_bytes());
    sb[2..4].copy_from_slice(&dmin.to_le_bytes());
    sb[4..16].copy_from_slice(&encode_scales(sc, m));
    for (e, &q) in q.iter().enumerate() {
        let (c, half, l) = (e / 64, e % 64 / 32, e % 32);
        sb[16 + 32 * c + l] |= q << (4 * half);
    }
    sb
}

/// The 8 sub-blocks' 6-bit scales and minima as Q4_K's (and Q5_K's) `scales[12]`, where
/// `get_scale_min_k4` reads them.
pub(super) fn encode_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    scales
}

/// Random bytes of a [rows, cols] tensor of a K-quant with minima whose GGUF super-block is `sb` bytes,
/// `d` and `dmin` first (Q4_K: 144, Q5_K: 176): every scale byte, fifth bit and code random (all 64
/// scales and minima, all codes), `d` and `dmin` as the other formats' scales (magnitude 2^-10 to 1,
/// either sign), one in 8 subnormal.
pub(super) fn random_k_with_min(rows: usize, cols: usize, sb: usize, rng: &mut Rng) -> Vec<u8> {
    let mut raw = Vec::with_capacity(rows * cols / 256 * sb);
    for _ in 0..rows * cols / 256 {
        for _ in 0..2 {
            let r = rng.next();
            let d = if r % 8 == 0 { (r >> 16) as u16 & 0x83ff } else { f16_bits(r) };
            raw.extend_from_slice(&d.to_le_bytes());
        }
        raw.extend((0..sb - 4).map(|_| rng.next() as u8));
    }
    raw
}

/// Hand-built super-blocks (19 rows of 4, all of them): for every sub-block position `j` (the
/// packing differs below and from 4) scale and minimum run through all of 0..63 over the
/// super-blocks; codes in runs of 0 and of 15, ramps and a mix; `d` and `dmin` the smallest and
/// largest subnormal, 65504, 1, negative and zero. The port and the encoder agree with the
/// definition; then M = 1..9 and 17 (AVX2: passes of 4 rows) against the float64 reference, every
/// kernel the bits.
#[test]
fn hand_built_super_blocks_meet_the_bound() {
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0x3c00, 0xb800, 0x0000, 0x2e66, 0x8001];
    let dmins = [0x7bffu16, 0x0001, 0x3c00, 0x0000, 0x03ff, 0xbc00, 0x2a00, 0x5bff, 0x8000];
    let codes = |s: usize| -> [u8; 256] {
        std::array::from_fn(|e| match (e / 32 + s) % 4 {
            0 => 0,
            1 => 15,
            2 => (e % 16) as u8,
            _ => ((e * 7 + s) % 16) as u8,
        })
    };
    let (rows, cols) = (19, 1024);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut raw = Vec::with_capacity(rows * cols / 256 * SB);
    for s in 0..rows * cols / 256 {
        let sc: [u8; 8] = std::array::from_fn(|j| ((s + 5 * j) % 64) as u8);
        let m: [u8; 8] = std::array::from_fn(|j| ((63 + 3 * j + 64 - s % 64) % 64) as u8);
        let (q, d, dmin) = (codes(s), ds[s % ds.len()], dmins[s % dmins.len()]);
        let sb = encode_q4_k(&q, &sc, &m, d, dmin);
        let y = dequantize_q4_k(&sb);
        let (dv, mv) = (f16_to_f32(d) as f64, f16_to_f32(dmin) as f64);
        for e in 0..256 {
            let (u, want) = (e / 32, dv * sc[e / 32] as f64 * q[e] as f64 - mv * m[e / 32] as f64);
            assert_eq!(y[e], want, "super-block {s}, weight {e} (sub-block {u})");
        }
        raw.extend_from_slice(&sb);
    }
    for m in (1..=9).chain([17]) {
        check_raw(Format::Q4K, &raw, rows, cols, m, &mut rng);
    }
}

/// The largest integer sums: every code 15 (and every code 0) with scale and minimum 63, against
/// activations of +-127 (so `d_a` = 1 and every step is exact): |isum| = 15 * 127 * 32 = 60960 a
/// sub-block, 16-bit partial sums up to 30480. Each kernel gives the exact product.
#[test]
fn extreme_codes_do_not_overflow() {
    assert_extreme_codes_exact(Format::Q4K, 15, encode_q4_k);
}

/// A K-quant super-block's encoder (Q4_K, Q5_K): codes, scales, minima, f16 `d` and `dmin`.
pub(super) type EncodeK = fn(&[u8; 256], &[u8; 8], &[u8; 8], u16, u16) -> Vec<u8>;

/// Every code `top` (and every code 0) of a K-quant with minima, scale and minimum 63, against activations
/// of +-127: each kernel gives the exact product (`extreme_codes_do_not_overflow`).
pub(super) fn assert_extreme_codes_exact(format: Format, top: u8, encode: EncodeK) {
    let (rows, cols) = (17, 512);
    for (q, x) in [(top, -127.0f32), (top, 127.0), (0, 127.0)] {
        let sb = encode(&[q; 256], &[63; 8], &[63; 8], 0x3c00, 0x3c00);
        let raw = sb.repeat(rows * cols / 256);
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, format).unwrap();
        assert_exact(&w, x, &[1, 5, 17], (63.0 * q as f32 - 63.0) * x * cols as f32, &format!("q={q}"));
    }
}

/// Every kernel against scalar, bit for bit, at the edges of the value ranges: `d` and `dmin` from
/// f16 subnormals to 65504 of either sign (and zero), scales and minima 0 and 63, codes 0 and 15 in
/// half the super-blocks; activations that quantize to +-127, one value and zeros, tiny blocks; N not
/// a tile multiple and M around the AVX2 passes of 4 rows and the AMX groups of 16.
#[test]
fn q4_k_extreme_values_agree_with_scalar() {
    assert_extremes_agree_with_scalar(Format::Q4K, 15, encode_q4_k, SB);
}

/// `q4_k_extreme_values_agree_with_scalar` for a K-quant with minima whose codes reach `top` and whose
/// GGUF super-block is `sb_bytes` long (`d` and `dmin` first).
pub(super) fn assert_extremes_agree_with_scalar(format: Format, top: u8, encode: EncodeK, sb_bytes: usize) {
    let scales = [0x7bffu16, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x3c00, 0x5bff, 0x1400, 0x0000];
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    let (rows, cols) = (37, 512);
    let mut raw = Vec::new();
    for i in 0..rows * cols / 256 {
        let d = scales[(i + rng.next() as usize) % scales.len()];
        let dmin = scales[(i * 7 + 3) % scales.len()];
        if i % 2 == 0 {
            let pick = |r: u32, a: u8, b: u8| if r % 2 == 0 { a } else { b };
            let q: [u8; 256] = std::array::from_fn(|_| pick(rng.next(), 0, top));
            let sc: [u8; 8] = std::array::from_fn(|_| pick(rng.next(), 0, 63));
            let m: [u8; 8] = std::array::from_fn(|_| pick(rng.next(), 0, 63));
            raw.extend(encode(&q, &sc, &m, d, dmin));
        } else {
            raw.extend_from_slice(&d.to_le_bytes());
            raw.extend_from_slice(&dmin.to_le_bytes());
            raw.extend((0..sb_bytes - 4).map(|_| rng.next() as u8));
        }
    }
    let w = PackedMatrix::from_gguf("t", &raw, rows, cols, format).unwrap();
    for m in [1, 3, 4, 5, 16, 17, 33] {
        let x = extreme_activations(m, cols, 1e20, &mut rng);
        assert_same_as_scalar(&w, &x, m, format.name());
    }
}

/// Every row count of a second pass over the tiles: AVX-512 multiplies 8 activation rows a pass, so M =
/// 9 ..= 16 runs as 8 + 1 .. 8 + 8, the rows past the first 8 without the prefetch and, up to 8 + 3,
/// on its two integer chains a row; 2 tiles of 16 super-blocks a row. Every kernel the scalar bits.
#[test]
fn q4_k_second_row_groups_agree() {
    assert_second_row_groups_agree(Format::Q4K);
}

/// `q4_k_second_row_groups_agree` for a super-block format (Q4_K, Q5_K, IQ4_XS).
pub(super) fn assert_second_row_groups_agree(format: Format) {
    for m in 9..=16 {
        check(format, 19, 128, m, 0x9e37 + m as u64);
    }
}

/// What one product streams: 148 bytes a row per super-block (the tiles without padding rows), at
/// most the 4.625 bits a weight promised, under Q4_1's 160.
#[test]
fn q4_k_weight_bytes_are_the_tiles() {
    let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 2 * SB], 37, 512, Format::Q4K).unwrap();
    assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks(), w.tile_blocks()), (37 * 2 * 148, 16 * 148, 16, 2));
    assert!(w.weight_bytes() * 8 * 8 <= 37 * 512 * 37, "at most 4.625 bits a weight");
}

#[test]
fn q4_k_bad_input_names_the_tensor() {
    let name = "blk.3.ffn_gate.weight";
    assert_super_block_columns_refused(Format::Q4K);
    let raw = vec![0u8; 2 * 2 * SB];
    let err = PackedMatrix::from_gguf(name, &raw[1..], 2, 512, Format::Q4K).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 576, got: 575, format: "q4_k", .. }), "{err:?}");
    assert!(err.to_string().contains(name));
    for wrong in [2 * 16 * 20, 2 * 2 * 210, 2 * 2 * 148] {
        // a Q4_1-sized tensor, a Q6_K-sized one, the packed size
        let err = PackedMatrix::from_gguf(name, &vec![0u8; wrong], 2, 512, Format::Q4K).unwrap_err();
        assert!(matches!(err, GemvError::ByteCount { expected: 576, .. }), "{wrong} bytes: {err:?}");
    }
    for (field, off) in [("d", 0), ("dmin", 2)] {
        for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
            let mut bad = raw.clone();
            bad[3 * SB + off..3 * SB + off + 2].copy_from_slice(&bits.to_le_bytes()); // row 1, super-block 1
            let err = PackedMatrix::from_gguf(name, &bad, 2, 512, Format::Q4K).unwrap_err();
            assert!(matches!(err, GemvError::NonFiniteScale { field: f, row: 1, block: 1, .. } if f == field), "{err:?}");
            assert!(err.to_string().contains(name));
        }
    }
    // zero `d` and `dmin` are finite: the matrix is zero
    let w = PackedMatrix::from_gguf(name, &raw, 2, 512, Format::Q4K).unwrap();
    assert!(run(&w, &[1.0; 512], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
    let err = GemvError::UnknownFormat { tensor: name.into(), format: "q5_k".into() };
    assert!(err.to_string().contains("\"q4_k\""), "{err}");
}
