//! Repacking GGUF blocks once, at load, into row tiles interleaved for the SIMD kernels.
//!
//! Why a tile: the kernels compute 16 output rows at once with one row per 32-bit lane, so a
//! block's integer dot product lands in its lane with no horizontal reduction, and the float
//! sum over blocks runs in block order for every row on every path (bit-identical results).
//!
//! Layout of tile `t` (rows `16t .. 16t + 16`; rows past N are zero, scale 0): for each block
//! `b` of 32 weights in order, `d[16]` (f16 LE), then for Q4_1 `m[16]` (f16) and for Q6_K the
//! group scales `sc[16][2]` (int8: lane `j`'s two bytes are `scales[2 (b mod 8)]` and `scales[2 (b
//! mod 8) + 1]` of its super-block, whose `d` is repeated in each of its 8 blocks), then the quants
//! as 64-byte vectors of 16 lanes x 4 bytes, lane `j` = row `16t + j`:
//! - Q4: vector `v` (0..4), byte `i` (0..4) of lane `j`: low nibble = element `8v + i`,
//!   high nibble = element `8v + 4 + i` of that row's block.
//! - Q8: vector `v` (0..8), byte `i` of lane `j`: element `4v + i`.
//! - Q6_K: per group `g` (0, 1: elements `16g .. 16g + 16`) three vectors `3g + k` (k = 0..3),
//!   byte `i` of lane `j`: bits 0..6 = q of element `16g + 4k + i`, bits 6..8 = bits `2k .. 2k + 2`
//!   of q of element `16g + 12 + i`. So the kernels unpack four vectors of q (0..63; elements
//!   `4u + i`, Q8_0's order) from three: one `and` each for the first three, and the fourth from the
//!   three top bit pairs (three shifts, masks and two `or`s). The Q4 nibble layout plus 2-bit
//!   planes, the same 28 bytes, costs 17 vector ops to unpack four vectors against these 11.
//!
//! The byte count equals the GGUF tensor's (plus the padding rows) for Q4_0, Q4_1 and Q8_0: no
//! dequantization. Q6_K's 28 bytes a row per 32 weights (7 bits a weight) are more than the file's
//! 210 per 256 (6.5625 bits): its `d` is repeated per block of 32, and each block carries its own
//! two scales, so the kernels stay the 32-weight loop of the other formats.
//!
//! Q4_K's tile block is a whole super-block (16 rows x 256 weights, 16 x 148 = 2368 bytes, a
//! multiple of 64): `d[16]` (f16), `dmin[16]` (f16), then `sc[8][16]` and `m[8][16]` (the 6-bit
//! scale and minimum of sub-block `u` of lane `j` at byte `16u + j` of each, unpacked from
//! `scales[12]` to one byte each), then the 8 sub-blocks' codes in order, each as the Q4 nibble
//! layout above (4 vectors of 64 bytes; element `l` of sub-block `u` is weight `32u + l` of the
//! super-block). So a row streams 148 bytes a super-block (4.625 bits a weight) against Q4_1's
//! 160: `d` and `dmin` are stored once per super-block, and the scales take 4 bytes more than the
//! file's 12 so that the kernels read them with one widening load per sub-block and half-tile. The
//! kernels step over super-blocks and, inside, over their 8 sub-blocks (activation blocks `8t ..
//! 8t + 8`), and compute each sub-block as Q4_1's block with `d * sc` and `-(dmin * m)` (both exact
//! in f32) for its scale and minimum.
//!
//! 5-bit codes (Q5_0's and Q5_1's blocks, Q5_K's sub-blocks) take five vectors of 64 bytes a block of 32 (16 lanes x 4
//! bytes, 20 bytes a row, exactly 5 bits a weight); byte `i` of lane `j` of vector `k`:
//! - `k` in 0..4: bits 0..5 = code of element `4k + i`, bits 5..8 = the top 3 bits of the code of
//!   element `16 + 4k + i`;
//! - `k` = 4: bits `2k' .. 2k' + 2` = the low 2 bits of the code of element `16 + 4k' + i`, `k'` in 0..4.
//!
//! So the kernels unpack eight vectors of codes (elements `4k + i` in vector `k`, Q8_0's order)
//! from five: one `and` each for the first four, and for the others two shifts (one for `k'` = 0),
//! two masks and an `or` (23 vector ops a half-tile). The Q4 nibble layout with the fifth bits as a
//! plane of 8 bits a lane byte (one per nibble vector and half) needs a shift, mask and `or` per
//! code vector on top of the nibbles' 12 ops: 35.
//!
//! Q5_0's tile block is Q4_0's with 5-bit codes: `d[16]`, then the codes in the layout above; 22
//! bytes a row per 32 weights, the GGUF block's (5.5 bits a weight, against Q8_0's 8.5, the format
//! Q5_0 tensors were converted to before). Q5_1's is Q4_1's, `d[16]`, `m[16]`, then the codes: 24
//! bytes a row, the GGUF block's (6 bits a weight).
//!
//! IQ4_NL's tile block is Q4_0's: `d[16]`, then the 32 codes (0..15) in the Q4 nibble layout above;
//! 18 bytes a row per 32 weights, the GGUF block's (4.5 bits a weight, against Q8_0's 8.5, the
//! format IQ4_NL tensors were converted to before). The kernels look the codes up in the int8 table
//! ([`super::format::IQ4NL_VALUES`]). Why this nibble layout: any other order of the nibbles costs
//! the AVX2 kernel the same (an `and`, a shift and an `and` a vector for two vectors of codes, then
//! one `pshufb` each), and this one is Q4_0's, whose packer and readers it shares.
//!
//! IQ4_XS's tile block is a super-block, as Q4_K's: `d[16]` (f16), then `sc[8][16]` (sub-block `u`'s
//! scale `ls - 32` of lane `j` at byte `16u + j`, a signed byte, unpacked from `scales_h` and
//! `scales_l`), then the 8 sub-blocks' codes in order, each in IQ4_NL's (Q4's) nibble layout (16 x
//! 138 = 2208 bytes). A row streams 138 bytes a super-block (4.3125 bits a weight) against the file's
//! 136 (4.25) and the 272 of Q8_0 (8.5 bits), the format IQ4_XS tensors were converted to before.
//! The kernels compute each sub-block as IQ4_NL's block with the scale `d * (ls - 32)` (exact in f32).
//! Why a super-block and not blocks of 32 with the scale folded in: `d * (ls - 32)` needs up to 17
//! significant bits, so an exact folded scale is an f32, 20 bytes a row per 32 weights (5 bits a
//! weight); and the AVX2 kernel's integer work is IQ4_NL's either way, while the scale costs it 4
//! ops a half-tile and sub-block for all rows (a load, a widening, a conversion, a multiply by the
//! super-block's `d`, converted once) against 2 (a load and a conversion): a few ops against 28 for
//! the codes and 32 a row.
//!
//! Q5_K's tile block is Q4_K's with 5-bit codes: `d[16]`, `dmin[16]`, `sc[8][16]`, `m[8][16]` at
//! Q4_K's offsets, then the 8 sub-blocks' codes in order, each in the 5-bit layout above (320 bytes
//! a sub-block). A row streams 180 bytes a super-block (5.625 bits a weight), against the 272 of
//! Q8_0 (8.5 bits), the format Q5_K tensors were converted to before.
//!
//! Q3_K's tile block is a super-block, as Q4_K's (16 x 114 = 1824 bytes): `d[16]` (f16), then per
//! block `u` of 32 weights (0..8) the group scales `sc[16][2]` (int8 `sc - 32`: lane `j`'s two bytes
//! are the scales of groups `2u` and `2u + 1`, Q6_K's pair, unpacked from `scales[12]`), then the 8
//! blocks' codes in order, three vectors of 64 bytes each ([`Q3_K_SUB_CODES`], 12 bytes a row, exactly
//! 3 bits a weight). The codes are stored unsigned, `c = q + 4` (0..7); byte `i` of lane `j` of
//! vector `k` (0..3):
//! - bits 0..3 = c of element `4k + i`, bits 3..6 = c of element `12 + 4k + i`;
//! - bits 6..8: vector 0, the low 2 bits of c of element `24 + i`; vector 1, those of element
//!   `28 + i`; vector 2, bit 6 the third bit of element `24 + i`'s and bit 7 of element `28 + i`'s.
//!
//! So the kernels unpack eight vectors of codes (elements `4v + i` in vector `v`, Q8_0's order) from
//! three: an `and` each for the first three, a shift and an `and` each for the next three, and for
//! the last two two shifts, two masks and an `or` each (19 vector ops a block and half-tile, against
//! the Q4 nibbles' 12 for 8 vectors). A 2-bit plane and a 1-bit plane (the GGUF's own split) would
//! cost 37 by count (not built): each of the 8 vectors needs its own shift and mask from both planes
//! and an `or`.
//!
//! Why a super-block and not Q6_K's per-32 block with `d` repeated (16 bytes a row per 32 weights, 128
//! per 256, 4 bits a weight): a row streams 114 bytes a super-block (3.5625 bits a weight), 11% less,
//! and at M = 1 a product is bound by that stream (the file's is 110, 3.4375 bits; the 272 of Q8_0,
//! 8.5 bits, is what Q3_K tensors were converted to before). The kernels still step over blocks of
//! 32 (the activations'), each with its own scale pair and the super-block's `d`.

