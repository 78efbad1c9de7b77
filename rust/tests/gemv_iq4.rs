//! IQ4_NL's and IQ4_XS's tests (a module of `gemv_proptest`, whose `check` and `check_raw` they
//! share): hand-built blocks at the edges of the formats (IQ4_NL: every byte value, so every code in
//! both nibble positions, in each of the 16 bytes of `qs`; IQ4_XS: every 6-bit scale in each of the 8
//! sub-block positions, codes 0 and 15 and ramps; subnormal, negative, zero and largest `d`) against
//! ggml's own dequantization loops, ported below as the float64 reference; shapes whose columns are
//! any multiple of 32 (IQ4_XS: 256) and whose rows are not a multiple of 16; every kernel the scalar
//! bits; the largest integer sums; the packer's refusals.
//!
//! Why ggml's loop and its own copy of the table, not the crate's (`format::IQ4NL_VALUES`, the
//! packer's nibble order): the reference must not share the code it checks, and the loop is the
//! definition llama.cpp's files are written to.

use super::*;

/// ggml's `kvalues_iq4nl`, copied from ggml-common.h (not from the crate).
const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// Bytes of a GGUF IQ4_NL block (32 weights).
const NL: usize = 18;

/// ggml's `dequantize_row_iq4_nl` for one block (f16 `d`, `qs[16]`), as it is written, in float64
/// (exact: `d * kvalues[c]` has at most 11 + 7 significant bits).
pub(super) fn dequantize_iq4_nl(blk: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64;
    let qs = &blk[2..NL];
    let mut y = vec![0f64; 32];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as f64;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f64;
    }
    y
}

/// An IQ4_NL block whose weight `e` is `d * kvalues[c[e]]` (codes 0..15): the bits put where the
/// loop above reads them.
fn encode_iq4_nl(c: &[u8; 32], d: u16) -> Vec<u8> {
    let mut blk = d.to_le_bytes().to_vec();
    blk.extend((0..16).map(|j| (c[j] & 0xf) | ((c[j + 16] & 0xf) << 4)));
    assert_eq!(blk.len(), NL);
    blk
}

/// Hand-built blocks (19 rows of 14, 266 blocks): in the first 256, byte `k` of block `i`'s `qs` is
/// `(i + 17 k) % 256` (every value 0..255 once in each of the 16 bytes: every code in the low and
/// the high nibble of every byte, beside every other code); the last 10 whole blocks of code 0 (-127),
/// of code 15 (113), and ramps 0..15; `d` the smallest and largest subnormal, 65504 of either sign, 1,
/// negative and zero. The port and the encoder agree with the definition; then M = 1..9 and 17 (AVX2:
/// passes of 4 rows) against the float64 reference, every kernel the bits (1 and 2 threads).
#[test]
fn iq4_nl_hand_built_blocks_meet_the_bound() {
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0x3c00, 0xb800, 0x0000, 0x2e66, 0x8001, 0xfbff];
    let (rows, cols) = (19, 448);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut raw = Vec::with_capacity(rows * cols / 32 * NL);
    let mut seen = [[0usize; 256]; 16];
    for i in 0..rows * cols / 32 {
        let c: [u8; 32] = if i < 256 {
            std::array::from_fn(|e| (((i + 17 * (e % 16)) % 256) >> (4 * (e / 16))) as u8 & 0xf)
        } else {
            std::array::from_fn(|e| [0, 15, (e % 16) as u8][i % 3])
        };
        let d = ds[i % ds.len()];
        let blk = encode_iq4_nl(&c, d);
        if i < 256 {
            (0..16).for_each(|k| seen[k][blk[2 + k] as usize] += 1);
        }
        let want: Vec<f64> = c.iter().map(|&c| f16_to_f32(d) as f64 * KVALUES_IQ4NL[c as usize] as f64).collect();
        assert_eq!(dequantize(Format::IQ4NL, &blk, 1, 32), want, "block {i}");
        raw.extend_from_slice(&blk);
    }
    assert!(seen.iter().flatten().all(|&n| n == 1), "every byte value once in each byte of qs");
    for m in (1..=9).chain([17]) {
        check_raw(Format::IQ4NL, &raw, rows, cols, m, &mut rng);
    }
}

