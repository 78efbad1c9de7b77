//! The GGUF block formats this module reads, and the exact f16 -> f32 conversion of their scales.
//!
//! Every format stores 32 weights per block (GGUF / ggml layout, little endian):
//! - Q4_0: f16 `d`, 16 bytes of nibbles; weight = (q - 8) * d.
//! - Q4_1: f16 `d`, f16 `m`, 16 bytes of nibbles; weight = q * d + m.
//! - Q8_0: f16 `d`, 32 int8; weight = q * d.
//!
//! In Q4 blocks byte `t` holds element `t` in its low nibble and element `t + 16` in its high one.

/// Weights (and activations) per block.
pub const QK: usize = 32;

/// A GGUF block format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Format {
    /// Parses `"q4_0"`, `"Q4_1"`, ... (case-insensitive).
    pub fn parse(name: &str) -> Option<Format> {
        match name.to_ascii_lowercase().as_str() {
            "q4_0" => Some(Format::Q4_0),
            "q4_1" => Some(Format::Q4_1),
            "q8_0" => Some(Format::Q8_0),
            _ => None,
        }
    }

    /// The lower-case name, as `parse` accepts it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Q4_0 => "q4_0",
            Format::Q4_1 => "q4_1",
            Format::Q8_0 => "q8_0",
        }
    }

    /// Bytes of one GGUF block of 32 weights.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 2 + QK / 2,
            Format::Q4_1 => 4 + QK / 2,
            Format::Q8_0 => 2 + QK,
        }
    }

    /// Bytes of quantized values in one block (without scales).
    pub fn quant_bytes(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 => QK / 2,
            Format::Q8_0 => QK,
        }
    }

    /// Whether a block carries the minimum `m` beside the scale `d`.
    pub fn has_min(self) -> bool {
        self == Format::Q4_1
    }
}

/// IEEE binary16 -> binary32, exact (every f16 is an f32), the same value `vcvtph2ps` gives.
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits as u32) & 0x8000) << 16;
    let exp = ((bits >> 10) & 0x1f) as u32;
    let mant = (bits & 0x3ff) as u32;
    let out = if exp == 0 {
        if mant == 0 {
            sign
        } else {
            // Subnormal f16: normalize into an f32 exponent.
            let shift = mant.leading_zeros() - 21; // bring bit 10 to the top of the 10-bit field
            let mant = (mant << shift) & 0x3ff;
            let exp = 127 - 15 + 1 - shift;
            sign | (exp << 23) | (mant << 13)
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (mant << 13) // inf / NaN (payload kept, quiet bit as the hardware does)
            | if mant != 0 { 0x0040_0000 } else { 0 }
    } else {
        sign | ((exp + 127 - 15) << 23) | (mant << 13)
    };
    f32::from_bits(out)
}

/// Whether an f16 bit pattern is finite (not NaN, not infinite).
pub fn f16_is_finite(bits: u16) -> bool {
    (bits >> 10) & 0x1f != 0x1f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_known_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert!(f16_to_f32(0x7c00).is_infinite());
        assert!(f16_to_f32(0x7e00).is_nan());
        assert!(!f16_is_finite(0x7c00) && !f16_is_finite(0xfe01) && f16_is_finite(0x7bff));
    }

    #[test]
    fn parse_names() {
        assert_eq!(Format::parse("Q4_1"), Some(Format::Q4_1));
        assert_eq!(Format::parse("q8_0").map(Format::block_bytes), Some(34));
        assert_eq!(Format::parse("q5_0"), None);
    }
}
