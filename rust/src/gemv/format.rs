//! The GGUF block formats this module reads, and the exact f16 -> f32 conversion of their scales.
//!
//! GGUF / ggml layouts, little endian. Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 store 32 weights per block:
//! - Q4_0: f16 `d`, 16 bytes of nibbles; weight = (q - 8) * d.
//! - Q4_1: f16 `d`, f16 `m`, 16 bytes of nibbles; weight = q * d + m.
//! - Q8_0: f16 `d`, 32 int8; weight = q * d.
//! - Q5_0: f16 `d`, `qh[4]` (a little-endian u32), 16 bytes of nibbles; weight = (q - 16) * d.
//! - Q5_1: f16 `d`, f16 `m`, `qh[4]`, 16 bytes of nibbles; weight = q * d + m.
//!
//! In Q4 blocks byte `t` holds element `t` in its low nibble and element `t + 16` in its high one.
//! Q5 blocks hold the same nibbles, and bit `e` of `qh` is the fifth bit of element `e`'s code q
//! (0..31, [`q5_code`]).
//!
//! Q6_K stores super-blocks of 256 weights in 210 bytes: `ql[128]` (low 4 bits), `qh[64]` (high
//! 2 bits), `scales[16]` (int8, one per 16 weights), f16 `d`; weight `e` = d * scales[e / 16] *
//! (q_e - 32), q_e in 0..63 (see [`q6_k_quant`] for where its bits lie). The kernels still work
//! in blocks of 32 weights: block `b` of a row is the 16-weight groups `2 (b mod 8)` and `2 (b mod
//! 8) + 1` of its super-block `b / 8`, with that super-block's `d`.
//!
//! Q4_K stores super-blocks of 256 weights in 144 bytes: f16 `d`, f16 `dmin`, `scales[12]` (the
//! 6-bit scale `sc_s` and minimum `m_s` of its 8 sub-blocks of 32, packed: [`q4_k_scale_min`]),
//! `qs[128]` (4-bit codes); weight `32 s + l` = d * sc_s * q - dmin * m_s, q in 0..15, where byte
//! `32 c + l` of `qs` holds sub-block `2c`'s element `l` in its low nibble and sub-block `2c + 1`'s
//! in its high one. Sub-block `s` of super-block `t` is the activations' block `8 t + s`. Unlike the
//! other formats, the kernels read Q4_K a super-block at a time ([`Format::kernel_block_weights`]):
//! `d` and `dmin` once per 256 weights, not repeated per 32.
//!
//! Q5_K stores super-blocks of 256 weights in 176 bytes: f16 `d`, f16 `dmin`, `scales[12]` (packed
//! as Q4_K's), `qh[32]`, `qs[128]`; weight `32 s + l` = d * sc_s * q - dmin * m_s with the 5-bit
//! code q in 0..31: its low 4 bits are Q4_K's nibble of `qs`, its fifth is bit `s` of `qh[l]`
//! ([`q5_k_code`]). The kernels read it a super-block at a time, as Q4_K.
//!
//! Q3_K stores super-blocks of 256 weights in 110 bytes: `hmask[32]`, `qs[64]`, `scales[12]` (16
//! six-bit scales, one per 16 weights, packed: [`q3_k_scale`]), f16 `d`; weight `e` = d * (`sc_{e /
//! 16}` - 32) * q_e with q_e = low2 - (high bit set ? 0 : 4), in -4..3 ([`q3_k_code`] gives `q_e + 4`,
//! 0..7, and says where its bits lie). The kernels read it a super-block at a time, as Q4_K, and compute
//! each block of 32 weights (two groups of 16, Q6_K's way) with the super-block's `d`.
//!
//! IQ4_NL and IQ4_XS (llama.cpp's non-linear 4-bit types) map each 4-bit code `c` to the int8
//! value [`IQ4NL_VALUES`]`[c]` (-127..113, spaced closer near 0):
//! - IQ4_NL stores blocks of 32 weights in 18 bytes: f16 `d`, `qs[16]` (Q4's nibbles: byte `t`
//!   holds element `t` low, `t + 16` high); weight = d * values[c].
//! - IQ4_XS stores super-blocks of 256 weights in 136 bytes: f16 `d`, u16 `scales_h`, `scales_l[4]`,
//!   `qs[128]`; sub-block `s` (0..8, weights `32 s ..`) has the 6-bit scale `ls` = nibble `s % 2` of
//!   `scales_l[s / 2]` over bits `2s, 2s + 1` of `scales_h` ([`iq4_xs_scale`] gives `ls - 32`,
//!   -32..31), and its 32 codes in `qs[16 s .. 16 s + 16]` as IQ4_NL's block holds them; weight =
//!   d * (ls - 32) * values[c]. The kernels read it a super-block at a time, as Q4_K.

