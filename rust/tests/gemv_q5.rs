//! Q5_0's and Q5_1's tests (a module of `gemv_proptest`, whose `check` and `check_raw` they share):
//! hand-built blocks at the edges of the formats (every byte value in each of the four bytes of `qh`,
//! codes 0 and 31, subnormal, negative, zero and largest `d` and `m`) against ggml's own
//! dequantization loops, ported below as the float64 reference; shapes whose columns are any
//! multiple of 32 and whose rows are not a multiple of 16; every kernel the scalar bits; the largest
//! integer sums; the packer's refusals.
//!
//! Why ggml's loops and not the packer's reading of the bits (`format::q5_code`): the reference must
//! not share the code it checks, and the loops are the definition llama.cpp's files are written to.

use super::*;

/// The formats of this module.
const FORMATS: [Format; 2] = [Format::Q5_0, Format::Q5_1];

/// ggml's `dequantize_row_q5_0` for one block (f16 `d`, `qh[4]`, `qs[16]`), as it is written, in
/// float64 (exact: `(x - 16) * d` has at most 11 + 5 significant bits).
pub(super) fn dequantize_q5_0(blk: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64;
    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
    let qs = &blk[6..22];
    let mut y = vec![0f64; 32];
    for j in 0..16 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0F) | xh_0) as i32 - 16;
        let x1 = ((qs[j] >> 4) | xh_1) as i32 - 16;
        y[j] = x0 as f64 * d;
        y[j + 16] = x1 as f64 * d;
    }
    y
}

/// ggml's `dequantize_row_q5_1` for one block (f16 `d`, f16 `m`, `qh[4]`, `qs[16]`), as it is
/// written, in float64 (exact: `x * d` has at most 16 significant bits, and it and `m` are multiples
/// of 2^-24 below 2^21).
pub(super) fn dequantize_q5_1(blk: &[u8]) -> Vec<f64> {
    let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64;
    let m = f16_to_f32(u16::from_le_bytes([blk[2], blk[3]])) as f64;
    let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
    let qs = &blk[8..24];
    let mut y = vec![0f64; 32];
    for j in 0..16 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = (qs[j] & 0x0F) | xh_0;
        let x1 = (qs[j] >> 4) | xh_1;
        y[j] = x0 as f64 * d + m;
        y[j + 16] = x1 as f64 * d + m;
    }
    y
}

/// A block of `format` whose weight `e` is `(q[e] - 16) * d` (Q5_0) or `q[e] * d + m` (Q5_1; codes
/// 0..31): the bits put where the loops above read them.
fn encode_q5(format: Format, q: &[u8; 32], d: u16, m: u16) -> Vec<u8> {
    let mut blk = d.to_le_bytes().to_vec();
    if format == Format::Q5_1 {
        blk.extend_from_slice(&m.to_le_bytes());
    }
    let qh = q.iter().enumerate().fold(0u32, |qh, (e, &q)| qh | (((q >> 4) as u32 & 1) << e));
    blk.extend_from_slice(&qh.to_le_bytes());
    blk.extend((0..16).map(|j| (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)));
    assert_eq!(blk.len(), format.gguf_block_bytes());
    blk
}

/// What a block of `format` with codes `q`, `d` and `m` (f16 bits) is by definition.
fn definition(format: Format, q: &[u8; 32], d: u16, m: u16) -> Vec<f64> {
    let (d, m) = (f16_to_f32(d) as f64, f16_to_f32(m) as f64);
    match format {
        Format::Q5_0 => q.iter().map(|&q| (q as f64 - 16.0) * d).collect(),
        Format::Q5_1 => q.iter().map(|&q| q as f64 * d + m).collect(),
        _ => unreachable!("{format:?}"),
    }
}

