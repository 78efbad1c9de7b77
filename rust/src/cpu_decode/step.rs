//! The step's rows, checked once at the boundary so the layers' loops index without checks
//! that can fail.
//!
//! Tokens of one sequence are consecutive rows (`query_start_loc`); a sequence's keys are its
//! positions `0 .. seq_len`, position `p` in slot `table[p / block_size] * block_size +
//! p % block_size`. Row `r`, the `i`-th of its sequence's `q` new tokens, sees keys
//! `0 .. seq_len - q + i + 1` (causal; with a sliding window `W` only the last `W` of them):
//!
//! ```text
//!   keys of seq s:  0 1 2 ... seq_len-q | seq_len-q .. seq_len-1   <- this step's q new tokens
//!   row i sees:     0 ..................................  seq_len-q+i  (its own key last)
//! ```

use super::error::DecodeError;

/// The cache every layer shares: `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvGeometry {
    /// Floats of one layer's K (or V) cache.
    pub fn plane(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_heads * self.head_dim
    }
    /// Where layer `l`'s K plane then V plane lie in the whole cache.
    pub fn layer_span(&self, l: usize) -> std::ops::Range<usize> {
        l * 2 * self.plane()..(l + 1) * 2 * self.plane()
    }
    /// Floats of the whole cache.
    pub fn len(&self) -> usize {
        self.layers * 2 * self.plane()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Offset of (`slot`, `kv_head`) in one layer's K or V plane.
    #[inline(always)]
    pub fn slot_offset(&self, slot: usize, kv_head: usize) -> usize {
        (slot * self.kv_heads + kv_head) * self.head_dim
    }
}

/// The attention metadata of one step (`pagedrs.attention.base.AttentionMetadata`), as slices.
#[derive(Debug, Clone, Copy)]
pub struct StepMeta<'a> {
    pub slot_mapping: &'a [i64],    // [T]: where each row's K/V goes
    pub query_start_loc: &'a [i32], // [S + 1]
    pub seq_lens: &'a [i32],        // [S]: context length including this step's tokens
    pub block_tables: &'a [i32],    // [S, table_width], row-major
    pub table_width: usize,
}

/// One row: its sequence, the key count it sees (before any window) and its K/V slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub seq: usize,
    pub keys: usize,
    pub slot: usize,
}

/// The validated rows of a step and the block tables they read.
#[derive(Debug)]
pub struct StepLayout<'a> {
    pub rows: Vec<Row>,
    pub tables: &'a [i32],
    pub table_width: usize,
}

fn bad(field: &'static str, reason: String) -> DecodeError {
    DecodeError::Step { field, reason }
}

impl<'a> StepLayout<'a> {
    /// Checks `meta` against `tokens` rows and the cache: every query length >= 1 and summing
    /// to `tokens`, `q <= seq_len <= table_width * block_size`, every table entry a sequence
    /// reads in `0 .. num_blocks`, and each row's slot the slot its table gives its position
    /// (else attention would read a key this step never wrote).
    pub fn new(meta: StepMeta<'a>, tokens: usize, kv: &KvGeometry) -> Result<Self, DecodeError> {
        let s = meta.seq_lens.len();
        let qsl = meta.query_start_loc;
        if qsl.len() != s + 1 {
            return Err(bad("query_start_loc", format!("has {} entries; {s} sequences need {}", qsl.len(), s + 1)));
        }
        if qsl[0] != 0 || qsl[s] as i64 != tokens as i64 {
            return Err(bad("query_start_loc", format!("must run from 0 to {tokens} (the step's rows); got {qsl:?}")));
        }
        if meta.slot_mapping.len() != tokens {
            return Err(bad("slot_mapping", format!("has {} entries; the step has {tokens} rows", meta.slot_mapping.len())));
        }
        let width = meta.table_width;
        if meta.block_tables.len() != s * width {
            return Err(bad("block_tables", format!("has {} entries; [{s}, {width}] needs {}", meta.block_tables.len(), s * width)));
        }
        let bs = kv.block_size;
        let mut rows = Vec::with_capacity(tokens);
        for seq in 0..s {
            let (start, end) = (qsl[seq] as i64, qsl[seq + 1] as i64);
            let q = end - start;
            if q < 1 {
                return Err(bad("query_start_loc", format!("sequence {seq} has {q} new tokens; each needs >= 1")));
            }
            let len = meta.seq_lens[seq] as i64;
            if len < q || len as usize > width * bs {
                return Err(bad("seq_lens", format!(
                    "sequence {seq} has length {len}; allowed {q} (its new tokens) to {} (table width {width} x block size {bs})",
                    width * bs
                )));
            }
            let len = len as usize;
            let table = &meta.block_tables[seq * width..(seq + 1) * width];
            for (i, &b) in table[..len.div_ceil(bs)].iter().enumerate() {
                if b < 0 || b as usize >= kv.num_blocks {
                    return Err(bad("block_tables", format!(
                        "sequence {seq}, entry {i} is block {b}; allowed 0 to {} (the cache's blocks)", kv.num_blocks - 1
                    )));
                }
            }
            for (i, r) in (start..end).enumerate() {
                let keys = len - q as usize + i + 1;
                let pos = keys - 1;
                let slot = meta.slot_mapping[r as usize];
                let expected = table[pos / bs] as i64 * bs as i64 + (pos % bs) as i64;
                if slot != expected {
                    return Err(bad("slot_mapping", format!(
                        "row {r} (sequence {seq}, position {pos}) has slot {slot}; its block table puts that position in slot {expected}"
                    )));
                }
                rows.push(Row { seq, keys, slot: slot as usize });
            }
        }
        Ok(StepLayout { rows, tables: meta.block_tables, table_width: width })
    }

