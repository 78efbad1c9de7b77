//! Activations quantized per block of 32 to int8, llama.cpp's Q8_0 / Q8_1 scheme.
//!
//! `d = max|x| / 127`, `q = round(x / d)` (half away from zero, as `roundf`), kept with the
//! block's integer sum (Q4_0 subtracts `8 * sum`, Q4_1, Q4_K and Q5_K add `m * d * sum`, Q8_0 on the
//! AVX-512 path offsets its weights by 128) and the sum of its first 16 values (the SIMD
//! kernels multiply Q6_K's unsigned q, then subtract `32 * sum` per group of 16, and Q3_K's unsigned
//! codes, minus `4 * sum` per group: computed here
//! once per row, not once per tile). Scales stay f32 (llama.cpp rounds them to f16): finer, and
//! the same on every path because this code runs once, before any kernel.

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
    /// Integer sum of the block's first 16 values per (row, block) (the second 16's: `sum - sum_lo`).
    pub sum_lo: Vec<i32>,
    /// `d * sum` per (row, block): the Q4_1 (and Q4_K, Q5_K) minimum's factor.
    pub dsum: Vec<f32>,
}

/// Quantizes `x` (`m * k`, row-major; `k` a multiple of 32). `Err((row, col))` at the first
/// non-finite value.
///
/// On a CPU with AVX2 the blocks are quantized eight values at a time: the same operations
/// (an exact maximum, `d = amax / 127`, `x * (1 / d)` per value, exact rounding, an integer
/// sum), so the same bits. Why: at M = 5 the scalar loop cost about a fifth of the products it
/// feeds (SmolLM2's layer inputs, Intel Xeon).
pub fn quantize(x: &[f32], m: usize, k: usize) -> Result<QuantizedActs, (usize, usize)> {
    assert!(k % QK == 0 && x.len() == m * k, "quantize: caller checked the shape");
    let mut out = QuantizedActs::zeroed(m, k);
    let rows = out.rows_mut();
    // SAFETY: `rows` points into `out`, which lives to the end of the call and is touched by
    // nothing else meanwhile; rows 0 .. m are `out`'s.
    unsafe { rows.quantize(x, 0)? };
    Ok(out)
}

impl QuantizedActs {
    /// Room for `m` rows of `k` activations (`k` a multiple of 32), zero until quantized into.
    pub fn zeroed(m: usize, k: usize) -> QuantizedActs {
        let blocks = k / QK;
        QuantizedActs { m, blocks, qs: vec![0; m * k], d: vec![0.0; m * blocks], sum: vec![0; m * blocks],
                        sum_lo: vec![0; m * blocks], dsum: vec![0.0; m * blocks] }
    }

    /// Its storage as raw rows, for threads that each quantize rows of their own ([`ActsRows`]).
    pub fn rows_mut(&mut self) -> ActsRows {
        ActsRows {
            qs: self.qs.as_mut_ptr(), d: self.d.as_mut_ptr(), sum: self.sum.as_mut_ptr(),
            sum_lo: self.sum_lo.as_mut_ptr(), dsum: self.dsum.as_mut_ptr(), m: self.m, blocks: self.blocks,
        }
    }
}

/// A [`QuantizedActs`]' storage, to be filled row by row from several threads (each its own rows:
/// a prompt's layer inputs quantized in parallel).
#[derive(Clone, Copy)]
pub struct ActsRows {
    qs: *mut i8,
    d: *mut f32,
    sum: *mut i32,
    sum_lo: *mut i32,
    dsum: *mut f32,
    m: usize,
    blocks: usize,
}

// SAFETY: only pointers; `quantize`'s contract keeps threads to disjoint rows.
unsafe impl Send for ActsRows {}
// SAFETY: as above.
unsafe impl Sync for ActsRows {}

