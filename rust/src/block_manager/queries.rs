//! Read-only queries of the manager: its configuration, free and cached pages per tier, chain
//! seeds, each sequence's table, tokens and host pages, and the slots of a token range.
//!
//! Why separate: none of these changes a page; every decision lives in the other files.

use crate::error::invalid;

use super::{prefix_cache, BlockId, BlockManager, BlockManagerConfig, BlockManagerStats, CoreError, SeqId, TokenId};

impl BlockManager {
    pub fn config(&self) -> &BlockManagerConfig {
        &self.cfg
    }
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    pub fn num_gpu_blocks(&self) -> usize {
        self.cfg.num_gpu_blocks
    }
    pub fn num_cpu_blocks(&self) -> usize {
        self.cfg.num_cpu_blocks
    }
    pub fn num_disk_blocks(&self) -> usize {
        self.cfg.num_disk_blocks
    }
    /// Disk slots usable now, counting evictable cached pages.
    pub fn num_free_disk_blocks(&self) -> usize {
        self.disk.num_free()
    }
    /// Pages cached on each tier now: (device, host, disk).
    pub fn num_cached_blocks(&self) -> (usize, usize, usize) {
        (self.gpu.cache.num_cached(), self.cpu.cache.num_cached(), self.disk.cache.num_cached())
    }
    /// The seed of every chain's first block hash (a persistent store records it per page).
    pub fn root_hash(&self) -> u64 {
        self.root
    }
    /// The chain seed of prompts salted with `salt` (vLLM's per-request `cache_salt`):
    /// prompts with different salts never share a page, on any tier or across restarts
    /// (the disk tier keys pages by this chain). No salt is [`root_hash`](Self::root_hash).
    pub fn salted_root(&self, salt: Option<&[u8]>) -> u64 {
        prefix_cache::salted_root(self.root, salt)
    }
    /// The chain seed a live sequence's blocks hash under.
    pub fn root_of(&self, seq: SeqId) -> Result<u64, CoreError> {
        Ok(self.seq(seq)?.root)
    }
    /// Device blocks allocatable now, counting evictable cached blocks.
    pub fn num_free_gpu_blocks(&self) -> usize {
        self.gpu.num_free()
    }
    /// Host blocks usable now, counting evictable host-cached blocks.
    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }
    /// Live sequence ids, in no particular order.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }
    pub fn stats(&self) -> BlockManagerStats {
        self.stats
    }

    /// The sequence's block table: device block ids, or host ids for the entries that
    /// are swapped out (see [`host_entries`](Self::host_entries)); leading entries
    /// released out of the sliding window are [`window::NULL_BLOCK`](super::window::NULL_BLOCK).
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CoreError> {
        Ok(&self.seq(seq)?.table)
    }
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.seq(seq)?.tokens.len())
    }
    /// The sequence's tokens as recorded by allocate and append_tokens.
    pub fn tokens(&self, seq: SeqId) -> Result<&[TokenId], CoreError> {
        Ok(&self.seq(seq)?.tokens)
    }
    /// Tokens whose K/V the caller has committed.
    pub fn num_committed_tokens(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.seq(seq)?.committed)
    }
    /// Whether any of the sequence's pages is on the host (wholly or page by page).
    pub fn is_swapped(&self, seq: SeqId) -> Result<bool, CoreError> {
        Ok(self.seq(seq)?.swapped())
    }
    /// Per block-table entry, whether it is a host block (else a device block).
    pub fn host_entries(&self, seq: SeqId) -> Result<&[bool], CoreError> {
        Ok(&self.seq(seq)?.on_host)
    }
    /// How many of the sequence's block-table entries are host blocks.
    pub fn num_host_pages(&self, seq: SeqId) -> Result<usize, CoreError> {
        Ok(self.seq(seq)?.num_host)
    }
    /// Reference count of a device block (for tests and debugging).
    pub fn gpu_refcount(&self, block: BlockId) -> Option<u32> {
        ((block as usize) < self.cfg.num_gpu_blocks).then(|| self.gpu.refs.get(block))
    }

    /// Appends the slots (`block * block_size + offset`) of token positions `start..end`.
    pub fn slot_mapping_into(&self, seq: SeqId, start: usize, end: usize, out: &mut Vec<i64>) -> Result<(), CoreError> {
        let s = self.seq(seq)?;
        if s.swapped() {
            return Err(invalid!("sequence {seq} is swapped out; swap it in before asking for slots"));
        }
        if start > end || end > s.tokens.len() {
            return Err(invalid!(
                "slot range {start}..{end} of sequence {seq} is invalid: need start <= end <= num_tokens = {}",
                s.tokens.len()
            ));
        }
        let bs = self.cfg.block_size;
        if start < end && start / bs < s.released {
            return Err(invalid!(
                "slot range {start}..{end} of sequence {seq} starts in a page released out of the sliding window; \
                 its first {} tokens have none",
                s.released * bs
            ));
        }
        out.reserve(end - start);
        let mut pos = start;
        while pos < end {
            let block = s.table[pos / bs] as i64 * bs as i64;
            let stop = end.min((pos / bs + 1) * bs);
            out.extend((pos % bs..pos % bs + (stop - pos)).map(|off| block + off as i64));
            pos = stop;
        }
        Ok(())
    }
}