/// Columns any multiple of 32 (1 to 13 blocks, odd ones included), rows not a multiple of 16 (and
/// fewer than 16), M across the AVX2 passes of 4 rows and past the AMX group of 16.
#[test]
fn iq4_nl_any_multiple_of_32_columns_agree() {
    let shapes = [(1, 1), (15, 3), (17, 5), (33, 7), (70, 9), (5, 13), (16, 2)];
    for (i, (rows, blocks)) in shapes.into_iter().enumerate() {
        for m in [1, 2, 3, 4, 5, 17] {
            check(Format::IQ4NL, rows, blocks, m, 0x51ed + 31 * i as u64 + m as u64);
        }
    }
}

/// The largest integer sums: every code 0 (-127; and every code 15, 113) with `d` 1, against
/// activations of +-127 (so `d_a` = 1 and every step is exact): |T| = 127 * 127 * 32 = 516128 a block,
/// `maddubs` pairs of 2 * 127 * 127 = 32258, the most a 16-bit lane holds here. Each kernel gives the
/// exact product.
#[test]
fn iq4_nl_extreme_codes_do_not_overflow() {
    let (rows, cols) = (17, 128);
    for (c, x) in [(0u8, -127.0f32), (0, 127.0), (15, 127.0), (15, -127.0)] {
        let raw = encode_iq4_nl(&[c; 32], 0x3c00).repeat(rows * cols / 32);
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, Format::IQ4NL).unwrap();
        let weight = KVALUES_IQ4NL[c as usize] as f32;
        assert_exact(&w, x, &[1, 5, 17], weight * x * cols as f32, &format!("iq4_nl c={c}"));
    }
}

/// Every kernel against scalar, bit for bit, at the edges of the value ranges: `d` from f16
/// subnormals to 65504 of either sign (and zero), codes 0 and 15 in half the blocks; activations that
/// quantize to +-127, one value and zeros, tiny blocks; N not a tile multiple and M around the AVX2
/// passes of 4 rows and the AMX groups of 16.
#[test]
fn iq4_nl_extreme_values_agree_with_scalar() {
    let scales = [0x7bffu16, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x3c00, 0x5bff, 0x1400, 0x0000];
    let (rows, cols) = (37, 224);
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    let mut raw = Vec::new();
    for i in 0..rows * cols / 32 {
        let d = scales[(i + rng.next() as usize) % scales.len()];
        let c: [u8; 32] = if i % 2 == 0 {
            std::array::from_fn(|_| if rng.next() % 2 == 0 { 0 } else { 15 })
        } else {
            std::array::from_fn(|_| (rng.next() % 16) as u8)
        };
        raw.extend(encode_iq4_nl(&c, d));
    }
    let w = PackedMatrix::from_gguf("t", &raw, rows, cols, Format::IQ4NL).unwrap();
    for m in [1, 3, 4, 5, 16, 17, 33] {
        let x = extreme_activations(m, cols, 1e20, &mut rng);
        assert_same_as_scalar(&w, &x, m, "iq4_nl");
    }
}

/// What one product streams: the GGUF tensor's bytes (18 a row per 32 weights, 4.5 bits a weight,
/// against Q8_0's 34), the padding rows not counted.
#[test]
fn iq4_nl_weight_bytes_are_the_file_bytes() {
    let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 16 * NL], 37, 512, Format::IQ4NL).unwrap();
    assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks(), w.tile_blocks()), (37 * 16 * NL, 16 * NL, 16, 16));
    assert_eq!(Format::IQ4NL.gguf_block_bytes(), NL);
}