/// Weights (and activations) per block.
pub const QK: usize = 32;

/// Weights per Q6_K super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// Bytes of a GGUF Q6_K super-block: `ql[128]`, `qh[64]`, `scales[16]`, f16 `d`.
pub const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

/// Bytes of a GGUF Q3_K super-block: `hmask[32]`, `qs[64]`, `scales[12]`, f16 `d`.
pub const Q3_K_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;

/// Bytes of a GGUF Q4_K super-block: f16 `d`, f16 `dmin`, `scales[12]`, `qs[128]`.
pub const Q4_K_BYTES: usize = 2 + 2 + 12 + QK_K / 2;

/// Bytes of a GGUF Q5_K super-block: f16 `d`, f16 `dmin`, `scales[12]`, `qh[32]`, `qs[128]`.
pub const Q5_K_BYTES: usize = 2 + 2 + 12 + QK_K / 8 + QK_K / 2;

/// Bytes of a GGUF IQ4_XS super-block: f16 `d`, u16 `scales_h`, `scales_l[4]`, `qs[128]`.
pub const IQ4_XS_BYTES: usize = 2 + 2 + QK_K / 64 + QK_K / 2;

/// ggml's `kvalues_iq4nl`: the int8 value of each 4-bit IQ4_NL / IQ4_XS code.
pub const IQ4NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// Q4_K's (and Q5_K's, IQ4_XS's) sub-blocks of 32 weights per super-block (each with its own scale and
/// minimum; IQ4_XS's without a minimum).
pub const Q4_K_SUBS: usize = QK_K / QK;

/// A GGUF block format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
    /// A k-quant: super-blocks of 256 weights, 6 bits each, an int8 scale per 16 (see the module docs).
    Q6K,
    /// A k-quant: super-blocks of 256 weights, 4 bits each, a 6-bit scale and minimum per 32, one
    /// f16 `d` and `dmin` per super-block (see the module docs).
    Q4K,
    /// A k-quant: Q4_K with a fifth bit a weight (codes 0..31; see the module docs).
    Q5K,
    /// Q4_0 with a fifth bit a weight (codes 0..31 minus 16; see the module docs).
    Q5_0,
    /// Q4_1 with a fifth bit a weight (codes 0..31; see the module docs).
    Q5_1,
    /// Blocks of 32 4-bit codes, each an index into the non-linear int8 table [`IQ4NL_VALUES`], and
    /// an f16 `d` (see the module docs).
    IQ4NL,
    /// IQ4_NL's codes in super-blocks of 256: one f16 `d`, a 6-bit scale per sub-block of 32 (see
    /// the module docs).
    IQ4XS,
    /// A k-quant: super-blocks of 256 weights, 3 bits each (-4..3), a 6-bit scale per 16, one f16
    /// `d` (see the module docs).
    Q3K,
}

impl Format {
    /// Parses `"q4_0"`, `"Q4_1"`, ... (case-insensitive).
    pub fn parse(name: &str) -> Option<Format> {
        match name.to_ascii_lowercase().as_str() {
            "q4_0" => Some(Format::Q4_0),
            "q4_1" => Some(Format::Q4_1),
            "q8_0" => Some(Format::Q8_0),
            "q6_k" => Some(Format::Q6K),
            "q4_k" => Some(Format::Q4K),
            "q5_k" => Some(Format::Q5K),
            "q5_0" => Some(Format::Q5_0),
            "q5_1" => Some(Format::Q5_1),
            "iq4_nl" => Some(Format::IQ4NL),
            "iq4_xs" => Some(Format::IQ4XS),
            "q3_k" => Some(Format::Q3K),
            _ => None,
        }
    }