impl ActsRows {
    /// Quantizes `x` (whole rows of `k = blocks * 32`) into rows `first ..` of the storage.
    /// `Err((row, col))` (`row` counted from row 0 of the storage) at the first non-finite value.
    ///
    /// # Safety
    /// The `QuantizedActs` these pointers came from is alive and not read or written meanwhile,
    /// except through other `ActsRows` calls on other rows; `first + x.len() / k <= m`.
    pub unsafe fn quantize(&self, x: &[f32], first: usize) -> Result<(), (usize, usize)> {
        let k = self.blocks * QK;
        if k == 0 {
            return Ok(()); // rows of no columns
        }
        let rows = x.len() / k;
        assert!(x.len() % k == 0 && first + rows <= self.m, "quantize: rows {first} + {rows} of {}", self.m);
        let at = first * self.blocks;
        // SAFETY: rows `first .. first + rows` lie inside the storage (just checked) and no other
        // thread touches them (the contract).
        let (qs, d, sum, sum_lo, dsum) = unsafe {
            (std::slice::from_raw_parts_mut(self.qs.add(first * k), rows * k),
             std::slice::from_raw_parts_mut(self.d.add(at), rows * self.blocks),
             std::slice::from_raw_parts_mut(self.sum.add(at), rows * self.blocks),
             std::slice::from_raw_parts_mut(self.sum_lo.add(at), rows * self.blocks),
             std::slice::from_raw_parts_mut(self.dsum.add(at), rows * self.blocks))
        };
        #[cfg(target_arch = "x86_64")]
        let avx2 = is_x86_feature_detected!("avx2"); // once per call, not per block
        let blocks = self.blocks;
        for (i, (src, dst)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
            #[cfg(target_arch = "x86_64")]
            let block = if avx2 {
                // SAFETY: AVX2 was just detected; `src` and `dst` hold one block (32 values) each.
                unsafe { avx2::block(src, dst) }
            } else {
                block(src, dst)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let block = block(src, dst);
            let (scale, s) = block.map_err(|c| (first + i / blocks, (i % blocks) * QK + c))?;
            d[i] = scale;
            sum[i] = s;
            sum_lo[i] = dst[..QK / 2].iter().map(|&q| q as i32).sum();
            dsum[i] = scale * s as f32;
        }
        Ok(())
    }
}

/// One block: its int8 values into `dst`, and `(d, sum)`; `Err(col)` at the first non-finite value.
fn block(src: &[f32], dst: &mut [i8]) -> Result<(f32, i32), usize> {
    let mut amax = 0f32;
    for (c, &v) in src.iter().enumerate() {
        if !v.is_finite() {
            return Err(c);
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
    Ok((d, sum))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::QK;

    /// `super::block` on eight values at a time.
    ///
    /// # Safety
    /// The CPU runs AVX2; `src.len() >= 32` and `dst.len() >= 32`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn block(src: &[f32], dst: &mut [i8]) -> Result<(f32, i32), usize> {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let inf = _mm256_set1_ps(f32::INFINITY);
        let mut v = [_mm256_setzero_ps(); QK / 8];
        let mut amax = _mm256_setzero_ps();
        let mut finite = -1i32;
        for (j, v) in v.iter_mut().enumerate() {
            // SAFETY: 8j + 8 <= 32 <= src.len().
            *v = unsafe { _mm256_loadu_ps(src.as_ptr().add(8 * j)) };
            let a = _mm256_and_ps(*v, abs_mask);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, inf)) | !0xff;
            amax = _mm256_max_ps(amax, a);
        }
        if finite & 0xff != 0xff {
            return Err(src.iter().position(|v| !v.is_finite()).expect("a lane was not finite"));
        }
        // the maximum is exact in any order
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), amax) };
        let amax = lanes.iter().fold(0f32, |m, &x| m.max(x));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let (half, lim) = (_mm256_set1_ps(0.5), _mm256_set1_epi32(127));
        let mut sum = _mm256_setzero_si256();
        let mut q = [0i32; QK];
        for (j, &v) in v.iter().enumerate() {
            // round_half_away: truncate (exact), then the dropped fraction (exact) against 1/2
            let x = _mm256_mul_ps(v, id);
            let t = _mm256_cvttps_epi32(x);
            let frac = _mm256_sub_ps(x, _mm256_cvtepi32_ps(t));
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half)); // -1 where rounding up
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, _mm256_set1_ps(-0.5)));
            let r = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
            let r = _mm256_max_epi32(_mm256_min_epi32(r, lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
            sum = _mm256_add_epi32(sum, r);
            // SAFETY: 8j + 8 <= 32 = q.len().
            unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(8 * j) as *mut __m256i, r) };
        }
        for (d, &q) in dst.iter_mut().zip(&q) {
            *d = q as i8;
        }
        let mut s = [0i32; 8];
        // SAFETY: `s` holds 8 i32.
        unsafe { _mm256_storeu_si256(s.as_mut_ptr() as *mut __m256i, sum) };
        Ok((d, s.iter().sum()))
    }
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
    use super::{block, round_half_away};

    /// The AVX2 blocks equal the scalar ones bit for bit: random blocks over many magnitudes, values
    /// exactly on the rounding edges (`k + 1/2` times the scale), zeros, and the non-finite ones.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_blocks_equal_the_scalar_ones() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for case in 0..20_000 {
            let scale = 10f32.powi((case % 13) as i32 - 6);
            let mut src: Vec<f32> = (0..32).map(|_| ((next() % 20001) as f32 / 10000.0 - 1.0) * scale).collect();
            match case % 5 {
                0 => src[(case / 5) % 32] = 127.0 * scale, // amax = 127 * scale: the others land on halves
                1 => src.iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 15.5) * scale),
                2 => src.iter_mut().for_each(|v| *v = 0.0),
                _ => {}
            }
            if case % 997 == 3 {
                src[(case / 7) % 32] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][case % 3];
            }
            let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
            // SAFETY: AVX2 was detected; both are one block long.
            let fast = unsafe { super::avx2::block(&src, &mut a) };
            let slow = block(&src, &mut b);
            assert_eq!(fast.map(|(d, s)| (d.to_bits(), s)), slow.map(|(d, s)| (d.to_bits(), s)), "case {case}");
            if slow.is_ok() {
                assert_eq!(a, b, "case {case}: {src:?}");
            }
        }
    }

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
