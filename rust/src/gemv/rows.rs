//! Whole rows of a packed matrix as float32: the token lookup of a tied GGUF head read from the
//! head's own tiles.
//!
//! Why: a model whose head is its token table (SmolLM2, Llama 3.2, Qwen2.5, ...) kept the table's
//! blocks twice, once packed for the head's product and once as the file's blocks for the lookup
//! (`BlockEmbedding`): 28 MB of the embedded model's ~100, ~0.56 GB of an 8B-vocabulary Q8_0 table.
//! The lookup now reads the head's tiles, so the bytes are held once.
//!
//! Exactness: a weight is the float32 that gguf-py's dequantization (and so a dense load) gives:
//! Q8_0 `code * d`, Q6_K `(d * sc) * (q - 32)`, in float32, one rounding per product as NumPy
//! does it. The tiles hold the file's `d`, scales and codes unchanged (`pack.rs`), so nothing but
//! the layout differs. The formats llama.cpp writes a tied table in (Q8_0; Q6_K, a K-quant mix's
//! output type, which it uses for a table that is also the head) are read; others are refused,
//! and their lookup keeps its own blocks.

use super::error::GemvError;
use super::format::{f16_to_f32, Format, QK};
use super::pack::{PackedMatrix, TILE};
use super::scalar::tile_q6_k_quant;

impl PackedMatrix {
    /// Whether [`PackedMatrix::dequantize_rows`] reads this matrix's format.
    pub fn reads_rows(&self) -> bool {
        matches!(self.format, Format::Q8_0 | Format::Q6K)
    }

    /// What [`PackedMatrix::dequantize_rows`] refuses before it writes anything (a caller checks this
    /// before it allocates the output): a format it does not read, an id outside `0..rows`.
    pub fn check_row_ids(&self, ids: &[i64]) -> Result<(), GemvError> {
        let input = |reason: String| GemvError::Input { tensor: self.name.clone(), reason };
        if !self.reads_rows() {
            return Err(input(format!("rows of format {} cannot be read (q8_0 and q6_k can)", self.format.name())));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id < 0 || id as u64 >= self.rows as u64) {
            return Err(input(format!("row id {bad} is out of range; allowed 0 to {}", self.rows - 1)));
        }
        Ok(())
    }

    /// Rows `ids` as float32, row after row into `out` (`ids.len() * cols` values). Refused, naming
    /// the tensor: a format [`PackedMatrix::reads_rows`] does not read, an id outside `0..rows`, an
    /// `out` of another length. Nothing is written before every id is checked.
    pub fn dequantize_rows(&self, ids: &[i64], out: &mut [f32]) -> Result<(), GemvError> {
        self.check_row_ids(ids)?;
        let input = |reason: String| GemvError::Input { tensor: self.name.clone(), reason };
        let cols = self.cols;
        if Some(out.len()) != ids.len().checked_mul(cols) {
            return Err(input(format!("the output holds {} values; {} rows of {cols} need {}", out.len(), ids.len(),
                                     ids.len().saturating_mul(cols))));
        }
        for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(cols)) {
            let (tile, lane) = (self.tile(id as usize / TILE), id as usize % TILE);
            let tbb = self.tile_block_bytes();
            for (block, dst) in dst.chunks_exact_mut(QK).enumerate() {
                let tb = &tile[block * tbb..][..tbb];
                match self.format {
                    Format::Q8_0 => q8_0_block(tb, lane, dst),
                    Format::Q6K => q6_k_block(tb, lane, dst),
                    _ => unreachable!("checked by reads_rows"),
                }
            }
        }
        Ok(())
    }
}

/// Lane `j`'s `d`: the f16 at `tb[2j..2j + 2]`, a tile block's first field.
fn lane_f16(tb: &[u8], j: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([tb[2 * j], tb[2 * j + 1]]))
}

/// One Q8_0 tile block's lane `j` (`d[16]`, then 8 vectors of 16 lanes x 4 codes: element `4v + i`
/// at byte `64v + 4j + i`) as 32 weights `code * d`.
fn q8_0_block(tb: &[u8], j: usize, dst: &mut [f32]) {
    let d = lane_f16(tb, j);
    let q = &tb[2 * TILE..];
    for (e, w) in dst.iter_mut().enumerate() {
        *w = f32::from(q[(e / 4) * 64 + 4 * j + e % 4] as i8) * d;
    }
}

