//! Q3_K's tests (a module of `gemv_proptest`, whose `check` and `check_raw` they share): hand-built
//! super-blocks at the edges of the format (every 6-bit scale in every one of the 16 positions of the
//! packed `scales[12]`, every `hmask` bit set and clear, codes -4 and 3 in runs; subnormal, negative,
//! zero and largest `d`) against ggml's own dequantization loop, ported below as the float64
//! reference, and against gguf-py's numpy formulation; random shapes; every kernel the scalar bits;
//! the largest integer sums; the packer's refusals.
//!
//! Why ggml's loop and not the packer's reading of the bits (`format::q3_k_code`, `q3_k_scale`): the
//! reference must not share the code it checks, and the loop is the definition llama.cpp's files are
//! written to.

use super::*;

/// Bytes of a GGUF Q3_K super-block (256 weights): `hmask[32]`, `qs[64]`, `scales[12]`, f16 `d`.
const SB: usize = 110;

/// ggml's `dequantize_row_q3_K` for one super-block, as it is written (the scales unpacked through
/// `aux[4]` with `kmask1` / `kmask2`, then `dl * ((q >> shift) & 3) - (hm & m ? 0 : 4)`), in float64
/// (exact: d * (sc - 32) * q has at most 11 + 6 + 3 significant bits).
pub(super) fn dequantize_q3_k(sb: &[u8]) -> Vec<f64> {
    let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let d_all = f16_to_f32(u16::from_le_bytes([sb[108], sb[109]])) as f64;
    let mut aux = [0u32; 4];
    for k in 0..3 {
        aux[k] = u32::from_le_bytes([sb[96 + 4 * k], sb[97 + 4 * k], sb[98 + 4 * k], sb[99 + 4 * k]]);
    }
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    let scales: [i8; 16] = std::array::from_fn(|i| (aux[i / 4] >> (8 * (i % 4))) as u8 as i8);
    let (hm, mut q) = (&sb[..32], &sb[32..96]);
    let mut y = Vec::with_capacity(256);
    let (mut is, mut m) = (0, 1u8);
    for _n in 0..2 {
        let mut shift = 0;
        for _j in 0..4 {
            for off in [0, 16] {
                let dl = d_all * (scales[is] as i32 - 32) as f64;
                is += 1;
                for l in 0..16 {
                    let low = ((q[l + off] >> shift) & 3) as i32;
                    y.push(dl * (low - if hm[l + off] & m != 0 { 0 } else { 4 }) as f64);
                }
            }
            shift += 2;
            m <<= 1;
        }
        q = &q[32..];
    }
    y
}

/// gguf-py's `Q3_K.dequantize_blocks` (numpy) for one super-block, step by step: the 16 scales as
/// the nibbles of bytes 0..8 (low nibbles first) over the bit pairs of bytes 8..12 (shifts 0, 2, 4, 6),
/// the codes as `qs` shifted by 0, 2, 4, 6 (32 bytes a half) minus `4 * (hmask bit ^ 1)`.
fn dequantize_q3_k_numpy(sb: &[u8]) -> Vec<f64> {
    let (hmask, qs, scales) = (&sb[..32], &sb[32..96], &sb[96..108]);
    let d = f16_to_f32(u16::from_le_bytes([sb[108], sb[109]])) as f64;
    let lscales: Vec<u8> = (0..2).flat_map(|s| scales[..8].iter().map(move |&b| b >> (4 * s))).collect();
    let hscales: Vec<u8> = (0..4).flat_map(|s| scales[8..].iter().map(move |&b| b >> (2 * s))).collect();
    let sc: Vec<f64> = (0..16).map(|i| (((lscales[i] & 0x0f) | ((hscales[i] & 3) << 4)) as i8 - 32) as f64).collect();
    // ql: (2 halves, 4 shifts, 32); qh: (8 bits, 32), reshaped to (16, 16)
    let ql: Vec<u8> = (0..2).flat_map(|h| (0..4).flat_map(move |s| (0..32).map(move |l| (qs[32 * h + l] >> (2 * s)) & 3)))
        .collect();
    let qh: Vec<u8> = (0..8).flat_map(|s| (0..32).map(move |l| ((hmask[l] >> s) & 1) ^ 1)).collect();
    (0..256).map(|e| d * sc[e / 16] * (ql[e] as i8 - (qh[e] << 2) as i8) as f64).collect()
}

