//! Activations quantized per block of 32 to int8, llama.cpp's Q8_0 / Q8_1 scheme.
//!
//! `d = max|x| / 127`, `q = round(x / d)` (half away from zero, as `roundf`), kept with the
//! block's integer sum (Q4_0 subtracts `8 * sum`, Q4_1 adds `m * d * sum`, Q8_0 on the
//! AVX-512 path offsets its weights by 128). Scales stay f32 (llama.cpp rounds them to f16):
//! finer, and the same on every path because this code runs once, before any kernel.

use super::format::QK;

/// `m` rows of `k` activations, quantized.
#[derive(Debug, Clone)]
pub struct QuantizedActs {
    pub m: usize,
    pub blocks: usize,
    /// `m * k` int8 values, row-major.
    pub qs: Vec<i8>,
    /// Scale per (row, block).
    pub d: Vec<f32>,
    /// Integer sum of the block's values per (row, block).
    pub sum: Vec<i32>,
    /// `d * sum` per (row, block): the Q4_1 minimum's factor.
    pub dsum: Vec<f32>,
}

/// Quantizes `x` (`m * k`, row-major; `k` a multiple of 32). `Err((row, col))` at the first
/// non-finite value.
pub fn quantize(x: &[f32], m: usize, k: usize) -> Result<QuantizedActs, (usize, usize)> {
    assert!(k % QK == 0 && x.len() == m * k, "quantize: caller checked the shape");
    let blocks = k / QK;
    let mut out = QuantizedActs {
        m,
        blocks,
        qs: vec![0; m * k],
        d: vec![0.0; m * blocks],
        sum: vec![0; m * blocks],
        dsum: vec![0.0; m * blocks],
    };
    for (i, (src, dst)) in x.chunks_exact(QK).zip(out.qs.chunks_exact_mut(QK)).enumerate() {
        let mut amax = 0f32;
        for (c, &v) in src.iter().enumerate() {
            if !v.is_finite() {
                return Err((i / blocks, (i % blocks) * QK + c));
            }
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in dst.iter_mut().zip(src) {
            *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            sum += *q as i32;
        }
        out.d[i] = d;
        out.sum[i] = sum;
        out.dsum[i] = d * sum as f32;
    }
    Ok(out)
}