/// One Q6_K tile block's lane `j` (`d[16]`, `sc[16][2]`, then the quants in the layout `pack.rs` gives
/// them, read by `scalar::tile_q6_k_quant`) as 32 weights `(d * sc_g) * (q - 32)`.
fn q6_k_block(tb: &[u8], j: usize, dst: &mut [f32]) {
    let d = lane_f16(tb, j);
    let q = &tb[4 * TILE..];
    for (e, w) in dst.iter_mut().enumerate() {
        let scale = d * f32::from(tb[2 * TILE + 2 * j + e / 16] as i8);
        *w = scale * f32::from(tile_q6_k_quant(q, j, e) as i8 - 32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemv::format::q6_k_quant;

    /// A Q8_0 row of `blocks` blocks: scale `d_bits`, codes from `code(b, e)`.
    fn q8_0_rows(rows: usize, blocks: usize, seed: u32) -> Vec<u8> {
        let mut raw = Vec::new();
        for r in 0..rows {
            for b in 0..blocks {
                let d: u16 = 0x2000 + ((r * 7 + b * 13 + seed as usize) % 0x3000) as u16; // finite, positive and small
                raw.extend_from_slice(&d.to_le_bytes());
                raw.extend((0..QK).map(|e| ((r * 31 + b * 17 + e * 5 + seed as usize) % 256) as u8));
            }
        }
        raw
    }

    #[test]
    fn q8_0_rows_are_code_times_d() {
        let (rows, blocks) = (37, 3); // past two tiles, a partial third
        let raw = q8_0_rows(rows, blocks, 1);
        let m = PackedMatrix::from_gguf("t", &raw, rows, blocks * QK, Format::Q8_0).unwrap();
        let ids = [0i64, 36, 15, 16, 5, 5];
        let mut out = vec![0f32; ids.len() * blocks * QK];
        m.dequantize_rows(&ids, &mut out).unwrap();
        for (n, &id) in ids.iter().enumerate() {
            let row = &raw[id as usize * blocks * 34..][..blocks * 34];
            for b in 0..blocks {
                let d = f16_to_f32(u16::from_le_bytes([row[34 * b], row[34 * b + 1]]));
                for e in 0..QK {
                    let want = f32::from(row[34 * b + 2 + e] as i8) * d;
                    assert_eq!(out[n * blocks * QK + b * QK + e].to_bits(), want.to_bits(), "row {id} block {b} {e}");
                }
            }
        }
    }

    #[test]
    fn q6_k_rows_are_d_sc_times_q_minus_32() {
        let (rows, supers) = (18, 2);
        let mut raw = Vec::new();
        for r in 0..rows {
            for s in 0..supers {
                let mut sb: Vec<u8> = (0..208).map(|i| ((r * 29 + s * 11 + i * 7) % 256) as u8).collect();
                sb.extend_from_slice(&(0x3000u16 + (r * 3 + s) as u16).to_le_bytes());
                raw.extend(sb);
            }
        }
        let m = PackedMatrix::from_gguf("t", &raw, rows, supers * 256, Format::Q6K).unwrap();
        let ids: Vec<i64> = (0..rows as i64).rev().collect();
        let mut out = vec![0f32; ids.len() * supers * 256];
        m.dequantize_rows(&ids, &mut out).unwrap();
        for (n, &id) in ids.iter().enumerate() {
            for s in 0..supers {
                let sb = &raw[(id as usize * supers + s) * 210..][..210];
                let d = f16_to_f32(u16::from_le_bytes([sb[208], sb[209]]));
                for e in 0..256 {
                    let scale = d * f32::from(sb[192 + e / 16] as i8);
                    let want = scale * f32::from(q6_k_quant(sb, e) as i8 - 32);
                    assert_eq!(out[n * supers * 256 + s * 256 + e].to_bits(), want.to_bits(), "row {id} super {s} {e}");
                }
            }
        }
    }

    #[test]
    fn refusals_name_the_tensor_and_the_value() {
        let raw = q8_0_rows(4, 1, 2);
        let m = PackedMatrix::from_gguf("emb", &raw, 4, QK, Format::Q8_0).unwrap();
        let mut out = vec![7f32; QK];
        for bad in [-1i64, 4, i64::MAX, i64::MIN] {
            let e = m.dequantize_rows(&[bad], &mut out).unwrap_err().to_string();
            assert!(e.contains("\"emb\"") && e.contains(&format!("row id {bad}")) && e.contains("0 to 3"), "{e}");
        }
        assert!(out.iter().all(|&v| v == 7.0), "nothing written before the ids are checked");
        let e = m.dequantize_rows(&[0, 1], &mut out).unwrap_err().to_string();
        assert!(e.contains("2 rows of 32 need 64"), "{e}");
        m.dequantize_rows(&[], &mut []).unwrap();
        let q4 = PackedMatrix::from_gguf("w", &[0u8; 4 * 18], 4, QK, Format::Q4_0).unwrap();
        assert!(!q4.reads_rows());
        let e = q4.dequantize_rows(&[0], &mut out).unwrap_err().to_string();
        assert!(e.contains("q4_0") && e.contains("q8_0 and q6_k"), "{e}");
    }
}
