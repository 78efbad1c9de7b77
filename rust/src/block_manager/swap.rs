//! The host tier: swapping sequences out and in, and keeping evicted cached device
//! blocks on the host (the `host_cache_evicted` switch).
//!
//! Copies the runner executes, per step, in this order before the forward pass:
//! 1. device → host: `swap_out` pairs and pending evict-to-host pairs;
//! 2. host → device: `swap_in` pairs and pending host-hit pairs;
//! 3. copy-on-write pairs.
//!
//! Host blocks read or written by a pending host copy are pinned (one refcount each)
//! until `take_pending_host_copies`, so no swap in the same step reuses them.
//! A step must not swap the same blocks both ways: the scheduler swaps in only in a
//! step that preempted nothing (vLLM's rule).

use super::{BlockManager, SwapInStatus};
use crate::error::{invalid, BlockId, CoreError, SeqId, Tier};
use std::collections::HashMap;

impl BlockManager {
    /// Checks that `seqs` are distinct live sequences, all on the device (`swapped` false)
    /// or all on the host (`swapped` true).
    fn check_group(&self, seqs: &[SeqId], swapped: bool) -> Result<(), CoreError> {
        for (i, &id) in seqs.iter().enumerate() {
            if self.seq(id)?.swapped != swapped {
                let (is, op) = if swapped { ("on the device", "swap in") } else { ("already swapped out", "swap out") };
                return Err(invalid!("cannot {op} sequence {id}: it is {is}"));
            }
            if seqs[..i].contains(&id) {
                return Err(invalid!("sequence {id} appears twice in the group to swap; each id once"));
            }
        }
        Ok(())
    }

    /// The distinct blocks of the group's tables, in first-use order, with how many of the
    /// group's table entries point at each.
    fn group_blocks(&self, seqs: &[SeqId]) -> Vec<(BlockId, u32)> {
        let mut index: HashMap<BlockId, usize> = HashMap::new();
        let mut blocks: Vec<(BlockId, u32)> = Vec::new();
        for id in seqs {
            for &b in &self.seqs[id].table {
                let i = *index.entry(b).or_insert_with(|| {
                    blocks.push((b, 0));
                    blocks.len() - 1
                });
                blocks[i].1 += 1;
            }
        }
        blocks
    }

    /// Host blocks `swap_out(seqs)` would take: one per distinct device block of the group.
    pub fn num_blocks_to_swap_out(&self, seqs: &[SeqId]) -> Result<usize, CoreError> {
        self.check_group(seqs, false)?;
        Ok(self.group_blocks(seqs).len())
    }

    /// Moves the group to the host. Returns (gpu, cpu) copies, each device block once.
    /// A device block also used outside the group is copied and stays on the device for
    /// its other users; a cached one nobody uses any more stays cached and evictable.
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, CoreError> {
        self.check_group(seqs, false)?;
        let blocks = self.group_blocks(seqs);
        let mut host = Vec::with_capacity(blocks.len());
        let mut dropped = Vec::new();
        if !self.cpu.take(blocks.len(), &mut host, &mut dropped) {
            return Err(CoreError::OutOfBlocks { tier: Tier::Cpu, needed: blocks.len(), available: self.cpu.num_free() });
        }
        let mut copies = Vec::with_capacity(blocks.len());
        let mut to_host: HashMap<BlockId, BlockId> = HashMap::with_capacity(blocks.len());
        for (&(g, users), &c) in blocks.iter().zip(&host) {
            self.cpu.refs.set_exclusive(c, users);
            self.gpu.release(g, users);
            copies.push((g, c));
            to_host.insert(g, c);
        }
        self.gpu.flush();
        for id in seqs {
            let s = self.seqs.get_mut(id).expect("checked");
            s.table.iter_mut().for_each(|b| *b = to_host[b]);
            s.swapped = true;
        }
        self.stats.swap_out_blocks += copies.len() as u64;
        Ok(copies)
    }

    /// Whether the group fits on the device now, later, or never.
    pub fn can_swap_in(&self, seqs: &[SeqId]) -> Result<SwapInStatus, CoreError> {
        self.check_group(seqs, true)?;
        let needed = self.group_blocks(seqs).len();
        Ok(if needed > self.cfg.num_gpu_blocks {
            SwapInStatus::Never
        } else if needed <= self.gpu.num_free() {
            SwapInStatus::Ok
        } else {
            SwapInStatus::Later
        })
    }

    /// Brings the group back to the device. Returns (cpu, gpu) copies, each host block
    /// once. Committed full blocks rejoin the device prefix cache where no other block
    /// caches their content.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, CoreError> {
        self.check_group(seqs, true)?;
        let blocks = self.group_blocks(seqs);
        self.take_gpu(blocks.len())?;
        let device = std::mem::take(&mut self.taken);
        let mut copies = Vec::with_capacity(blocks.len());
        let mut to_device: HashMap<BlockId, BlockId> = HashMap::with_capacity(blocks.len());
        for (&(c, users), &g) in blocks.iter().zip(&device) {
            self.gpu.refs.set_exclusive(g, users);
            if self.pin_swap_in_sources {
                // One user stays as the pin of the copy that reads it (see `transfer`).
                self.cpu.release(c, users - 1);
                self.host_pins.1.push(c);
            } else {
                self.cpu.release(c, users);
            }
            copies.push((c, g));
            to_device.insert(c, g);
        }
        self.cpu.flush();
        self.taken = device;
        let bs = self.cfg.block_size;
        for id in seqs {
            let s = self.seqs.get_mut(id).expect("checked");
            s.table.iter_mut().for_each(|b| *b = to_device[b]);
            s.swapped = false;
            for (i, &h) in s.hashes.iter().enumerate() {
                let parent = if i == 0 { self.root } else { s.hashes[i - 1] };
                self.gpu.cache.insert(s.table[i], h, parent, &s.tokens[i * bs..(i + 1) * bs]);
            }
        }
        self.stats.swap_in_blocks += copies.len() as u64;
        Ok(copies)
    }

    /// Keeps the content of the device blocks just evicted (in `self.evicted`) on free
    /// host blocks, while the host pool has some; records the (gpu, cpu) copies.
    pub(super) fn save_evicted_to_host(&mut self) {
        for &(g, hash) in &self.evicted {
            if self.cpu.cache.contains_hash(hash) {
                continue;
            }
            let Some(c) = self.cpu.pool.take() else { break };
            let parent = self.gpu.cache.parent_of(g);
            let inserted = self.cpu.cache.insert(c, hash, parent, self.gpu.cache.block_tokens(g));
            debug_assert!(inserted);
            self.cpu.refs.set_exclusive(c, 1); // the pin, until the copy completes
            self.host_pins.0.push(c);
            self.pending_evict_copies.push((g, c));
            self.stats.host_cache_evictions_saved += 1;
        }
    }

    /// A prefix hit on host block `c`: device block `g` (refcount 1, fresh) gets its
    /// content by a pending (cpu, gpu) copy and joins the device cache.
    pub(super) fn bring_back_host_hit(&mut self, c: BlockId, g: BlockId, hash: u64, parent: u64, tokens: &[u32]) {
        self.cpu.retain(c, 1);
        self.host_pins.1.push(c);
        self.pending_hit_copies.push((c, g));
        self.gpu.cache.insert(g, hash, parent, tokens);
    }

    /// Host blocks pinned by copies not yet completed (handed out or not).
    pub fn num_pinned_host_blocks(&self) -> usize {
        self.host_pins.0.len() + self.host_pins.1.len() + self.inflight_pins.values().map(Vec::len).sum::<usize>()
    }
}
