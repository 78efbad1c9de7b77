//! Property tests of the GEMV kernels: every kernel this CPU runs (scalar always) returns the
//! same bits, and each is within its error bound of a float64 reference. Q6_K's, Q4_K's and Q5_K's
//! own tests (their hand-built super-blocks, extremes and refusals) are in `gemv_q6_k`, `gemv_q4_k`
//! and `gemv_q5_k`; Q5_0's and Q5_1's in `gemv_q5`; IQ4_NL's and IQ4_XS's in `gemv_iq4`; Q3_K's in
//! `gemv_q3_k`.

mod gemv_iq4;
mod gemv_q3_k;
mod gemv_q4_k;
mod gemv_q5;
mod gemv_q5_k;
mod gemv_q6_k;

use pagedrs::gemv::format::f16_to_f32;
use pagedrs::gemv::quantize::quantize;
use pagedrs::gemv::{Format, GemvError, Kernel, PackedMatrix, QK};
use proptest::prelude::*;

/// A finite f16 of magnitude in [2^-10, 1) with a random sign.
fn f16_bits(r: u32) -> u16 {
    let sign = ((r >> 31) as u16) << 15;
    let exp = 5 + (r >> 10) % 10;
    sign | ((exp as u16) << 10) | (r & 0x3ff) as u16
}

/// xorshift: deterministic per case, so the raw bytes follow from the proptest seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 16) as u32
    }
}

/// Random bytes of a [rows, cols] tensor of super-blocks of 256 weights and `sb` bytes whose f16 `d`
/// is their last two bytes (Q6_K, Q3_K): every code and scale byte random, `d` as the other formats'
/// (magnitude 2^-10 to 1), one in 8 subnormal.
fn random_d_last(rows: usize, cols: usize, sb: usize, rng: &mut Rng) -> Vec<u8> {
    let mut raw = Vec::with_capacity(rows * cols / 256 * sb);
    for _ in 0..rows * cols / 256 {
        raw.extend((0..sb - 2).map(|_| rng.next() as u8));
        let r = rng.next();
        let d = if r % 8 == 0 { (r >> 16) as u16 & 0x83ff } else { f16_bits(r) };
        raw.extend_from_slice(&d.to_le_bytes());
    }
    raw
}

/// Random GGUF bytes of a [rows, cols] tensor (Q6_K: `gemv_q6_k::random_q6_k`; Q4_K and Q5_K:
/// `gemv_q4_k::random_k_with_min`; IQ4_XS: `gemv_iq4::random_iq4_xs`; Q3_K: `gemv_q3_k::random_q3_k`).
fn random_gguf(format: Format, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    match format {
        Format::Q6K => return gemv_q6_k::random_q6_k(rows, cols, rng),
        Format::Q4K => return gemv_q4_k::random_k_with_min(rows, cols, 144, rng),
        Format::Q5K => return gemv_q4_k::random_k_with_min(rows, cols, 176, rng),
        Format::IQ4XS => return gemv_iq4::random_iq4_xs(rows, cols, rng),
        Format::Q3K => return gemv_q3_k::random_q3_k(rows, cols, rng),
        Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => {}
    }
    // d (and m), then random quant bytes (Q5_0: `qh` and the nibbles, every code 0..31; IQ4_NL: every
    // code 0..15)
    let mut raw = Vec::new();
    for _ in 0..rows * cols / QK {
        raw.extend_from_slice(&f16_bits(rng.next()).to_le_bytes());
        if format.has_min() {
            raw.extend_from_slice(&f16_bits(rng.next()).to_le_bytes());
        }
        for _ in 0..format.quant_bytes() {
            raw.push(rng.next() as u8);
        }
    }
    raw
}