use super::error::GemvError;
use super::format::{
    f16_is_finite, iq4_xs_scale, q3_k_code, q3_k_scale, q4_k_code, q4_k_scale_min, q5_code, q5_k_code, q6_k_quant,
    Format, Q4_K_SUBS, QK, QK_K,
};
use crate::huge_pages::HugeBuf;

/// Rows per tile (one per 32-bit lane of a 512-bit vector).
pub const TILE: usize = 16;

/// Offsets in a Q4_K (and Q5_K) tile block (a super-block of 16 rows): `dmin[16]` (f16), the scales
/// `sc[8][16]`, the minima `m[8][16]` (bytes), the codes (see the module docs). `d[16]` is at 0.
pub(crate) const Q4_K_DMIN: usize = 2 * TILE;
pub(crate) const Q4_K_SC: usize = 4 * TILE;
pub(crate) const Q4_K_M: usize = Q4_K_SC + Q4_K_SUBS * TILE;
pub(crate) const Q4_K_CODES: usize = Q4_K_M + Q4_K_SUBS * TILE;

/// Offsets in an IQ4_XS tile block (a super-block of 16 rows): the signed sub-block scales
/// `sc[8][16]`, the codes (8 sub-blocks of [`Q4_K_SUB_CODES`] bytes; see the module docs). `d[16]` is at 0.
pub(crate) const IQ4_XS_SC: usize = 2 * TILE;
pub(crate) const IQ4_XS_CODES: usize = IQ4_XS_SC + Q4_K_SUBS * TILE;

