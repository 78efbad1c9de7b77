//! The fp8 KV cache's codes (`kv_cache_dtype="fp8_e4m3"` / `"fp8_e5m2"`) for the fused decode:
//! what the stack writes for each new K/V value and what attention widens the pages to.
//!
//! Why here: an engine with an fp8 cache took the torch ops on the CPU (a few hundred small ops a
//! layer) because the fused decode read only float32 pages; and a page a quarter the size is the
//! lever on a host that reads K/V from DRAM. The rule is the torch backend's
//! (`pagedrs.attention.kv_quant`), bit for bit, so a page one path wrote reads right in the other:
//!
//! - write: `x / scale` in f32, saturated to the format's largest finite value (448 / 57344),
//!   rounded to nearest even; NaN stays NaN (`0x7f` with its sign), as torch's conversion gives;
//! - read: the code's exact value (every e4m3 / e5m2 value is a binary16 value) times `scale`
//!   in f32 (one rounding; none for the unit scales the engine uses).
//!
//! Reading goes through binary16: an e5m2 code is the top byte of its binary16; an e4m3 code
//! `s eeee mmm` is the binary16 `s 0eeee mmm0000000` times 2^8 (the biases differ by 8, and
//! subnormals line up too), which F16C widens 8 at a time on AVX2 hosts.

use crate::gemv::format::f16_to_f32;

/// The two 8-bit float formats (OCP FP8: E4M3 without infinities, E5M2 with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8 {
    E4m3,
    E5m2,
}

impl Fp8 {
    /// The format of a `kv_cache_dtype` name, None if it is not fp8.
    pub fn parse(name: &str) -> Option<Fp8> {
        match name {
            "fp8_e4m3" => Some(Fp8::E4m3),
            "fp8_e5m2" => Some(Fp8::E5m2),
            _ => None,
        }
    }

    /// The largest finite value, where a write saturates.
    pub fn max(self) -> f32 {
        match self {
            Fp8::E4m3 => 448.0,
            Fp8::E5m2 => 57344.0,
        }
    }

    /// (exponent bias, mantissa bits) of the format.
    fn layout(self) -> (i32, u32) {
        match self {
            Fp8::E4m3 => (7, 3),
            Fp8::E5m2 => (15, 2),
        }
    }

    /// The code of `x` (already divided by the scale): saturated, rounded to nearest even.
    pub fn encode(self, x: f32) -> u8 {
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        if x.is_nan() {
            return sign | 0x7f;
        }
        let a = x.abs().min(self.max());
        let (bias, mbits) = self.layout();
        let min_normal = f32::from_bits(((1 - bias + 127) as u32) << 23);
        if a < min_normal {
            // zero or subnormal: a multiple of 2^(1 - bias - mbits); a count of 2^mbits is the
            // smallest normal, whose code is that same count
            let step = f32::from_bits(((1 - bias - mbits as i32 + 127) as u32) << 23);
            return sign | (a / step).round_ties_even() as u8;
        }
        let bits = a.to_bits();
        let exponent = (bits >> 23) as i32 - 127 + bias;
        let drop = 23 - mbits;
        let mut code = ((exponent as u32) << mbits) | ((bits & 0x7f_ffff) >> drop);
        let rest = bits & ((1 << drop) - 1);
        let half = 1 << (drop - 1);
        if rest > half || (rest == half && code & 1 == 1) {
            code += 1; // a carry into the exponent is the next binade; saturation keeps it finite
        }
        sign | code as u8
    }

    /// The exact value of `code` (NaN codes give NaN; E5M2's infinities, infinity).
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Fp8::E5m2 => f16_to_f32((code as u16) << 8),
            Fp8::E4m3 if code & 0x7f == 0x7f => f32::NAN.copysign(if code & 0x80 != 0 { -1.0 } else { 1.0 }),
            Fp8::E4m3 => f16_to_f32(((code as u16 & 0x80) << 8) | ((code as u16 & 0x7f) << 7)) * 256.0,
        }
    }
}