#[test]
fn iq4_nl_bad_input_names_the_tensor() {
    let name = "blk.0.ffn_down.weight";
    for cols in [16, 48, 100, 0] {
        let err = PackedMatrix::from_gguf(name, &[0u8; 2 * NL], 1, cols, Format::IQ4NL).unwrap_err();
        assert!(matches!(err, GemvError::BadShape { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(name) && text.contains("multiple of the block size 32"), "{text}");
    }
    let raw = vec![0u8; 2 * 2 * NL];
    for wrong in [4 * NL - 1, 4 * NL + 1, 4 * 20, 4 * 22, 4 * 34, 0] {
        // a byte short or over, Q4_1-, Q5_0-, Q8_0-sized, empty
        let err = PackedMatrix::from_gguf(name, &vec![0u8; wrong], 2, 64, Format::IQ4NL).unwrap_err();
        assert!(matches!(err, GemvError::ByteCount { expected: 72, got, format: "iq4_nl", .. } if got == wrong),
                "{wrong} bytes: {err:?}");
        assert!(err.to_string().contains(name));
    }
    for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
        let mut bad = raw.clone();
        bad[3 * NL..3 * NL + 2].copy_from_slice(&bits.to_le_bytes()); // row 1, block 1
        let err = PackedMatrix::from_gguf(name, &bad, 2, 64, Format::IQ4NL).unwrap_err();
        assert!(matches!(err, GemvError::NonFiniteScale { field: "d", row: 1, block: 1, .. }), "{err:?}");
        assert!(err.to_string().contains(name));
    }
    // a zero `d` is finite: the matrix is zero
    let w = PackedMatrix::from_gguf(name, &raw, 2, 64, Format::IQ4NL).unwrap();
    assert!(run(&w, &[1.0; 64], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
    let err = GemvError::UnknownFormat { tensor: name.into(), format: "iq2_xs".into() };
    assert!(err.to_string().contains("\"iq4_nl\""), "{err}");
}

/// Bytes of a GGUF IQ4_XS super-block (256 weights).
const XS: usize = 136;

/// ggml's `dequantize_row_iq4_xs` for one super-block (f16 `d`, u16 `scales_h`, `scales_l[4]`,
/// `qs[128]`), as it is written, in float64 (exact: `d * (ls - 32) * kvalues[c]` has at most 11 + 6 +
/// 7 significant bits).
pub(super) fn dequantize_iq4_xs(sb: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([sb[0], sb[1]])) as f64;
    let scales_h = u16::from_le_bytes([sb[2], sb[3]]) as i32;
    let (scales_l, mut qs) = (&sb[4..8], &sb[8..XS]);
    let mut y = vec![0f64; 256];
    let mut off = 0;
    for ib in 0..8 {
        let ls = ((scales_l[ib / 2] as i32 >> (4 * (ib % 2))) & 0xf) | (((scales_h >> (2 * ib)) & 3) << 4);
        let dl = d * (ls - 32) as f64;
        for j in 0..16 {
            y[off + j] = dl * KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as f64;
            y[off + j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f64;
        }
        off += 32;
        qs = &qs[16..];
    }
    y
}

/// An IQ4_XS super-block whose weight `32 s + l` is `d * (ls[s] - 32) * kvalues[c[32 s + l]]` (`ls`
/// 0..63, codes 0..15): the bits put where the loop above reads them.
fn encode_iq4_xs(c: &[u8; 256], ls: &[u8; 8], d: u16) -> Vec<u8> {
    let mut sb = vec![0u8; XS];
    sb[0..2].copy_from_slice(&d.to_le_bytes());
    let scales_h = ls.iter().enumerate().fold(0u16, |h, (s, &ls)| h | (((ls >> 4) as u16 & 3) << (2 * s)));
    sb[2..4].copy_from_slice(&scales_h.to_le_bytes());
    for (s, &ls) in ls.iter().enumerate() {
        sb[4 + s / 2] |= (ls & 0xf) << (4 * (s % 2));
    }
    for (e, &c) in c.iter().enumerate() {
        let (s, l) = (e / 32, e % 32);
        sb[8 + 16 * s + l % 16] |= (c & 0xf) << (4 * (l / 16));
    }
    sb
}

/// Random IQ4_XS bytes of a [rows, cols] tensor: every scale bit and code random (all 64 scales, all
/// 16 codes), `d` as the other formats' scales (magnitude 2^-10 to 1, either sign), one in 8 subnormal.
pub(super) fn random_iq4_xs(rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut raw = Vec::with_capacity(rows * cols / 256 * XS);
    for _ in 0..rows * cols / 256 {
        let r = rng.next();
        let d = if r % 8 == 0 { (r >> 16) as u16 & 0x83ff } else { f16_bits(r) };
        raw.extend_from_slice(&d.to_le_bytes());
        raw.extend((0..XS - 2).map(|_| rng.next() as u8));
    }
    raw
}

/// Hand-built super-blocks (19 rows of 4, 76): for every sub-block position `s` the 6-bit scale `ls`
/// runs through all of 0..63 over the super-blocks (so every value of its `scales_l` nibble and of its
/// `scales_h` bit pair, beside every other), codes in runs of 0 and of 15, ramps 0..15 (every code in
/// the low and the high nibble) and a mix; `d` the smallest and largest subnormal, 65504, 1, negative
/// and zero. The port and the encoder agree with the definition; then M = 1..9 and 17 (AVX2: passes
/// of 4 rows) against the float64 reference, every kernel the bits.
#[test]
fn iq4_xs_hand_built_super_blocks_meet_the_bound() {
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0x3c00, 0xb800, 0x0000, 0x2e66, 0x8001, 0xfbff];
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
    let mut raw = Vec::with_capacity(rows * cols / 256 * XS);
    let mut seen = [[0usize; 64]; 8];
    for s in 0..rows * cols / 256 {
        let ls: [u8; 8] = std::array::from_fn(|u| ((s + 5 * u) % 64) as u8);
        let (c, d) = (codes(s), ds[s % ds.len()]);
        let sb = encode_iq4_xs(&c, &ls, d);
        ls.iter().enumerate().for_each(|(u, &ls)| seen[u][ls as usize] += 1);
        let y = dequantize_iq4_xs(&sb);
        let dv = f16_to_f32(d) as f64;
        for e in 0..256 {
            let want = dv * (ls[e / 32] as f64 - 32.0) * KVALUES_IQ4NL[c[e] as usize] as f64;
            assert_eq!(y[e], want, "super-block {s}, weight {e}");
        }
        raw.extend_from_slice(&sb);
    }
    assert!(seen.iter().flatten().all(|&n| n >= 1), "every scale in every position");
    for m in (1..=9).chain([17]) {
        check_raw(Format::IQ4XS, &raw, rows, cols, m, &mut rng);
    }
}

/// Random super-blocks: rows not a multiple of 16 (and fewer than 16), 1 to 3 super-blocks a row, M
/// across the AVX2 passes of 4 rows and past the AMX group of 16.
#[test]
fn iq4_xs_random_shapes_agree() {
    let shapes = [(1, 8), (15, 16), (17, 8), (33, 24), (70, 16), (16, 8)];
    for (i, (rows, blocks)) in shapes.into_iter().enumerate() {
        for m in [1, 2, 3, 4, 5, 17] {
            check(Format::IQ4XS, rows, blocks, m, 0x7f4a + 31 * i as u64 + m as u64);
        }
    }
}

/// The largest integer sums: every code 0 (-127) with `ls` 0 (scale -32), and every code 15 (113)
/// with `ls` 63 (31), `d` 1, against activations of +-127 (so `d_a` = 1 and every step is exact): |T| =
/// 127 * 127 * 32 a sub-block, `maddubs` pairs of 32258. Each kernel gives the exact product.
#[test]
fn iq4_xs_extreme_codes_do_not_overflow() {
    let (rows, cols) = (17, 512);
    for (c, ls, x) in [(0u8, 0u8, -127.0f32), (0, 0, 127.0), (15, 63, 127.0), (0, 63, -127.0), (15, 0, 127.0)] {
        let raw = encode_iq4_xs(&[c; 256], &[ls; 8], 0x3c00).repeat(rows * cols / 256);
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, Format::IQ4XS).unwrap();
        let weight = (ls as f32 - 32.0) * KVALUES_IQ4NL[c as usize] as f32;
        assert_exact(&w, x, &[1, 5, 17], weight * x * cols as f32, &format!("iq4_xs c={c} ls={ls}"));
    }
}

/// Every kernel against scalar, bit for bit, at the edges of the value ranges: `d` from f16
/// subnormals to 65504 of either sign (and zero), scales 0 and 63 (-32 and 31) and codes 0 and 15 in
/// half the super-blocks; activations that quantize to +-127, one value and zeros, tiny blocks; N not
/// a tile multiple and M around the AVX2 passes of 4 rows and the AMX groups of 16.
#[test]
fn iq4_xs_extreme_values_agree_with_scalar() {
    let scales = [0x7bffu16, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x3c00, 0x5bff, 0x1400, 0x0000];
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    let (rows, cols) = (37, 512);
    let mut raw = Vec::new();
    for i in 0..rows * cols / 256 {
        let d = scales[(i + rng.next() as usize) % scales.len()];
        if i % 2 == 0 {
            let pick = |r: u32, a: u8, b: u8| if r % 2 == 0 { a } else { b };
            let c: [u8; 256] = std::array::from_fn(|_| pick(rng.next(), 0, 15));
            let ls: [u8; 8] = std::array::from_fn(|_| pick(rng.next(), 0, 63));
            raw.extend(encode_iq4_xs(&c, &ls, d));
        } else {
            raw.extend_from_slice(&d.to_le_bytes());
            raw.extend((0..XS - 2).map(|_| rng.next() as u8));
        }
    }
    let w = PackedMatrix::from_gguf("t", &raw, rows, cols, Format::IQ4XS).unwrap();
    for m in [1, 3, 4, 5, 16, 17, 33] {
        let x = extreme_activations(m, cols, 1e18, &mut rng);
        assert_same_as_scalar(&w, &x, m, "iq4_xs");
    }
}

/// Every row count of a second pass over the tiles (`gemv_q4_k::q4_k_second_row_groups_agree`).
#[test]
fn iq4_xs_second_row_groups_agree() {
    super::gemv_q4_k::assert_second_row_groups_agree(Format::IQ4XS);
}

/// What one product streams: 138 bytes a row per super-block (the tiles without padding rows),
/// 4.3125 bits a weight, at most the 4.5 promised, under Q8_0's 272 (the format IQ4_XS was converted to).
#[test]
fn iq4_xs_weight_bytes_are_the_tiles() {
    let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 2 * XS], 37, 512, Format::IQ4XS).unwrap();
    assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks(), w.tile_blocks()), (37 * 2 * 138, 16 * 138, 16, 2));
    assert!(w.weight_bytes() * 8 * 16 <= 37 * 512 * 69, "at most 4.3125 bits a weight");
}

