//! bfloat16 KV pages (`kv_cache_dtype="bfloat16"`): each value stored as the top 16 bits of its
//! float32, rounded to nearest even, by torch's rule (`c10::BFloat16`'s `round_to_nearest_even`:
//! the torch backend writes the same bits with `tensor.to(torch.bfloat16)`), and read back exactly
//! (a bfloat16 is a float32 with its low 16 bits zero).
//!
//! Why a 16-bit page: on a CPU a decode step's attention streams every page of the context from
//! memory, so half the bytes of float32 pages is up to half its time at long contexts, and the same
//! pool holds twice the tokens. The values keep float32's range and 8 bits of precision (fp8 keeps
//! 3 or 2), so the model's answers change far less than with fp8 pages.

/// The bfloat16 bits of `x`: round to nearest even on the 16 dropped bits (an overflow rounds to
/// infinity, as torch's), a NaN to the quiet NaN 0x7fc0.
#[inline(always)]
pub fn encode(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let bits = x.to_bits();
    let rounding_bias = ((bits >> 16) & 1) + 0x7fff;
    (bits.wrapping_add(rounding_bias) >> 16) as u16
}

/// The float32 a bfloat16 code stands for (exact).
#[inline(always)]
pub fn decode(code: u16) -> f32 {
    f32::from_bits((code as u32) << 16)
}

/// Row `t` of `out` (`d` floats at `t * d`) = the `d` codes at `codes[starts[t]..]` widened (a
/// shift: the compiler vectorizes it). Panics if a row lies outside `codes` or `out` is shorter
/// than `starts.len() * d`.
pub fn widen_rows(codes: &[u16], starts: &[usize], d: usize, out: &mut [f32]) {
    assert!(out.len() >= starts.len() * d, "widen_rows: {} floats for {} rows of {d}", out.len(), starts.len());
    for (&s, o) in starts.iter().zip(out.chunks_exact_mut(d)) {
        for (o, &c) in o.iter_mut().zip(&codes[s..s + d]) {
            *o = decode(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round to nearest, ties to an even code, worked out in f64: the two bfloat16 neighbours of
    /// `x` (the one past the largest finite is 2^128, which stores as infinity) and the nearer one.
    fn reference(x: f32) -> u16 {
        if x.is_nan() {
            return 0x7fc0;
        }
        let down = (x.to_bits() >> 16) as u16;
        if x.to_bits() & 0xffff == 0 {
            return down;
        }
        let up = down + 1; // the next code away from zero (same sign)
        let magnitude = |c: u16| if c & 0x7fff == 0x7f80 { 2f64.powi(128) } else { (decode(c) as f64).abs() };
        let (dd, du) = ((x as f64).abs() - magnitude(down), magnitude(up) - (x as f64).abs());
        if dd < du || (dd == du && down % 2 == 0) { down } else { up }
    }

    #[test]
    fn encodes_by_torchs_rule_and_decodes_exactly() {
        // ties both ways, just past a tie, the largest finite (rounds to infinity, as torch's),
        // signed zeros, subnormals, infinities
        let specials = [0.0f32, -0.0, 1.0, -1.0, f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000),
                        f32::from_bits(0x3f80_8001), f32::MAX, f32::MIN, f32::from_bits(0x7f7f_7fff),
                        f32::from_bits(0x7f7f_0000), f32::from_bits(1), f32::from_bits(0x0000_8000),
                        f32::INFINITY, f32::NEG_INFINITY];
        for x in specials {
            assert_eq!(encode(x), reference(x), "{x:e} ({:#010x})", x.to_bits());
        }
        assert_eq!((encode(f32::MAX), encode(f32::MIN)), (0x7f80, 0xff80), "torch rounds the largest float32 to inf");
        assert_eq!((encode(f32::from_bits(0x3f80_8000)), encode(f32::from_bits(0x3f81_8000))), (0x3f80, 0x3f82));
        assert_eq!(encode(f32::NAN), 0x7fc0);
        assert!(decode(encode(f32::NAN)).is_nan());
        let mut state = 0x9e37_79b9u32;
        for _ in 0..100_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let x = f32::from_bits(state);
            if !x.is_nan() {
                assert_eq!(encode(x), reference(x), "{x:e} ({state:#010x})");
                assert_eq!(decode(encode(x)).to_bits() & 0xffff, 0);
            }
        }
        for code in 0..=u16::MAX {
            let x = decode(code);
            if !x.is_nan() {
                assert_eq!(encode(x), code, "a bfloat16 value comes back as its own code");
            }
        }
    }

    #[test]
    fn widens_rows_at_any_start() {
        let codes: Vec<u16> = (0..40u16).map(|i| encode(i as f32 * 0.37 - 3.0)).collect();
        let mut out = vec![f32::NAN; 3 * 5];
        widen_rows(&codes, &[7, 0, 33], 5, &mut out);
        for (t, &s) in [7usize, 0, 33].iter().enumerate() {
            for i in 0..5 {
                assert_eq!(out[t * 5 + i], decode(codes[s + i]));
            }
        }
    }
}