/// Bytes of one Q4_K sub-block's codes in a tile (16 rows x 32 nibbles).
pub(crate) const Q4_K_SUB_CODES: usize = TILE * QK / 2;

/// Bytes of one block of 32 5-bit codes in a tile (16 rows x 20 bytes, the layout of the module
/// docs): a Q5_0 or Q5_1 block's, a Q5_K sub-block's.
pub(crate) const Q5_SUB_CODES: usize = TILE * QK * 5 / 8;

/// Offsets in a Q3_K tile block (a super-block of 16 rows): the group scale pairs `sc[8][16][2]`,
/// the codes (8 blocks of [`Q3_K_SUB_CODES`] bytes; see the module docs). `d[16]` is at 0.
pub(crate) const Q3_K_SC: usize = 2 * TILE;
pub(crate) const Q3_K_CODES: usize = Q3_K_SC + Q4_K_SUBS * 2 * TILE;

/// Bytes of one Q3_K block of 32 weights' codes in a tile (16 rows x 12 bytes, 3 vectors of 64).
pub(crate) const Q3_K_SUB_CODES: usize = TILE * QK * 3 / 8;

/// A weight `[rows, cols]` (N x K, y = x W^T) repacked into tiles.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    pub(crate) name: String,
    pub(crate) format: Format,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// The tiles, in 2 MiB pages ([`crate::huge_pages`]): every product streams all of them.
    pub(crate) data: HugeBuf,
}