/// `out[i] = decode(codes[i]) * scale`, the same bits on every build.
pub fn widen(format: Fp8, codes: &[u8], scale: f32, out: &mut [f32]) {
    widen_rows(format, codes, &[0], codes.len().min(out.len()), scale, out)
}

/// Row `t` of `out` (`d` floats at `t * d`) = the `d` codes at `codes[starts[t]..]` widened:
/// one call for all the keys a unit of attention reads (a call a key cost more than the
/// conversion). Panics if a row lies outside `codes` or `out` is shorter than `starts.len() * d`.
pub fn widen_rows(format: Fp8, codes: &[u8], starts: &[usize], d: usize, scale: f32, out: &mut [f32]) {
    assert!(out.len() >= starts.len() * d, "widen_rows: {} floats for {} rows of {d}", out.len(), starts.len());
    for &s in starts {
        assert!(s + d <= codes.len(), "widen_rows: a row at {s} of {d} codes past {}", codes.len());
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU runs AVX2 and F16C (checked just above); every row lies inside `codes`
        // and `out` holds them all (asserted above).
        unsafe { widen_rows_avx2(format, codes, starts, d, scale, out) };
        return;
    }
    widen_rows_portable(format, codes, starts, d, scale, out)
}

fn widen_rows_portable(format: Fp8, codes: &[u8], starts: &[usize], d: usize, scale: f32, out: &mut [f32]) {
    for (&s, o) in starts.iter().zip(out.chunks_exact_mut(d)) {
        for (o, &c) in o.iter_mut().zip(&codes[s..s + d]) {
            *o = format.decode(c) * scale;
        }
    }
}