/// Hand-built blocks (19 rows of 14, 266 blocks): in the first 256, byte `k` of block `i`'s `qh` is
/// a permutation of `i` (every value 0..255 once in each of the four bytes) over low nibbles 0, 15, a
/// ramp and a mix; the last 10 whole blocks of code 0, of code 31, and ramps 0..31; `d` and `m` the
/// smallest and largest subnormal, 65504 of either sign, 1, negative and zero. The port and the
/// encoder agree with the definition; then M = 1..9 and 17 (AVX2: passes of 4 rows) against the
/// float64 reference, every kernel the bits (1 and 2 threads).
#[test]
fn hand_built_blocks_meet_the_bound() {
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0x3c00, 0xb800, 0x0000, 0x2e66, 0x8001, 0xfbff];
    let ms = [0x7bffu16, 0x0001, 0x3c00, 0x0000, 0x03ff, 0xbc00, 0x2a00, 0x5bff, 0x8000, 0xfbff];
    let (rows, cols) = (19, 448);
    for format in FORMATS {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut raw = Vec::with_capacity(rows * cols / 32 * format.gguf_block_bytes());
        let mut seen = [[0usize; 256]; 4];
        for i in 0..rows * cols / 32 {
            let q: [u8; 32] = if i < 256 {
                let qh = [i, (i + 85) % 256, (i + 170) % 256, 255 - i].map(|b| b as u32);
                let qh = qh[0] | (qh[1] << 8) | (qh[2] << 16) | (qh[3] << 24);
                std::array::from_fn(|e| {
                    let low = match i % 4 {
                        0 => 0,
                        1 => 15,
                        2 => (e % 16) as u8,
                        _ => ((e * 7 + i) % 16) as u8,
                    };
                    low | ((((qh >> e) & 1) as u8) << 4)
                })
            } else {
                std::array::from_fn(|e| [0, 31, e as u8][i % 3])
            };
            let (d, m) = (ds[i % ds.len()], ms[i % ms.len()]);
            let blk = encode_q5(format, &q, d, m);
            if i < 256 {
                let qh = &blk[format.header_bytes()..][..4];
                (0..4).for_each(|k| seen[k][qh[k] as usize] += 1);
            }
            assert_eq!(dequantize(format, &blk, 1, 32), definition(format, &q, d, m), "{format:?} block {i}");
            raw.extend_from_slice(&blk);
        }
        assert!(seen.iter().flatten().all(|&n| n == 1), "{format:?}: every qh byte value once in each byte");
        for m in (1..=9).chain([17]) {
            check_raw(format, &raw, rows, cols, m, &mut rng);
        }
    }
}

/// Columns any multiple of 32 (1 to 13 blocks, odd ones included), rows not a multiple of 16 (and
/// fewer than 16), M across the AVX2 passes of 4 rows and past the AMX group of 16.
#[test]
fn any_multiple_of_32_columns_agree() {
    for format in FORMATS {
        let shapes = [(1, 1), (15, 3), (17, 5), (33, 7), (70, 9), (5, 13), (16, 2)];
        for (i, (rows, blocks)) in shapes.into_iter().enumerate() {
            for m in [1, 2, 3, 4, 5, 17] {
                check(format, rows, blocks, m, 0x9e37 + 31 * i as u64 + m as u64);
            }
        }
    }
}

/// The largest integer sums: every code 31 (and every code 0) with `d` 1 (and `m` 1), against
/// activations of +-127 (so `d_a` = 1 and every step is exact): |sum q a| = 31 * 127 * 32 = 125984 a
/// block, 16-bit partial sums up to 31496 (AVX2 sums each half of a block apart: the whole block's
/// 62992 would wrap). Each kernel gives the exact product.
#[test]
fn extreme_codes_do_not_overflow() {
    let (rows, cols) = (17, 128);
    for format in FORMATS {
        for (q, x) in [(31u8, -127.0f32), (31, 127.0), (0, 127.0), (0, -127.0)] {
            let raw = encode_q5(format, &[q; 32], 0x3c00, 0x3c00).repeat(rows * cols / 32);
            let w = PackedMatrix::from_gguf("t", &raw, rows, cols, format).unwrap();
            let weight = match format {
                Format::Q5_0 => q as f32 - 16.0,
                Format::Q5_1 => q as f32 + 1.0,
                _ => unreachable!("{format:?}"),
            };
            assert_exact(&w, x, &[1, 5, 17], weight * x * cols as f32, &format!("{format:?} q={q}"));
        }
    }
}

