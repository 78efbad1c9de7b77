//! Repacking GGUF blocks once, at load, into row tiles interleaved for the SIMD kernels.
//!
//! Why a tile: the kernels compute 16 output rows at once with one row per 32-bit lane, so a
//! block's integer dot product lands in its lane with no horizontal reduction, and the float
//! sum over blocks runs in block order for every row on every path (bit-identical results).
//!
//! Layout of tile `t` (rows `16t .. 16t + 16`; rows past N are zero, scale 0): for each block
//! `b` in order, `d[16]` (f16 LE), then for Q4_1 `m[16]`, then the quants as 64-byte vectors
//! of 16 lanes x 4 bytes, lane `j` = row `16t + j`:
//! - Q4: vector `v` (0..4), byte `i` (0..4) of lane `j`: low nibble = element `8v + i`,
//!   high nibble = element `8v + 4 + i` of that row's block.
//! - Q8: vector `v` (0..8), byte `i` of lane `j`: element `4v + i`.
//!
//! The byte count equals the GGUF tensor's (plus the padding rows): no dequantization.

use super::error::GemvError;
use super::format::{f16_is_finite, Format, QK};
use crate::huge_pages::HugeBuf;

/// Rows per tile (one per 32-bit lane of a 512-bit vector).
pub const TILE: usize = 16;

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
    /// Repacks a GGUF tensor's raw block bytes (row-major, `cols / 32` blocks per row).
    ///
    /// Checks, naming `name`: `cols` a positive multiple of 32, `rows > 0`, the exact byte
    /// count, and every scale (and minimum) finite. Nothing after this point is checked again.
    pub fn from_gguf(name: &str, raw: &[u8], rows: usize, cols: usize, format: Format) -> Result<Self, GemvError> {
        let bad = |reason| GemvError::BadShape { tensor: name.to_string(), rows, cols, reason };
        if rows == 0 {
            return Err(bad("rows must be > 0"));
        }
        if cols == 0 || cols % QK != 0 {
            return Err(bad("cols (K) must be a positive multiple of the block size 32"));
        }
        let nb = cols / QK;
        let bb = format.block_bytes();
        let expected = rows.checked_mul(nb).and_then(|n| n.checked_mul(bb)).ok_or(bad("too large"))?;
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
        let tiles = rows.div_ceil(TILE);
        let tbb = TILE * bb;
        let mut data = HugeBuf::zeroed(tiles * nb * tbb);
        for row in 0..rows {
            let (t, j) = (row / TILE, row % TILE);
            for b in 0..nb {
                let src = &raw[(row * nb + b) * bb..][..bb];
                let dst = &mut data[(t * nb + b) * tbb..][..tbb];
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
                    Format::Q4_0 | Format::Q4_1 => {
                        let elem = |e: usize| if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 };
                        for v in 0..4 {
                            for i in 0..4 {
                                qdst[v * 64 + j * 4 + i] = elem(8 * v + i) | (elem(8 * v + 4 + i) << 4);
                            }
                        }
                    }
                    Format::Q8_0 => {
                        for v in 0..8 {
                            qdst[v * 64 + j * 4..][..4].copy_from_slice(&q[4 * v..4 * v + 4]);
                        }
                    }
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
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / QK
    }
    /// Number of 16-row tiles.
    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE)
    }
    /// Bytes of one tile's block (16 rows).
    pub fn tile_block_bytes(&self) -> usize {
        TILE * self.format.block_bytes()
    }
    /// Bytes a product streams: the GGUF tensor's size (padding rows excluded).
    pub fn weight_bytes(&self) -> usize {
        self.rows * self.blocks() * self.format.block_bytes()
    }
    /// The bytes of tile `t`.
    pub(crate) fn tile(&self, t: usize) -> &[u8] {
        let n = self.blocks() * self.tile_block_bytes();
        &self.data[t * n..(t + 1) * n]
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