/// [`widen_rows`] 8 codes at a time: each code to its binary16 bits, F16C to f32, then (E4M3)
/// times 2^8 and NaN where the code is NaN; a row's tail by `decode`.
///
/// # Safety
/// The CPU must run AVX2 and F16C; `starts[t] + d <= codes.len()` for every row and
/// `out.len() >= starts.len() * d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_rows_avx2(format: Fp8, codes: &[u8], starts: &[usize], d: usize, scale: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let vscale = _mm256_set1_ps(scale);
    let (m7f, m80, two8, nan) =
        (_mm_set1_epi16(0x7f), _mm_set1_epi16(0x80), _mm256_set1_ps(256.0), _mm256_set1_ps(f32::NAN));
    for (t, &s) in starts.iter().enumerate() {
        let mut i = 0;
        while i + 8 <= d {
            // SAFETY: s + i + 8 <= s + d <= codes.len() and t * d + i + 8 <= out.len() (the contract).
            unsafe {
                let c = _mm_cvtepu8_epi16(_mm_loadl_epi64(codes.as_ptr().add(s + i) as *const __m128i));
                let v = match format {
                    Fp8::E5m2 => _mm256_cvtph_ps(_mm_slli_epi16(c, 8)),
                    Fp8::E4m3 => {
                        let mag = _mm_and_si128(c, m7f);
                        let h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, m80), 8), _mm_slli_epi16(mag, 7));
                        let v = _mm256_mul_ps(_mm256_cvtph_ps(h), two8);
                        // codes 0x7f / 0xff are NaN (their sign is kept by `decode`; any NaN reads as NaN)
                        let is_nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, m7f));
                        _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(is_nan))
                    }
                };
                _mm256_storeu_ps(out.as_mut_ptr().add(t * d + i), _mm256_mul_ps(v, vscale));
            }
            i += 8;
        }
        for j in i..d {
            out[t * d + j] = format.decode(codes[s + j]) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code of both formats read back by value, by the reference definition.
    #[test]
    fn every_code_decodes_to_its_value() {
        for code in 0..=255u8 {
            let (s, mag) = (if code & 0x80 != 0 { -1.0f64 } else { 1.0 }, code & 0x7f);
            let e4 = match (mag >> 3, mag & 7) {
                (15, 7) => f64::NAN,
                (0, m) => s * m as f64 / 8.0 * 2f64.powi(-6),
                (e, m) => s * (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7),
            };
            let e5 = match (mag >> 2, mag & 3) {
                (31, 0) => s * f64::INFINITY,
                (31, _) => f64::NAN,
                (0, m) => s * m as f64 / 4.0 * 2f64.powi(-14),
                (e, m) => s * (1.0 + m as f64 / 4.0) * 2f64.powi(e as i32 - 15),
            };
            for (format, want) in [(Fp8::E4m3, e4), (Fp8::E5m2, e5)] {
                let got = format.decode(code) as f64;
                assert!(got == want || (got.is_nan() && want.is_nan()), "{format:?} {code:#04x}: {got} vs {want}");
                if want.is_finite() { // (E5M2 infinities saturate to the largest finite code)
                    assert_eq!(format.encode(got as f32), if want == 0.0 { code & 0x80 } else { code }, "{format:?} {code:#04x}");
                }
            }
        }
    }

    /// Encoding is the nearest code (ties to the even one), against a search over every code, on
    /// floats spread over both formats' ranges and past them (saturated), subnormals included.
    #[test]
    fn encoding_is_the_nearest_code_ties_to_even() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for format in [Fp8::E4m3, Fp8::E5m2] {
            let finite: Vec<u8> = (0..=0x7fu8).filter(|&c| format.decode(c).is_finite()).collect();
            for i in 0..20_000 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let exp = (seed % 40) as i32 - 24; // 2^-24 .. 2^15
                let x = f32::from_bits(((exp + 127) as u32) << 23 | (seed >> 40) as u32 & 0x7f_ffff)
                    * if i % 2 == 0 { 1.0 } else { -1.0 };
                let a = (x.abs() as f64).min(format.max() as f64);
                let best = finite.iter().copied().min_by(|&p, &q| {
                    let (dp, dq) = ((format.decode(p) as f64 - a).abs(), (format.decode(q) as f64 - a).abs());
                    dp.partial_cmp(&dq).unwrap().then((p & 1).cmp(&(q & 1)))
                }).unwrap();
                let want = best | if x < 0.0 { 0x80 } else { 0 };
                assert_eq!(format.encode(x), want, "{format:?} {x:e}");
            }
        }
    }

    #[test]
    fn encoding_saturates_and_rounds_ties_to_even() {
        let e4 = Fp8::E4m3;
        assert_eq!(e4.encode(1e9), 0x7e);
        assert_eq!(e4.encode(f32::NEG_INFINITY), 0xfe);
        assert_eq!(e4.encode(f32::NAN), 0x7f);
        assert_eq!(e4.encode(1.0625), 0x38, "1 + 1/16 is a tie between 1 and 1.125: to even (1)");
        assert_eq!(e4.encode(1.1875), 0x3a, "1.125 + 1/16: to even (1.25)");
        assert_eq!(e4.encode(2f32.powi(-10)), 0x00, "half the smallest subnormal: to even (0)");
        assert_eq!(e4.encode(3.0 * 2f32.powi(-10)), 0x02, "1.5 subnormal steps: to even (2)");
        assert_eq!(e4.encode(2f32.powi(-6) - 2f32.powi(-12)), 0x08, "rounds up into the smallest normal");
        assert_eq!(Fp8::E5m2.encode(1e9), 0x7b);
        assert_eq!(Fp8::E5m2.encode(-0.0), 0x80);
    }

    #[test]
    fn widening_is_the_same_bits_on_every_build() {
        let codes: Vec<u8> = (0..=255u8).chain((0..37).map(|i| (i * 53) as u8)).collect();
        for format in [Fp8::E4m3, Fp8::E5m2] {
            for scale in [1.0f32, 0.37] {
                let (mut fast, mut portable) = (vec![0f32; codes.len()], vec![0f32; codes.len()]);
                widen(format, &codes, scale, &mut fast);
                widen_rows_portable(format, &codes, &[0], codes.len(), scale, &mut portable);
                assert!(fast.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
                for (&c, &f) in codes.iter().zip(&fast) {
                    let want = format.decode(c) * scale;
                    assert!(f.to_bits() == want.to_bits() || (f.is_nan() && want.is_nan()), "{format:?} {c:#04x}");
                }
            }
        }
    }
}