    /// The lower-case name, as `parse` accepts it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Q4_0 => "q4_0",
            Format::Q4_1 => "q4_1",
            Format::Q8_0 => "q8_0",
            Format::Q6K => "q6_k",
            Format::Q4K => "q4_k",
            Format::Q5K => "q5_k",
            Format::Q5_0 => "q5_0",
            Format::Q5_1 => "q5_1",
            Format::IQ4NL => "iq4_nl",
            Format::IQ4XS => "iq4_xs",
            Format::Q3K => "q3_k",
        }
    }

    /// Weights of one row's block as the kernels read it ([`super::pack`]): 32, or Q4_K's, Q5_K's,
    /// IQ4_XS's and Q3_K's super-block of 256 (its `d` (and `dmin`) stored once, its sub-blocks' scales
    /// beside them).
    pub fn kernel_block_weights(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q6K | Format::Q5_0 | Format::Q5_1 => QK,
            Format::IQ4NL => QK,
            Format::Q4K | Format::Q5K | Format::IQ4XS | Format::Q3K => QK_K,
        }
    }

    /// Bytes of one row's block of [`Format::kernel_block_weights`] weights as the kernels read it
    /// ([`super::pack`]): the GGUF block's for Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1; for Q6_K 28 (`d`, two group
    /// scales, 24 bytes of 6-bit quants), more than its GGUF super-block's 210 / 8 = 26.25 (the
    /// repeated `d`); for Q4_K 148 a super-block (`d`, `dmin`, 8 scales and 8 minima a byte each,
    /// 128 bytes of codes), more than its GGUF 144 (the unpacked 6-bit scales); for Q5_K 180 (Q4_K's
    /// header, 160 bytes of 5-bit codes), more than its GGUF 176 (the same 4 bytes); for IQ4_XS 138
    /// (`d`, 8 signed scale bytes `ls - 32`, 128 bytes of codes), more than its GGUF 136 (the 6-bit
    /// scales a byte each). IQ4_NL's is its GGUF block's 18. Q3_K's is 114 (`d`, 16 signed scale bytes
    /// `sc - 32`, 96 bytes of 3-bit codes), more than its GGUF 110 (the 6-bit scales a byte each).
    pub fn block_bytes(self) -> usize {
        self.header_bytes() + self.quant_bytes()
    }

    /// Bytes of one row's block before its quants: f16 `d`, then Q4_1's (Q5_1's) f16 `m`, Q6_K's two
    /// int8 group scales, Q4_K's (Q5_K's) f16 `dmin` and its sub-blocks' 8 scales and 8 minima,
    /// IQ4_XS's 8 signed sub-block scales, or Q3_K's 16 signed group scales.
    pub fn header_bytes(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q8_0 | Format::Q5_0 | Format::IQ4NL => 2,
            Format::Q4_1 | Format::Q6K | Format::Q5_1 => 4,
            Format::Q4K | Format::Q5K => 4 + 2 * Q4_K_SUBS,
            Format::IQ4XS => 2 + Q4_K_SUBS,
            Format::Q3K => 2 + QK_K / 16,
        }
    }

    /// Bytes of quantized values in one row's block (without scales; Q6_K's 6 bits as packed;
    /// Q4_K's and IQ4_XS's 256 codes; Q5_K's 256 codes of 5 bits; Q5_0's and Q5_1's `qh` and nibbles,
    /// 5 bits a weight; Q3_K's 256 codes of 3 bits).
    pub fn quant_bytes(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 | Format::IQ4NL => QK / 2,
            Format::Q8_0 => QK,
            Format::Q6K => QK * 6 / 8,
            Format::Q4K | Format::IQ4XS => QK_K / 2,
            Format::Q5K => QK_K * 5 / 8,
            Format::Q5_0 | Format::Q5_1 => QK * 5 / 8,
            Format::Q3K => QK_K * 3 / 8,
        }
    }

    /// Weights per GGUF block: 32, or a k-quant's super-block of 256. A row's columns are a multiple of it.
    pub fn gguf_block_weights(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => QK,
            Format::Q6K | Format::Q4K | Format::Q5K | Format::IQ4XS | Format::Q3K => QK_K,
        }
    }

    /// Bytes of one GGUF block of [`Format::gguf_block_weights`] weights (the file's bytes).
    pub fn gguf_block_bytes(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => {
                self.block_bytes()
            }
            Format::Q6K => Q6_K_BYTES,
            Format::Q4K => Q4_K_BYTES,
            Format::Q5K => Q5_K_BYTES,
            Format::IQ4XS => IQ4_XS_BYTES,
            Format::Q3K => Q3_K_BYTES,
        }
    }

    /// Whether a 32-weight block carries the f16 minimum `m` beside the scale `d` (Q4_1, Q5_1; Q4_K's
    /// and Q5_K's minima are 6-bit, per sub-block of their super-block, with one `dmin`: see the module docs).
    pub fn has_min(self) -> bool {
        matches!(self, Format::Q4_1 | Format::Q5_1)
    }
}

