//! Page-granular swap-out: a paused sequence gives device pages to the host one at a
//! time, only as many as the caller needs, instead of all at once.
//!
//! ```text
//!  table      |  7  |  2  |  9  |  4  |      7 is shared with a fork (refcount 2)
//!  on_host    |  -  |  -  |  -  |  -  |
//!  swap_out_pages(seq, 2)  → copies (4, c0), (9, c1): the last exclusive entries first
//!  table      |  7  |  2  | c1  | c0  |      device blocks 9 and 4 are free again
//!  on_host    |  -  |  -  |  H  |  H  |
//! ```
//!
//! Only an entry whose device block no other table uses moves: copying a shared page
//! (a fork's, or a prefix another sequence hit) would free nothing, since the other
//! users keep it on the device. A committed prefix-cache page moves like any other
//! (its device block stays cached and evictable, so later prompts still hit it until
//! it is reclaimed); releasing it without a copy would leave the sequence with a hole
//! to recompute if the cache evicted it before the sequence resumed.
//! `swap_in` brings every host entry back, as for a whole-sequence swap.

use super::BlockManager;
use crate::error::{invalid, BlockId, CoreError, SeqId, Tier};

impl BlockManager {
    /// Device pages of `seq` that `swap_out_pages` may move: entries on the device whose
    /// block has no other user, last entry first.
    fn exclusive_device_entries(&self, seq: SeqId) -> Result<Vec<usize>, CoreError> {
        let s = self.seq(seq)?;
        Ok((s.released..s.table.len()).rev().filter(|&i| !s.on_host[i] && self.gpu.refs.get(s.table[i]) == 1).collect())
    }

    /// How many device pages `swap_out_pages(seq, n)` could free at most.
    pub fn num_swappable_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.exclusive_device_entries(seq)?.len())
    }

    /// Moves `min(n, num_swappable_pages(seq))` of the sequence's exclusive device pages to
    /// the host, last entries first; each frees one device block. Returns the (gpu, cpu)
    /// copies to run before anything reuses those blocks (hand them to `start_transfers`,
    /// as the scheduler does). The sequence is swapped (`is_swapped`) once any page is
    /// on the host, and runs again only after `swap_in`.
    ///
    /// All or nothing: OutOfBlocks (host) when the host cannot take that many pages;
    /// ValueError for `n == 0`.
    pub fn swap_out_pages(&mut self, seq: SeqId, n: usize) -> Result<Vec<(BlockId, BlockId)>, CoreError> {
        if n == 0 {
            return Err(invalid!("swap_out_pages of sequence {seq}: n is 0; ask for at least 1 page"));
        }
        let mut entries = self.exclusive_device_entries(seq)?;
        entries.truncate(n);
        let mut host = Vec::with_capacity(entries.len());
        let mut dropped = Vec::new();
        if !self.cpu.take(entries.len(), &mut host, &mut dropped) {
            return Err(CoreError::OutOfBlocks { tier: Tier::Cpu, needed: entries.len(), available: self.cpu.num_free() });
        }
        // Host-cached pages reclaimed for these move on to the disk tier first.
        self.demote(Tier::Cpu, &dropped);
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let mut copies = Vec::with_capacity(entries.len());
        for (&i, &c) in entries.iter().zip(&host) {
            let g = std::mem::replace(&mut s.table[i], c);
            s.on_host[i] = true;
            self.gpu.release(g, 1);
            copies.push((g, c));
        }
        s.num_host += copies.len();
        s.paused |= !copies.is_empty();
        self.gpu.flush();
        self.stats.swap_out_blocks += copies.len() as u64;
        Ok(copies)
    }
}