/// The weights, decoded from the GGUF bytes with the format's definition (independent of the packer).
fn dequantize(format: Format, raw: &[u8], rows: usize, cols: usize) -> Vec<f64> {
    match format {
        Format::Q6K => return raw.chunks_exact(format.gguf_block_bytes()).flat_map(gemv_q6_k::dequantize_q6_k).collect(),
        Format::Q4K => return raw.chunks_exact(format.gguf_block_bytes()).flat_map(gemv_q4_k::dequantize_q4_k).collect(),
        Format::Q5K => return raw.chunks_exact(format.gguf_block_bytes()).flat_map(gemv_q5_k::dequantize_q5_k).collect(),
        Format::IQ4XS => {
            return raw.chunks_exact(format.gguf_block_bytes()).flat_map(gemv_iq4::dequantize_iq4_xs).collect()
        }
        Format::Q3K => return raw.chunks_exact(format.gguf_block_bytes()).flat_map(gemv_q3_k::dequantize_q3_k).collect(),
        Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => {}
    }
    let bb = format.block_bytes();
    let mut w = vec![0f64; rows * cols];
    for (i, blk) in raw.chunks_exact(bb).enumerate() {
        let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64;
        let out = &mut w[i * QK..(i + 1) * QK];
        match format {
            Format::Q4_0 => (0..QK).for_each(|e| out[e] = (nibble(&blk[2..], e) as f64 - 8.0) * d),
            Format::Q4_1 => {
                let m = f16_to_f32(u16::from_le_bytes([blk[2], blk[3]])) as f64;
                (0..QK).for_each(|e| out[e] = nibble(&blk[4..], e) as f64 * d + m);
            }
            Format::Q8_0 => (0..QK).for_each(|e| out[e] = blk[2 + e] as i8 as f64 * d),
            Format::Q5_0 => out.copy_from_slice(&gemv_q5::dequantize_q5_0(blk)),
            Format::Q5_1 => out.copy_from_slice(&gemv_q5::dequantize_q5_1(blk)),
            Format::IQ4NL => out.copy_from_slice(&gemv_iq4::dequantize_iq4_nl(blk)),
            Format::Q6K | Format::Q4K | Format::Q5K | Format::IQ4XS | Format::Q3K => unreachable!("dequantized above"),
        }
    }
    w
}

fn nibble(q: &[u8], e: usize) -> u8 {
    if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 }
}

fn run(w: &PackedMatrix, x: &[f32], m: usize, threads: usize, kernel: Kernel) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows()];
    w.matmul(x, m, &mut out, threads, kernel).unwrap();
    out
}

/// Random weights of `rows` x `blocks` blocks (Q6_K, Q4_K, Q5_K, IQ4_XS, Q3_K: rounded up to whole super-blocks) times `m`
/// random activation rows: see `check_raw`.
fn check(format: Format, rows: usize, blocks: usize, m: usize, seed: u64) {
    let cols = (blocks * QK).next_multiple_of(format.gguf_block_weights());
    let mut rng = Rng(seed | 1);
    let raw = random_gguf(format, rows, cols, &mut rng);
    check_raw(format, &raw, rows, cols, m, &mut rng);
}

/// The GGUF tensor `raw` times `m` random activation rows: every kernel (1 and 2 threads) gives
/// scalar's bits, and scalar is within its bound of the float64 product of the weights (decoded
/// by `dequantize`) and the quantized activations, and of the unquantized ones.
fn check_raw(format: Format, raw: &[u8], rows: usize, cols: usize, m: usize, rng: &mut Rng) {
    let blocks = cols / QK;
    let x: Vec<f32> = (0..m * cols).map(|_| (rng.next() as f32 / u32::MAX as f32 - 0.5) * 4.0).collect();
    let w = PackedMatrix::from_gguf("t", raw, rows, cols, format).unwrap();
    let reference = run(&w, &x, m, 1, Kernel::Scalar);
    for kernel in Kernel::available() {
        for threads in [1, 2] {
            let got = run(&w, &x, m, threads, kernel);
            let same = got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{kernel:?} x{threads} differs from scalar ({format:?} rows={rows} cols={cols} m={m})");
        }
    }
    // Float64 reference: dequantized weights times the quantized activations.
    let wf = dequantize(format, raw, rows, cols);
    let acts = quantize(&x, m, cols).unwrap();
    for mi in 0..m {
        let xq: Vec<f64> =
            (0..cols).map(|c| acts.qs[mi * cols + c] as f64 * acts.d[mi * blocks + c / QK] as f64).collect();
        for r in 0..rows {
            let wr = &wf[r * cols..(r + 1) * cols];
            let exact: f64 = wr.iter().zip(&xq).map(|(a, b)| a * b).sum();
            // f32 rounding: each block adds at most two products and one sum, each within half
            // an ulp of its magnitude; bound by the sum of the terms' magnitudes.
            let mag: f64 = wr.iter().zip(&xq).map(|(a, b)| (a * b).abs()).sum();
            let bound = 3.0 * (blocks as f64 + 2.0) * f32::EPSILON as f64 * mag + 1e-30;
            let got = reference[mi * rows + r] as f64;
            assert!((got - exact).abs() <= bound, "row {r} m {mi}: {got} vs {exact} (bound {bound})");
            // And against the unquantized x: the activation rounding is at most d_a / 2 per value.
            let xf: Vec<f64> = x[mi * cols..(mi + 1) * cols].iter().map(|&v| v as f64).collect();
            let full: f64 = wr.iter().zip(&xf).map(|(a, b)| a * b).sum();
            let qbound: f64 =
                (0..cols).map(|c| wr[c].abs() * acts.d[mi * blocks + c / QK] as f64 * 0.5).sum::<f64>() + bound;
            assert!((got - full).abs() <= qbound, "row {r} m {mi}: {got} vs float {full} (bound {qbound})");
        }
    }
}