/// A super-block whose weight `e` is `d * (scales[e / 16] - 32) * q[e]` (q in -4..3, scales 0..63):
/// the bits put where the loop above reads them.
fn encode_q3_k(q: &[i8; 256], scales: &[u8; 16], d: u16) -> Vec<u8> {
    let mut sb = vec![0u8; SB];
    for (e, &q) in q.iter().enumerate() {
        assert!((-4..=3).contains(&q));
        let c = (q + 4) as u8; // low 2 bits, and the bit that says "no -4"
        let (half, k, l) = (e / 128, e % 128 / 32, e % 32);
        sb[32 + 32 * half + l] |= (c & 3) << (2 * k);
        sb[l] |= (c >> 2) << (4 * half + k);
    }
    for (g, &s) in scales.iter().enumerate() {
        assert!(s < 64);
        sb[96 + g % 8] |= (s & 0x0f) << (4 * (g / 8));
        sb[96 + 8 + g % 4] |= (s >> 4) << (2 * (g / 4));
    }
    sb[108..].copy_from_slice(&d.to_le_bytes());
    sb
}

/// Random Q3_K bytes of a [rows, cols] tensor (`random_d_last`: every code and scale byte random, `d` last).
pub(super) fn random_q3_k(rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    random_d_last(rows, cols, SB, rng)
}

/// Hand-built super-blocks: 64 of them (rows 0..16 of 19, four super-blocks a row, the rest
/// random) with group `g`'s scale `(s + 5 g) % 64` in super-block `s` (every 6-bit scale in every
/// position), codes -4 and 3 in runs, ramps and mixes (every `hmask` bit both set and clear), `d` the
/// smallest and largest subnormal, 65504 of either sign, negative, zero and 1. The port, gguf-py's
/// formulation and the encoder agree with the definition; then M = 1..9 and 17 (AVX2: passes of 4
/// rows; AVX-512: 8) against the float64 reference, every kernel the bits (1 and 2 threads).
#[test]
fn hand_built_super_blocks_meet_the_bound() {
    let ds = [0x0001u16, 0x03ff, 0x7bff, 0xfbff, 0xb800, 0x0000, 0x3c00];
    let codes = |s: usize| -> [i8; 256] {
        std::array::from_fn(|e| match (e / 16 + s) % 5 {
            0 => -4,
            1 => 3,
            2 => (e % 8) as i8 - 4,
            3 => ((e * 37 + s) % 8) as i8 - 4,
            _ => if (e + s) % 2 == 0 { -4 } else { 3 },
        })
    };
    let (rows, cols) = (19, 1024);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut raw = random_q3_k(rows, cols, &mut rng);
    let (mut scale_seen, mut hbit_seen) = ([[false; 64]; 16], [[[false; 2]; 8]; 32]);
    for s in 0..64 {
        let (q, sc) = (codes(s), std::array::from_fn(|g| ((s + 5 * g) % 64) as u8));
        let d = ds[s % ds.len()];
        let sb = encode_q3_k(&q, &sc, d);
        let (y, np) = (dequantize_q3_k(&sb), dequantize_q3_k_numpy(&sb));
        let dv = f16_to_f32(d) as f64;
        for e in 0..256 {
            let want = dv * (sc[e / 16] as f64 - 32.0) * q[e] as f64;
            assert_eq!((y[e], np[e]), (want, want), "super-block {s}, weight {e}");
        }
        for g in 0..16 {
            scale_seen[g][sc[g] as usize] = true;
        }
        for (l, &h) in sb[..32].iter().enumerate() {
            for bit in 0..8 {
                hbit_seen[l][bit][((h >> bit) & 1) as usize] = true;
            }
        }
        raw[s * SB..][..SB].copy_from_slice(&sb);
    }
    assert!(scale_seen.iter().flatten().all(|&x| x), "every scale in every position");
    assert!(hbit_seen.iter().flatten().flatten().all(|&x| x), "every hmask bit set and clear");
    for m in (1..=9).chain([17]) {
        check_raw(Format::Q3K, &raw, rows, cols, m, &mut rng);
    }
}