impl PackedMatrix {
    /// Repacks a GGUF tensor's raw block bytes (row-major, `cols / 32` blocks per row; Q6_K, Q4_K,
    /// Q5_K, IQ4_XS and Q3_K: `cols / 256` super-blocks).
    ///
    /// Checks, naming `name`: `cols` a positive multiple of 32 (Q6_K, Q4_K, Q5_K, IQ4_XS, Q3_K: 256), `rows > 0`, the
    /// exact byte count, and every scale (and minimum) finite. Nothing after this point is checked again.
    pub fn from_gguf(name: &str, raw: &[u8], rows: usize, cols: usize, format: Format) -> Result<Self, GemvError> {
        let bad = |reason| GemvError::BadShape { tensor: name.to_string(), rows, cols, reason };
        if rows == 0 {
            return Err(bad("rows must be > 0"));
        }
        let gw = format.gguf_block_weights();
        if cols == 0 || cols % gw != 0 {
            return Err(bad(match format {
                Format::Q6K => "cols (K) must be a positive multiple of 256 (the q6_k super-block)",
                Format::Q4K => "cols (K) must be a positive multiple of 256 (the q4_k super-block)",
                Format::Q5K => "cols (K) must be a positive multiple of 256 (the q5_k super-block)",
                Format::IQ4XS => "cols (K) must be a positive multiple of 256 (the iq4_xs super-block)",
                Format::Q3K => "cols (K) must be a positive multiple of 256 (the q3_k super-block)",
                Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => {
                    "cols (K) must be a positive multiple of the block size 32"
                }
            }));
        }
        let row_bytes = (cols / gw).checked_mul(format.gguf_block_bytes()).ok_or(bad("too large"))?;
        let expected = rows.checked_mul(row_bytes).ok_or(bad("too large"))?;
        if raw.len() != expected {
            return Err(GemvError::ByteCount {
                tensor: name.to_string(),
                format: format.name(),
                rows,
                cols,
                expected,
                got: raw.len(),
            });
        }
        let tile_bytes = cols / format.kernel_block_weights() * TILE * format.block_bytes();
        let mut data = HugeBuf::zeroed(rows.div_ceil(TILE) * tile_bytes);
        for row in 0..rows {
            let src = &raw[row * row_bytes..][..row_bytes];
            let dst = &mut data[row / TILE * tile_bytes..][..tile_bytes];
            match format {
                Format::Q6K => pack_q6_k_row(name, row, src, dst)?,
                Format::Q4K | Format::Q5K => pack_k_row(name, format, row, src, dst)?,
                Format::IQ4XS => pack_iq4_xs_row(name, row, src, dst)?,
                Format::Q3K => pack_q3_k_row(name, row, src, dst)?,
                Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q5_0 | Format::Q5_1 | Format::IQ4NL => {
                    pack_row(name, format, row, src, dst)?
                }
            }
        }
        Ok(PackedMatrix { name: name.to_string(), format, rows, cols, data })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn format(&self) -> Format {
        self.format
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Blocks of 32 weights per row: the activations' blocks. The work a tile's block does, which
    /// the pool's chunks count (`chunk_count`), is counted in them for every format, also for
    /// Q4_K and Q5_K, whose kernel block is a super-block of 8 of them ([`PackedMatrix::tile_blocks`]).
    pub fn blocks(&self) -> usize {
        self.cols / QK
    }
    /// Blocks per row as the kernels read them: [`PackedMatrix::blocks`], or Q4_K's (Q5_K's) super-blocks.
    pub fn tile_blocks(&self) -> usize {
        self.cols / self.format.kernel_block_weights()
    }
    /// Number of 16-row tiles.
    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE)
    }
    /// Bytes of one tile's block (16 rows of [`Format::kernel_block_weights`] weights).
    pub fn tile_block_bytes(&self) -> usize {
        TILE * self.format.block_bytes()
    }
    /// Bytes a product streams: its tiles' bytes without the padding rows. That is the GGUF
    /// tensor's size for Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and IQ4_NL; for Q6_K it is 28 bytes a row per 32 weights, more
    /// than the file's 210 per 256; for Q4_K 148 a row per 256, more than the file's 144; for Q5_K
    /// 180, more than the file's 176; for IQ4_XS 138, more than the file's 136; for Q3_K 114, more
    /// than the file's 110 (see the module docs).
    pub fn weight_bytes(&self) -> usize {
        self.rows * self.tile_blocks() * self.format.block_bytes()
    }
    /// The bytes of tile `t`.
    pub(crate) fn tile(&self, t: usize) -> &[u8] {
        let n = self.tile_blocks() * self.tile_block_bytes();
        &self.data[t * n..(t + 1) * n]
    }
}