fn format_strategy() -> impl Strategy<Value = Format> {
    prop_oneof![Just(Format::Q4_0), Just(Format::Q4_1), Just(Format::Q8_0), Just(Format::Q6K), Just(Format::Q4K),
                Just(Format::Q5K), Just(Format::Q5_0), Just(Format::Q5_1), Just(Format::IQ4NL),
                Just(Format::IQ4XS), Just(Format::Q3K)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn kernels_agree_and_meet_the_bound(format in format_strategy(), rows in 1usize..70, blocks in 1usize..14,
                                        m in 1usize..=8, seed in any::<u64>()) {
        check(format, rows, blocks, m, seed);
    }

    /// Prefill-sized products (the AMX kernel's groups of 16 activation rows, and the rows past them).
    #[test]
    fn kernels_agree_on_many_rows(format in format_strategy(), rows in 1usize..70, blocks in 1usize..14,
                                  m in 16usize..=50, seed in any::<u64>()) {
        check(format, rows, blocks, m, seed);
    }
}

/// Past the kernels' row groups (AVX-512: 8 activation rows per pass over a tile; AMX: 16): 9, 17
/// and 33 rows run as 8 + 1, 8 + 8 + 1 (AMX 16 + 1) and 32 + 1, every group the scalar bits.
#[test]
fn more_rows_than_one_group_agree() {
    let formats = [Format::Q4_0, Format::Q4_1, Format::Q8_0, Format::Q6K, Format::Q4K, Format::Q5K, Format::Q5_0,
                   Format::Q5_1, Format::IQ4NL, Format::IQ4XS, Format::Q3K];
    for format in formats {
        for m in [9, 12, 16, 17, 32, 33] {
            check(format, 37, 5, m, 11 + m as u64);
        }
    }
}

#[test]
fn smollm2_shapes_agree() {
    for (format, rows, cols) in [(Format::Q4_1, 960, 576), (Format::Q4_0, 576, 1536), (Format::Q8_0, 1000, 576)] {
        for m in [1, 17] {
            check(format, rows, cols / QK, m, 7);
        }
    }
}

#[test]
fn extreme_activations_do_not_overflow() {
    // All nibbles 15 (Q4), all codes 31 (Q5) / all -128 (Q8) against activations of one sign: the
    // largest integer sums.
    for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0, Format::Q5_0, Format::Q5_1] {
        let (rows, cols) = (17, 64);
        let mut raw = Vec::new();
        for _ in 0..rows * cols / QK {
            raw.extend_from_slice(&0x3c00u16.to_le_bytes());
            if format.has_min() {
                raw.extend_from_slice(&0u16.to_le_bytes());
            }
            raw.extend(std::iter::repeat_n(if format == Format::Q8_0 { 0x80 } else { 0xff }, format.quant_bytes()));
        }
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, format).unwrap();
        let expected = match format {
            Format::Q4_0 => -7.0 * cols as f32,
            Format::Q4_1 => -15.0 * cols as f32,
            Format::Q8_0 => 128.0 * cols as f32,
            Format::Q5_0 => -15.0 * cols as f32,
            Format::Q5_1 => -31.0 * cols as f32,
            Format::Q6K => unreachable!("gemv_q6_k::extreme_quants_do_not_overflow"),
            Format::Q4K => unreachable!("gemv_q4_k::extreme_codes_do_not_overflow"),
            Format::Q5K => unreachable!("gemv_q5_k::extreme_codes_do_not_overflow"),
            Format::IQ4NL => unreachable!("gemv_iq4::iq4_nl_extreme_codes_do_not_overflow"),
            Format::IQ4XS => unreachable!("gemv_iq4::iq4_xs_extreme_codes_do_not_overflow"),
            Format::Q3K => unreachable!("gemv_q3_k::extreme_codes_do_not_overflow"),
        };
        assert_exact(&w, -1.0, &[1, 17, 33], expected, &format!("{format:?}"));
    }
}