#[test]
fn iq4_xs_bad_input_names_the_tensor() {
    let name = "blk.3.ffn_gate.weight";
    assert_super_block_columns_refused(Format::IQ4XS);
    let raw = vec![0u8; 2 * 2 * XS];
    for wrong in [543, 545, 2 * 2 * 144, 2 * 16 * 18, 2 * 2 * 138, 0] {
        // a byte short or over, a Q4_K-sized tensor, an IQ4_NL-sized one, the packed size, empty
        let err = PackedMatrix::from_gguf(name, &vec![0u8; wrong], 2, 512, Format::IQ4XS).unwrap_err();
        assert!(matches!(err, GemvError::ByteCount { expected: 544, got, format: "iq4_xs", .. } if got == wrong),
                "{wrong} bytes: {err:?}");
        assert!(err.to_string().contains(name));
    }
    for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
        let mut bad = raw.clone();
        bad[3 * XS..3 * XS + 2].copy_from_slice(&bits.to_le_bytes()); // row 1, super-block 1
        let err = PackedMatrix::from_gguf(name, &bad, 2, 512, Format::IQ4XS).unwrap_err();
        assert!(matches!(err, GemvError::NonFiniteScale { field: "d", row: 1, block: 1, .. }), "{err:?}");
        assert!(err.to_string().contains(name));
    }
    // a zero `d` is finite: the matrix is zero
    let w = PackedMatrix::from_gguf(name, &raw, 2, 512, Format::IQ4XS).unwrap();
    assert!(run(&w, &[1.0; 512], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
    let err = GemvError::UnknownFormat { tensor: name.into(), format: "iq2_xs".into() };
    assert!(err.to_string().contains("\"iq4_xs\""), "{err}");
}