/// One row's Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / IQ4_NL blocks (`src`, GGUF) into its lane `row % 16` of its
/// tile (`dst`).
fn pack_row(name: &str, format: Format, row: usize, src: &[u8], dst: &mut [u8]) -> Result<(), GemvError> {
    let (bb, j) = (format.block_bytes(), row % TILE);
    for (b, src) in src.chunks_exact(bb).enumerate() {
        let dst = &mut dst[b * TILE * bb..][..TILE * bb];
        let d = [src[0], src[1]];
        check_scale(name, "d", row, b, d)?;
        dst[2 * j..2 * j + 2].copy_from_slice(&d);
        let mut q = &src[2..];
        let mut qdst_off = 2 * TILE;
        if format.has_min() {
            let m = [src[2], src[3]];
            check_scale(name, "m", row, b, m)?;
            dst[2 * TILE + 2 * j..2 * TILE + 2 * j + 2].copy_from_slice(&m);
            q = &src[4..];
            qdst_off += 2 * TILE;
        }
        let qdst = &mut dst[qdst_off..];
        match format {
            Format::Q4_0 | Format::Q4_1 | Format::IQ4NL => {
                pack_q4_codes(|e| if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 }, j, qdst);
            }
            Format::Q8_0 => {
                for v in 0..8 {
                    qdst[v * 64 + j * 4..][..4].copy_from_slice(&q[4 * v..4 * v + 4]);
                }
            }
            Format::Q5_0 | Format::Q5_1 => {
                let qh = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
                pack_q5_codes(|e| q5_code(qh, &q[4..], e), j, qdst);
            }
            Format::Q6K => unreachable!("pack_q6_k_row packs Q6_K"),
            Format::Q4K | Format::Q5K => unreachable!("pack_k_row packs Q4_K and Q5_K"),
            Format::IQ4XS => unreachable!("pack_iq4_xs_row packs IQ4_XS"),
            Format::Q3K => unreachable!("pack_q3_k_row packs Q3_K"),
        }
    }
    Ok(())
}

/// A Q4 block's 32 codes (`elem(e)`, 0..15) into lane `j` of its four vectors `qdst` (the nibble
/// layout of the module docs).
fn pack_q4_codes(elem: impl Fn(usize) -> u8, j: usize, qdst: &mut [u8]) {
    for v in 0..4 {
        for i in 0..4 {
            qdst[v * 64 + j * 4 + i] = elem(8 * v + i) | (elem(8 * v + 4 + i) << 4);
        }
    }
}

/// A block's 32 codes (`elem(e)`, 0..31) into lane `j` of its five vectors `qdst` (the 5-bit layout
/// of the module docs).
fn pack_q5_codes(elem: impl Fn(usize) -> u8, j: usize, qdst: &mut [u8]) {
    for i in 0..4 {
        let mut low2 = 0;
        for k in 0..4 {
            let (c, c16) = (elem(4 * k + i), elem(16 + 4 * k + i));
            qdst[k * 64 + j * 4 + i] = c | ((c16 >> 2) << 5);
            low2 |= (c16 & 3) << (2 * k);
        }
        qdst[4 * 64 + j * 4 + i] = low2;
    }
}