/// Every kernel against scalar, bit for bit, at the edges of the value ranges: activations that
/// quantize to +-127 (and 0, and tiny blocks), weight scales from f16 subnormals to 65504, all-extreme
/// quants; N not a tile multiple (the last tile's padding rows) and M around the AMX groups of 16.
#[test]
fn extreme_values_agree_with_scalar() {
    let scales = [0x7bffu16, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x3c00, 0x5bff, 0x1400, 0x0000];
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0, Format::Q5_0, Format::Q5_1] {
        let (rows, blocks) = (37, 6);
        let cols = blocks * QK;
        let mut raw = Vec::new();
        for i in 0..rows * blocks {
            raw.extend_from_slice(&scales[(i + rng.next() as usize) % scales.len()].to_le_bytes());
            if format.has_min() {
                raw.extend_from_slice(&scales[(i * 7 + 3) % scales.len()].to_le_bytes());
            }
            // extreme quants (Q4: 0 / 15 nibbles, Q8: -128 / 127, Q5: also all-0 or all-1 fifth bits) in half
            // the blocks, random in the rest
            let extreme = [0x00u8, 0xff, 0x80, 0x7f, 0x0f, 0xf0];
            for _ in 0..format.quant_bytes() {
                raw.push(if i % 2 == 0 { extreme[rng.next() as usize % extreme.len()] } else { rng.next() as u8 });
            }
        }
        let w = PackedMatrix::from_gguf("t", &raw, rows, cols, format).unwrap();
        for m in [16, 17, 33, 48] {
            let x = extreme_activations(m, cols, 1e25, &mut rng);
            assert_same_as_scalar(&w, &x, m, &format!("{format:?}"));
        }
    }
}

/// `m` rows of activations at the edges, per block of 32: +-big everywhere (all +-127 once quantized),
/// one big value and zeros, tiny values, or random; magnitudes from 1e-30 to `largest` (chosen so the
/// products stay finite in f32).
fn extreme_activations(m: usize, cols: usize, largest: f32, rng: &mut Rng) -> Vec<f32> {
    (0..m * cols)
        .map(|i| {
            let (blk, e) = (i / QK, i % QK);
            let mag = [largest, 1e-30, 1.0, 3e4, 1e-8][blk % 5];
            let sign = if rng.next() % 2 == 0 { 1.0 } else { -1.0 };
            match (blk / 5) % 4 {
                0 => sign * mag,
                1 => if e == blk % QK { sign * mag } else { 0.0 },
                2 => -mag,
                _ => sign * mag * (rng.next() % 1000) as f32 / 999.0,
            }
        })
        .collect()
}

/// Every kernel, on 1 and 2 threads, gives the scalar kernel's bits for `w` times `x` (`m` rows),
/// and those are finite.
fn assert_same_as_scalar(w: &PackedMatrix, x: &[f32], m: usize, what: &str) {
    let reference = run(w, x, m, 1, Kernel::Scalar);
    assert!(reference.iter().all(|v| v.is_finite()), "{what} m={m}");
    for kernel in Kernel::available() {
        for threads in [1, 2] {
            let got = run(w, x, m, threads, kernel);
            let same = got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{kernel:?} x{threads} differs from scalar ({what} m={m})");
        }
    }
}

#[test]
fn zero_block_quantizes_to_zero() {
    let acts = quantize(&[0.0; 32], 1, 32).unwrap();
    assert_eq!((acts.d[0], acts.sum[0]), (0.0, 0));
    assert!(acts.qs.iter().all(|&q| q == 0));
}

#[test]
fn bad_input_names_the_tensor() {
    let raw = vec![0u8; 2 * 18];
    let err = PackedMatrix::from_gguf("blk.0.attn_q.weight", &raw[..35], 2, 32, Format::Q4_0).unwrap_err();
    assert!(matches!(err, GemvError::ByteCount { expected: 36, got: 35, .. }), "{err:?}");
    assert!(err.to_string().contains("blk.0.attn_q.weight"));
    let err = PackedMatrix::from_gguf("w", &raw, 1, 48, Format::Q4_0).unwrap_err();
    assert!(matches!(err, GemvError::BadShape { .. }) && err.to_string().contains("multiple of the block size 32"));
    let mut nan = raw.clone();
    nan[18..20].copy_from_slice(&0x7e00u16.to_le_bytes());
    let err = PackedMatrix::from_gguf("w", &nan, 2, 32, Format::Q4_0).unwrap_err();
    assert!(matches!(err, GemvError::NonFiniteScale { field: "d", row: 1, block: 0, .. }), "{err:?}");
    let mut inf_min = vec![0u8; 20];
    inf_min[2..4].copy_from_slice(&0xfc00u16.to_le_bytes());
    let err = PackedMatrix::from_gguf("w", &inf_min, 1, 32, Format::Q4_1).unwrap_err();
    assert!(matches!(err, GemvError::NonFiniteScale { field: "m", .. }), "{err:?}");
    let w = PackedMatrix::from_gguf("w", &raw, 2, 32, Format::Q4_0).unwrap();
    let mut out = vec![0f32; 2];
    let mut x = vec![1f32; 32];
    x[5] = f32::NAN;
    let err = w.matmul(&x, 1, &mut out, 1, Kernel::Scalar).unwrap_err();
    assert!(matches!(err, GemvError::NonFiniteInput { row: 0, col: 5, .. }), "{err:?}");
    assert!(matches!(w.matmul(&x[..31], 1, &mut out, 1, Kernel::Scalar), Err(GemvError::Input { .. })));
    assert!(matches!(w.matmul(&[1.0; 32], 1, &mut out, 0, Kernel::Scalar), Err(GemvError::Threads { .. })));
}