    /// The block of key position `p` of sequence `seq` (checked in `new` for every `p` a row sees).
    #[inline(always)]
    pub fn block(&self, seq: usize, p: usize, block_size: usize) -> usize {
        self.tables[seq * self.table_width + p / block_size] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KV: KvGeometry = KvGeometry { layers: 1, num_blocks: 4, block_size: 2, kv_heads: 1, head_dim: 4 };

    fn meta<'a>(slots: &'a [i64], qsl: &'a [i32], lens: &'a [i32], tables: &'a [i32], width: usize) -> StepMeta<'a> {
        StepMeta { slot_mapping: slots, query_start_loc: qsl, seq_lens: lens, block_tables: tables, table_width: width }
    }

    #[test]
    fn rows_see_their_causal_prefix() {
        // seq 0: 3 keys, 2 new (positions 1, 2 -> blocks 3 and 1); seq 1: 1 key, decode
        let tables = [3, 1, 0, 0];
        let step = StepLayout::new(meta(&[7, 2, 0], &[0, 2, 3], &[3, 1], &tables, 2), 3, &KV).unwrap();
        assert_eq!(
            step.rows,
            vec![Row { seq: 0, keys: 2, slot: 7 }, Row { seq: 0, keys: 3, slot: 2 }, Row { seq: 1, keys: 1, slot: 0 }]
        );
        assert_eq!(step.block(0, 2, 2), 1);
    }

    #[test]
    fn bad_steps_name_the_field() {
        let err = |m: StepMeta<'_>, t: usize| StepLayout::new(m, t, &KV).unwrap_err().to_string();
        assert!(err(meta(&[0], &[0, 1], &[1], &[9, 0], 2), 1).starts_with("block_tables: sequence 0, entry 0 is block 9"));
        assert!(err(meta(&[0], &[0, 1], &[1], &[-1, 0], 2), 1).contains("is block -1"));
        assert!(err(meta(&[1], &[0, 1], &[1], &[0, 0], 2), 1).starts_with("slot_mapping: row 0"));
        assert!(err(meta(&[0], &[0, 1], &[5], &[0, 0], 2), 1).starts_with("seq_lens: sequence 0 has length 5"));
        assert!(err(meta(&[0, 1], &[0, 2], &[1], &[0, 0], 2), 2).starts_with("seq_lens"));
        assert!(err(meta(&[0], &[0, 0, 1], &[1, 1], &[0, 0, 0, 0], 2), 1).contains("has 0 new tokens"));
        assert!(err(meta(&[0], &[0, 1], &[1], &[0, 0], 2), 2).starts_with("query_start_loc"));
        assert!(err(meta(&[0, 0], &[0, 1], &[1], &[0, 0], 2), 1).starts_with("slot_mapping: has 2"));
        assert!(err(meta(&[0], &[0, 1], &[1], &[0], 2), 1).starts_with("block_tables: has 1"));
        assert!(err(meta(&[0], &[0, 1], &[i32::MIN], &[0, 0], 2), 1).starts_with("seq_lens"));
        assert!(err(meta(&[0], &[0, i32::MAX], &[1], &[0, 0], 2), 1).starts_with("query_start_loc"));
    }
}