/// One row's Q4_K or Q5_K super-blocks (`src`, GGUF, 144 or 176 bytes each) into its lane `row % 16`
/// of its tile (`dst`), one tile block per super-block. A non-finite `d` or `dmin` is named by its
/// super-block.
fn pack_k_row(name: &str, format: Format, row: usize, src: &[u8], dst: &mut [u8]) -> Result<(), GemvError> {
    let (tbb, j) = (TILE * format.block_bytes(), row % TILE);
    for (s, sb) in src.chunks_exact(format.gguf_block_bytes()).enumerate() {
        let dst = &mut dst[s * tbb..][..tbb];
        let (d, dmin) = ([sb[0], sb[1]], [sb[2], sb[3]]);
        check_scale(name, "d", row, s, d)?;
        check_scale(name, "dmin", row, s, dmin)?;
        dst[2 * j..2 * j + 2].copy_from_slice(&d);
        dst[Q4_K_DMIN + 2 * j..Q4_K_DMIN + 2 * j + 2].copy_from_slice(&dmin);
        let scales = &sb[4..16];
        for u in 0..Q4_K_SUBS {
            let (sc, m) = q4_k_scale_min(u, scales);
            dst[Q4_K_SC + TILE * u + j] = sc;
            dst[Q4_K_M + TILE * u + j] = m;
            match format {
                Format::Q4K => {
                    pack_q4_codes(|l| q4_k_code(&sb[16..], u, l), j, &mut dst[Q4_K_CODES + Q4_K_SUB_CODES * u..]);
                }
                Format::Q5K => {
                    let (qh, qs) = (&sb[16..16 + QK_K / 8], &sb[16 + QK_K / 8..]);
                    pack_q5_codes(|l| q5_k_code(qh, qs, u, l), j, &mut dst[Q4_K_CODES + Q5_SUB_CODES * u..]);
                }
                Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q6K | Format::Q5_0 | Format::Q5_1 => {
                    unreachable!("not Q4_K's super-block")
                }
                Format::IQ4NL | Format::IQ4XS | Format::Q3K => unreachable!("not Q4_K's super-block"),
            }
        }
    }
    Ok(())
}

/// One row's IQ4_XS super-blocks (`src`, GGUF, 136 bytes each: f16 `d`, `scales_h`, `scales_l[4]`,
/// `qs[128]`) into its lane `row % 16` of its tile (`dst`), one tile block per super-block. A
/// non-finite `d` is named by its super-block.
fn pack_iq4_xs_row(name: &str, row: usize, src: &[u8], dst: &mut [u8]) -> Result<(), GemvError> {
    let (tbb, j) = (TILE * Format::IQ4XS.block_bytes(), row % TILE);
    for (s, sb) in src.chunks_exact(Format::IQ4XS.gguf_block_bytes()).enumerate() {
        let dst = &mut dst[s * tbb..][..tbb];
        let d = [sb[0], sb[1]];
        check_scale(name, "d", row, s, d)?;
        dst[2 * j..2 * j + 2].copy_from_slice(&d);
        let (scales_h, scales_l) = (u16::from_le_bytes([sb[2], sb[3]]), &sb[4..8]);
        for u in 0..Q4_K_SUBS {
            dst[IQ4_XS_SC + TILE * u + j] = iq4_xs_scale(scales_h, scales_l, u) as u8;
            // sub-block u's 32 codes: qs[16u + t] holds element t low, t + 16 high (IQ4_NL's block)
            let qs = &sb[8 + 16 * u..][..16];
            pack_q4_codes(|l| if l < 16 { qs[l] & 0x0f } else { qs[l - 16] >> 4 }, j,
                          &mut dst[IQ4_XS_CODES + Q4_K_SUB_CODES * u..]);
        }
    }
    Ok(())
}