#[test]
fn this_machine_reports_its_kernels() {
    // Never assumed: the list comes from run-time detection; scalar is always there.
    let kernels = Kernel::available();
    assert_eq!(kernels[0], Kernel::Scalar);
    #[cfg(target_arch = "x86_64")]
    assert_eq!(kernels.contains(&Kernel::Avx2), is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"));
    #[cfg(target_arch = "x86_64")]
    if kernels.contains(&Kernel::Amx) {
        assert!(kernels.contains(&Kernel::Avx512Vnni), "AMX's rows past its groups run on AVX-512");
    }
    assert_eq!(Kernel::best(), *kernels.last().unwrap());
    assert_eq!(Kernel::parse("amx_int8"), Some(Kernel::Amx));
    eprintln!("gemv kernels on this machine: {kernels:?}");
}

/// A matrix the size of a real layer's (rows not a tile multiple) split over 1, 2 and 3 threads:
/// every kernel, the same bits, every output written (`run` starts from NaN). M = 11 and 33: a thread's
/// chunk takes the heap buffer of more than 8 rows; 33: two AMX groups and one row past them.
#[test]
fn large_products_split_over_threads_give_the_same_bits() {
    // Q8_0: 2051 x 512 x 34 / 32 bytes = 1.1 MB, rows not a tile multiple; the K-quants' super-block tiles too
    let (rows, cols) = (2051, 512);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let formats = [Format::Q8_0, Format::Q6K, Format::Q4K, Format::Q5K, Format::Q5_0, Format::Q5_1, Format::IQ4NL,
                   Format::IQ4XS, Format::Q3K];
    for format in formats {
        let raw = random_gguf(format, rows, cols, &mut rng);
        let w = PackedMatrix::from_gguf("big", &raw, rows, cols, format).unwrap();
        for m in [1, 3, 11, 33] {
            let x: Vec<f32> = (0..m * cols).map(|_| (rng.next() as f32 / u32::MAX as f32 - 0.5) * 4.0).collect();
            let reference = run(&w, &x, m, 1, Kernel::Scalar);
            assert!(reference.iter().all(|v| v.is_finite()), "{format:?} m={m}");
            for kernel in Kernel::available() {
                for threads in [1, 2, 3] {
                    let got = run(&w, &x, m, threads, kernel);
                    assert!(got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{format:?} {kernel:?} x{threads} m={m}");
                }
            }
        }
    }
}

/// Every kernel gives exactly `expected` in every output of `w` times `m` rows of `x` (the largest
/// integer sums, where every step is exact).
/// A super-block format (256 weights) refuses a row that is not whole super-blocks (32, 128, 288 and 0
/// columns), naming the tensor, the rule and the format.
fn assert_super_block_columns_refused(format: Format) {
    let name = "blk.3.ffn_gate.weight";
    for cols in [32, 128, 288, 0] {
        let err = PackedMatrix::from_gguf(name, &vec![0u8; format.gguf_block_bytes()], 1, cols, format).unwrap_err();
        assert!(matches!(err, GemvError::BadShape { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(name) && text.contains("multiple of 256") && text.contains(format.name()), "{text}");
    }
}

fn assert_exact(w: &PackedMatrix, x: f32, ms: &[usize], expected: f32, what: &str) {
    for &m in ms {
        let xs = vec![x; m * w.cols()];
        for kernel in Kernel::available() {
            let got = run(w, &xs, m, 1, kernel);
            assert!(got.iter().all(|&v| v == expected), "{kernel:?} {what} m={m}: {:?} != {expected}", &got[..2]);
        }
    }
}