/// Every kernel against scalar, bit for bit, at the edges of the value ranges: `d` and `m` from f16
/// subnormals to 65504 of either sign (and zero), codes 0 and 31 in half the blocks; activations that
/// quantize to +-127, one value and zeros, tiny blocks; N not a tile multiple and M around the AVX2
/// passes of 4 rows and the AMX groups of 16.
#[test]
fn q5_extreme_values_agree_with_scalar() {
    let scales = [0x7bffu16, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x3c00, 0x5bff, 0x1400, 0x0000];
    let (rows, cols) = (37, 224);
    for format in FORMATS {
        let mut rng = Rng(0x5851_f42d_4c95_7f2d);
        let mut raw = Vec::new();
        for i in 0..rows * cols / 32 {
            let (d, m) = (scales[(i + rng.next() as usize) % scales.len()], scales[(i * 7 + 3) % scales.len()]);
            let q: [u8; 32] = if i % 2 == 0 {
                std::array::from_fn(|_| if rng.next() % 2 == 0 { 0 } else { 31 })
            } else {
                std::array::from_fn(|_| (rng.next() % 32) as u8)
            };
            raw.extend(encode_q5(format, &q, d, m));
        }
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, format).unwrap();
        for m in [1, 3, 4, 5, 16, 17, 33] {
            let x = extreme_activations(m, cols, 1e20, &mut rng);
            assert_same_as_scalar(&w, &x, m, &format!("{format:?}"));
        }
    }
}

/// What one product streams: the GGUF tensor's bytes (22 or 24 a row per 32 weights, 5.5 or 6 bits a
/// weight, against Q8_0's 34), the padding rows not counted.
#[test]
fn q5_weight_bytes_are_the_file_bytes() {
    for format in FORMATS {
        let bb = format.gguf_block_bytes();
        let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 16 * bb], 37, 512, format).unwrap();
        assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks(), w.tile_blocks()),
                   (37 * 16 * bb, 16 * bb, 16, 16));
    }
    assert_eq!((Format::Q5_0.gguf_block_bytes(), Format::Q5_1.gguf_block_bytes()), (22, 24));
}

#[test]
fn q5_bad_input_names_the_tensor() {
    let name = "blk.0.ffn_down.weight";
    for format in FORMATS {
        let bb = format.gguf_block_bytes();
        for cols in [16, 48, 100, 0] {
            let err = PackedMatrix::from_gguf(name, &vec![0u8; 2 * bb], 1, cols, format).unwrap_err();
            assert!(matches!(err, GemvError::BadShape { .. }), "{err:?}");
            let text = err.to_string();
            assert!(text.contains(name) && text.contains("multiple of the block size 32"), "{text}");
        }
        let raw = vec![0u8; 2 * 2 * bb];
        for wrong in [4 * bb - 1, 4 * bb + 1, 4 * 18, 4 * 20, 4 * 34, 4 * (46 - bb)] {
            // a byte short or over, Q4_0-, Q4_1-, Q8_0-sized, the other Q5's size
            let err = PackedMatrix::from_gguf(name, &vec![0u8; wrong], 2, 64, format).unwrap_err();
            assert!(matches!(err, GemvError::ByteCount { expected, got, format: f, .. }
                             if expected == 4 * bb && got == wrong && f == format.name()), "{wrong} bytes: {err:?}");
            assert!(err.to_string().contains(name));
        }
        let fields: &[(&str, usize)] = if format == Format::Q5_1 { &[("d", 0), ("m", 2)] } else { &[("d", 0)] };
        for &(field, off) in fields {
            for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
                let mut bad = raw.clone();
                bad[3 * bb + off..3 * bb + off + 2].copy_from_slice(&bits.to_le_bytes()); // row 1, block 1
                let err = PackedMatrix::from_gguf(name, &bad, 2, 64, format).unwrap_err();
                assert!(matches!(err, GemvError::NonFiniteScale { field: f, row: 1, block: 1, .. } if f == field),
                        "{format:?}: {err:?}");
                assert!(err.to_string().contains(name));
            }
        }
        // a zero `d` (and `m`) is finite: the matrix is zero
        let w = PackedMatrix::from_gguf(name, &raw, 2, 64, format).unwrap();
        assert!(run(&w, &[1.0; 64], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
        let err = GemvError::UnknownFormat { tensor: name.into(), format: "q2_k".into() };
        assert!(err.to_string().contains(&format!("\"{}\"", format.name())), "{err}");
    }
}