/// ggml's loop and gguf-py's formulation agree on random super-blocks (every byte random).
#[test]
fn ggml_and_gguf_py_agree_on_random_super_blocks() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let raw = random_q3_k(1, 256 * 300, &mut rng);
    for sb in raw.chunks_exact(SB) {
        let (a, b) = (dequantize_q3_k(sb), dequantize_q3_k_numpy(sb));
        assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "{sb:?}");
    }
}

/// The largest integer sums: every q -4 with scale 0 (-32), and every q 3 with scale 63 (31), against
/// activations of one sign, all +-127 (so their scale is 1 and every step is exact; |T| = 2 * 32 * 16
/// * 4 * 127 = 520192): each kernel gives the exact product.
#[test]
fn extreme_codes_do_not_overflow() {
    let (rows, cols) = (17, 512);
    for (q, scale, x, weight) in [(-4i8, 0u8, -127.0f32, 128.0f32), (3, 63, 127.0, 93.0), (-4, 0, 127.0, 128.0)] {
        let sb = encode_q3_k(&[q; 256], &[scale; 16], 0x3c00);
        let raw = sb.repeat(rows * cols / 256);
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, Format::Q3K).unwrap();
        assert_exact(&w, x, &[1, 5, 9, 17], weight * x * cols as f32, &format!("q={q}"));
    }
}

/// Random shapes (rows not a tile multiple, 1 to 5 super-blocks a row), M 1..9 and 17, every kernel.
#[test]
fn random_shapes_agree() {
    for (i, (rows, sbs)) in [(1, 1), (15, 2), (16, 1), (17, 3), (33, 5), (50, 4)].into_iter().enumerate() {
        for m in (1..=9).chain([17]) {
            check(Format::Q3K, rows, sbs * 8, m, 0x51_7cc1_b727_220a + (31 * i + m) as u64);
        }
    }
}

/// What one product streams: 114 bytes a row per 256 weights (the tiles without padding rows).
#[test]
fn q3_k_weight_bytes_are_the_tiles() {
    let w = PackedMatrix::from_gguf("w", &vec![0u8; 37 * 2 * SB], 37, 512, Format::Q3K).unwrap();
    assert_eq!((w.weight_bytes(), w.tile_block_bytes(), w.blocks(), w.tile_blocks()), (37 * 2 * 114, 16 * 114, 16, 2));
}

#[test]
fn q3_k_bad_input_names_the_tensor() {
    let name = "blk.7.ffn_down.weight";
    assert_super_block_columns_refused(Format::Q3K);
    let raw = vec![0u8; 2 * 2 * SB];
    let err = PackedMatrix::from_gguf(name, &raw[1..], 2, 512, Format::Q3K).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 440, got: 439, format: "q3_k", .. }), "{err:?}");
    assert!(err.to_string().contains(name));
    let q8_0_sized = vec![0u8; 2 * 16 * 34];
    let err = PackedMatrix::from_gguf(name, &q8_0_sized, 2, 512, Format::Q3K).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 440, got: 1088, .. }), "a Q8_0-sized tensor: {err:?}");
    assert!(err.to_string().contains(name));
    for bits in [0x7c00u16, 0xfc00, 0x7e00, 0xfe01] {
        let mut bad = raw.clone();
        bad[3 * SB + 108..3 * SB + 110].copy_from_slice(&bits.to_le_bytes()); // row 1, super-block 1
        let err = PackedMatrix::from_gguf(name, &bad, 2, 512, Format::Q3K).unwrap_err();
        assert!(matches!(err, GemvError::NonFiniteScale { field: "d", row: 1, block: 1, .. }), "{err:?}");
        assert!(err.to_string().contains(name));
    }
    // a zero `d` is finite: the matrix is zero
    let w = PackedMatrix::from_gguf(name, &raw, 2, 512, Format::Q3K).unwrap();
    assert!(run(&w, &[1.0; 512], 1, 1, Kernel::Scalar).iter().all(|&v| v == 0.0));
}
