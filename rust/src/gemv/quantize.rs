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
            *q = round_half_away(v * id).clamp(-127, 127) as i8;
            sum += *q as i32;
        }
        out.d[i] = d;
        out.sum[i] = sum;
        out.dsum[i] = d * sum as f32;
    }
    Ok(out)
}

/// `x.round() as i32` (half away from zero, as C's `roundf`) for |x| <= 2^23, without the libm call
/// `f32::round` is on a target without SSE4.1 (x86-64's baseline): one per activation made
/// quantizing a layer input cost more than multiplying a small weight by it. A cast truncates
/// toward zero; the dropped fraction is exact, so comparing it with 0.5 rounds exactly.
#[inline]
pub fn round_half_away(x: f32) -> i32 {
    let t = x as i32;
    let frac = x - t as f32;
    t + (frac >= 0.5) as i32 - (frac <= -0.5) as i32
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    #[test]
    fn rounds_as_roundf_at_the_edges() {
        let mut cases = vec![0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 127.0, -127.0];
        cases.extend([0.49999997f32, -0.49999997, 0.50000006, 1.4999999, 126.49999, f32::MIN_POSITIVE, 8388607.5]);
        for x in cases {
            assert_eq!(round_half_away(x), x.round() as i32, "{x}");
        }
        let mut v = 1e-3f32;
        while v < 130.0 {
            // a sweep of every magnitude the quantizer produces
            let (up, down) = (f32::from_bits(v.to_bits() + 1), f32::from_bits(v.to_bits() - 1));  // v > 0
            for x in [v, -v, up, -up, down, -down, v.floor() + 0.5, -(v.floor() + 0.5)] {
                assert_eq!(round_half_away(x), x.round() as i32, "{x}");
            }
            v *= 1.0001;
        }
    }
}