/// One row's Q6_K super-blocks (`src`, GGUF, 210 bytes each) into its lane `row % 16` of its tile
/// (`dst`), 8 blocks of 32 weights per super-block. A non-finite `d` is named by its super-block.
fn pack_q6_k_row(name: &str, row: usize, src: &[u8], dst: &mut [u8]) -> Result<(), GemvError> {
    let (tbb, j) = (TILE * Format::Q6K.block_bytes(), row % TILE);
    for (s, sb) in src.chunks_exact(Format::Q6K.gguf_block_bytes()).enumerate() {
        let d = [sb[QK_K / 2 + QK_K / 4 + QK_K / 16], sb[QK_K / 2 + QK_K / 4 + QK_K / 16 + 1]];
        check_scale(name, "d", row, s, d)?;
        let scales = &sb[QK_K / 2 + QK_K / 4..][..QK_K / 16];
        for b8 in 0..QK_K / QK {
            let dst = &mut dst[(s * (QK_K / QK) + b8) * tbb..][..tbb];
            dst[2 * j..2 * j + 2].copy_from_slice(&d);
            dst[2 * TILE + 2 * j..2 * TILE + 2 * j + 2].copy_from_slice(&scales[2 * b8..2 * b8 + 2]);
            let q: [u8; QK] = std::array::from_fn(|c| q6_k_quant(sb, QK * b8 + c));
            pack_q6_k_quants(&q, j, &mut dst[4 * TILE..]);
        }
    }
    Ok(())
}

/// A block's 32 quants (0..63) into lane `j` of its six vectors (the layout of the module docs).
fn pack_q6_k_quants(q: &[u8; QK], j: usize, qdst: &mut [u8]) {
    for g in 0..2 {
        for k in 0..3 {
            for i in 0..4 {
                let top = (q[16 * g + 12 + i] >> (2 * k)) & 3;
                qdst[(3 * g + k) * 64 + 4 * j + i] = q[16 * g + 4 * k + i] | (top << 6);
            }
        }
    }
}

/// One row's Q3_K super-blocks (`src`, GGUF, 110 bytes each: `hmask[32]`, `qs[64]`, `scales[12]`,
/// f16 `d`) into its lane `row % 16` of its tile (`dst`), one tile block per super-block. A
/// non-finite `d` is named by its super-block.
fn pack_q3_k_row(name: &str, row: usize, src: &[u8], dst: &mut [u8]) -> Result<(), GemvError> {
    let (tbb, j) = (TILE * Format::Q3K.block_bytes(), row % TILE);
    for (s, sb) in src.chunks_exact(Format::Q3K.gguf_block_bytes()).enumerate() {
        let dst = &mut dst[s * tbb..][..tbb];
        let d = [sb[QK_K / 8 + QK_K / 4 + 12], sb[QK_K / 8 + QK_K / 4 + 13]];
        check_scale(name, "d", row, s, d)?;
        dst[2 * j..2 * j + 2].copy_from_slice(&d);
        let scales = &sb[QK_K / 8 + QK_K / 4..][..12];
        for u in 0..Q4_K_SUBS {
            for g in 0..2 {
                dst[Q3_K_SC + 2 * TILE * u + 2 * j + g] = q3_k_scale(scales, 2 * u + g) as u8;
            }
            let c: [u8; QK] = std::array::from_fn(|l| q3_k_code(sb, QK * u + l));
            pack_q3_k_codes(&c, j, &mut dst[Q3_K_CODES + Q3_K_SUB_CODES * u..]);
        }
    }
    Ok(())
}

/// A block's 32 codes (0..7) into lane `j` of its three vectors (the layout of the module docs).
fn pack_q3_k_codes(c: &[u8; QK], j: usize, qdst: &mut [u8]) {
    for i in 0..4 {
        let top = [c[24 + i] & 3, c[28 + i] & 3, (c[24 + i] >> 2) | ((c[28 + i] >> 2) << 1)];
        for (k, top) in top.into_iter().enumerate() {
            qdst[k * 64 + 4 * j + i] = c[4 * k + i] | (c[12 + 4 * k + i] << 3) | (top << 6);
        }
    }
}

fn check_scale(name: &str, field: &'static str, row: usize, block: usize, bytes: [u8; 2]) -> Result<(), GemvError> {
    let bits = u16::from_le_bytes(bytes);
    if f16_is_finite(bits) {
        Ok(())
    } else {
        Err(GemvError::NonFiniteScale { tensor: name.to_string(), field, row, block, bits })
    }
}