/// Weight `e` (0..255)'s 6-bit quant `q_e` (0..63) in a GGUF Q6_K super-block `sb` (210 bytes), as
/// ggml's `dequantize_row_q6_K` reads it: in half `e / 128`, position `l = e % 32` of quarter
/// `(e % 128) / 32`, the low 4 bits are a nibble of `ql[64 half + l + 32 (quarter & 1)]` (the high
/// nibble for quarters 2 and 3), the high 2 bits are bits `2 quarter ..` of `qh[32 half + l]`.
pub fn q6_k_quant(sb: &[u8], e: usize) -> u8 {
    let (half, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = (sb[64 * half + l + 32 * (quarter & 1)] >> (4 * (quarter >> 1))) & 0x0f;
    let qh = (sb[QK_K / 2 + 32 * half + l] >> (2 * quarter)) & 3;
    ql | (qh << 4)
}

/// Sub-block `j` (0..8)'s 6-bit scale and minimum `(sc, m)` in a Q4_K super-block's `scales[12]`
/// `q`, as ggml's `get_scale_min_k4` reads them: for `j < 4` the low 6 bits of `q[j]` and `q[j +
/// 4]`; above, the nibbles of `q[j + 4]` with the top 2 bits of `q[j - 4]` (scale) and `q[j]` (minimum).
pub fn q4_k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Element `l` (0..32) of sub-block `s` (0..8)'s 4-bit code in a Q4_K super-block's `qs[128]`:
/// the low nibble of `qs[32 (s / 2) + l]` for even `s`, the high one for odd.
pub fn q4_k_code(qs: &[u8], s: usize, l: usize) -> u8 {
    (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f
}

/// Element `l` (0..32) of sub-block `s` (0..8)'s 5-bit code (0..31) in a Q5_K super-block, as ggml's
/// `dequantize_row_q5_K` reads it: the low 4 bits are Q4_K's ([`q4_k_code`] of `qs[128]`), the fifth
/// is bit `s` of `qh[l]` (`qh[32]`).
pub fn q5_k_code(qh: &[u8], qs: &[u8], s: usize, l: usize) -> u8 {
    q4_k_code(qs, s, l) | (((qh[l] >> s) & 1) << 4)
}

/// Element `e` (0..32)'s 5-bit code (0..31) in a Q5_0 / Q5_1 block's `qh` (as a little-endian u32)
/// and `qs[16]`, as ggml's `dequantize_row_q5_0` reads it: the Q4 nibble (`qs[e]`'s low one for `e <
/// 16`, `qs[e - 16]`'s high one above) and bit `e` of `qh` as its fifth.
pub fn q5_code(qh: u32, qs: &[u8], e: usize) -> u8 {
    let nibble = if e < 16 { qs[e] & 0x0f } else { qs[e - 16] >> 4 };
    nibble | ((((qh >> e) & 1) as u8) << 4)
}

/// Sub-block `s` (0..8)'s scale `ls - 32` (-32..31) in an IQ4_XS super-block's `scales_h` and
/// `scales_l[4]`, as ggml's `dequantize_row_iq4_xs` reads it: `ls` = nibble `s % 2` of
/// `scales_l[s / 2]` (low 4 bits) over bits `2s, 2s + 1` of `scales_h` (high 2 bits).
pub fn iq4_xs_scale(scales_h: u16, scales_l: &[u8], s: usize) -> i8 {
    let ls = ((scales_l[s / 2] >> (4 * (s % 2))) & 0x0f) | ((((scales_h >> (2 * s)) & 3) as u8) << 4);
    ls as i8 - 32
}

/// Group `g` (0..16, weights `16 g ..`)'s scale `sc_g - 32` (-32..31) in a Q3_K super-block's
/// `scales[12]` `q`, as ggml's `dequantize_row_q3_K` unpacks them (its `kmask1` / `kmask2` steps):
/// the low 4 bits are nibble `g / 8` of `q[g % 8]`, the high 2 bits are bits `2 (g / 4) ..` of
/// `q[8 + g % 4]`.
pub fn q3_k_scale(q: &[u8], g: usize) -> i8 {
    let sc = ((q[g % 8] >> (4 * (g / 8))) & 0x0f) | (((q[8 + g % 4] >> (2 * (g / 4))) & 3) << 4);
    sc as i8 - 32
}

/// Weight `e` (0..255)'s 3-bit code `q_e + 4` (0..7) in a GGUF Q3_K super-block `sb` (110 bytes), as
/// ggml's `dequantize_row_q3_K` reads it: in half `e / 128`, position `l = e % 32` of quarter `k =
/// (e % 128) / 32`, the low 2 bits are bits `2k ..` of `qs[32 half + l]` and the high bit is bit `4
/// half + k` of `hmask[l]`; q = low2 - 4 where that bit is clear, so the code is low2 + 4 * bit.
pub fn q3_k_code(sb: &[u8], e: usize) -> u8 {
    let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let low2 = (sb[QK_K / 8 + 32 * half + l] >> (2 * k)) & 3;
    let high = (sb[l] >> (4 * half + k)) & 1;
    low2 | (high << 2)
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
        assert_eq!(Format::parse("q2_k"), None);
        assert_eq!(Format::parse("Q5_0"), Some(Format::Q5_0));
        let q5_0 = Format::Q5_0;
        assert_eq!((q5_0.name(), q5_0.block_bytes(), q5_0.gguf_block_bytes(), q5_0.header_bytes()), ("q5_0", 22, 22, 2));
        assert_eq!((q5_0.kernel_block_weights(), q5_0.gguf_block_weights(), q5_0.has_min()), (32, 32, false));
        let q5_1 = Format::parse("Q5_1").unwrap();
        assert_eq!((q5_1.name(), q5_1.block_bytes(), q5_1.gguf_block_bytes()), ("q5_1", 24, 24));
        assert_eq!(q5_1.header_bytes(), 4);
        assert_eq!((q5_1.kernel_block_weights(), q5_1.gguf_block_weights(), q5_1.has_min()), (32, 32, true));
        assert_eq!(Format::parse("Q6_K"), Some(Format::Q6K));
        assert_eq!(Format::Q6K.name(), "q6_k");
        assert_eq!((Format::Q6K.block_bytes(), Format::Q6K.gguf_block_bytes(), Q6_K_BYTES), (28, 210, 210));
        assert_eq!(Format::Q4_1.gguf_block_bytes(), 20);
        assert_eq!(Format::parse("Q4_K"), Some(Format::Q4K));
        assert_eq!(Format::Q4K.name(), "q4_k");
        assert_eq!((Format::Q4K.block_bytes(), Format::Q4K.gguf_block_bytes(), Q4_K_BYTES), (148, 144, 144));
        assert_eq!((Format::Q4K.kernel_block_weights(), Format::Q6K.kernel_block_weights()), (256, 32));
        assert_eq!(Format::parse("Q5_K"), Some(Format::Q5K));
        assert_eq!(Format::Q5K.name(), "q5_k");
        assert_eq!((Format::Q5K.block_bytes(), Format::Q5K.gguf_block_bytes(), Q5_K_BYTES), (180, 176, 176));
        assert_eq!((Format::Q5K.kernel_block_weights(), Format::Q5K.gguf_block_weights(), Format::Q5K.has_min()),
                   (256, 256, false));
        let nl = Format::parse("IQ4_NL").unwrap();
        assert_eq!((nl, nl.name(), nl.block_bytes(), nl.gguf_block_bytes(), nl.header_bytes(), nl.quant_bytes()),
                   (Format::IQ4NL, "iq4_nl", 18, 18, 2, 16));
        assert_eq!((nl.kernel_block_weights(), nl.gguf_block_weights(), nl.has_min()), (32, 32, false));
        let xs = Format::parse("iq4_xs").unwrap();
        assert_eq!((xs, xs.name(), xs.block_bytes(), xs.gguf_block_bytes(), xs.header_bytes(), xs.quant_bytes()),
                   (Format::IQ4XS, "iq4_xs", 138, 136, 10, 128));
        assert_eq!((xs.kernel_block_weights(), xs.gguf_block_weights(), xs.has_min(), IQ4_XS_BYTES),
                   (256, 256, false, 136));
        assert_eq!(Format::parse("iq4_x"), None);
        let q3 = Format::parse("Q3_K").unwrap();
        assert_eq!((q3, q3.name(), q3.block_bytes(), q3.gguf_block_bytes(), q3.header_bytes(), q3.quant_bytes()),
                   (Format::Q3K, "q3_k", 114, 110, 18, 96));
        assert_eq!((q3.kernel_block_weights(), q3.gguf_block_weights(), q3.has_min(), Q3_K_BYTES), (256, 256, false, 110));
    }

    #[test]
    fn q3_k_scales_unpack_as_ggml() {
        // ggml's steps on the 12 bytes as three little-endian u32 (aux[0..3]), read back as 16 bytes
        let ggml = |q: &[u8; 12]| -> [i8; 16] {
            let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
            let mut aux = [0u32; 4];
            for (k, a) in aux.iter_mut().take(3).enumerate() {
                *a = u32::from_le_bytes([q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]]);
            }
            let tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
            aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
            aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
            aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
            std::array::from_fn(|g| (aux[g / 4] >> (8 * (g % 4))) as u8 as i8 - 32)
        };
        let mut x = 0x2545_f491u32;
        for round in 0..2000 {
            let q: [u8; 12] = std::array::from_fn(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if round == 0 { 0xff } else if round == 1 { 0 } else { (x >> (i % 8)) as u8 }
            });
            let want = ggml(&q);
            for (g, &want) in want.iter().enumerate() {
                assert_eq!(q3_k_scale(&q, g), want, "round {round} group {g}");
            }
        }
    }

    #[test]
    fn iq4_xs_scales_unpack_as_ggml() {
        // every 6-bit ls in every position: low nibble in scales_l[s / 2], high pair in scales_h
        for ls in 0..64u16 {
            for s in 0..8 {
                let mut l = [0u8; 4];
                l[s / 2] = ((ls & 0x0f) as u8) << (4 * (s % 2));
                let h = (ls >> 4) << (2 * s);
                assert_eq!(iq4_xs_scale(h, &l, s), ls as i8 - 32, "ls {ls} sub-block {s}");
                // the neighbours read 0 (ls 0: -32)
                assert_eq!(iq4_xs_scale(h, &l, s ^ 1), -32);
            }
        }
    }

    #[test]
    fn q4_k_scales_unpack_as_ggml() {
        // scales[0..4] = sc_0..3 | top bits of sc_4..7, [4..8] = m_0..3 | top bits of m_4..7,
        // [8..12] = low nibbles sc_4..7, high nibbles m_4..7
        let (sc, m): ([u8; 8], [u8; 8]) = ([0, 63, 1, 62, 63, 0, 17, 42], [63, 0, 5, 33, 1, 63, 48, 15]);
        let mut q = [0u8; 12];
        for j in 0..4 {
            q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            q[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
        }
        for j in 0..8 {
            assert_eq!(q4_k_scale_min(j, &q), (sc[j], m[j]), "sub-block {j}");
        }
    }
}
