//! The host tier as swap space: sequences swapped out as a whole, and swapped in
//! (every host entry of their tables, whether they left whole or page by page).
//!
//! Copies run in the order of `transfer::ORDER`, then copy-on-write pairs, then the
//! forward pass. Host blocks read by a swap-in are pinned (one refcount each) until its
//! transfer completes, so no swap in the same step reuses them.
//! A step must not swap the same blocks both ways: the scheduler swaps in only in a
//! step that preempted nothing (vLLM's rule). Placeholders (pages released out of the
//! sliding window, `window::NULL_BLOCK`) are never copied and stay placeholders.

use super::{BlockManager, SwapInStatus};
use crate::error::{invalid, BlockId, CoreError, SeqId, Tier};
use std::collections::HashMap;

impl BlockManager {
    /// Checks that `seqs` are distinct live sequences, all wholly on the device (`swapped`
    /// false) or all with host pages (`swapped` true).
    fn check_group(&self, seqs: &[SeqId], swapped: bool) -> Result<(), CoreError> {
        for (i, &id) in seqs.iter().enumerate() {
            if self.seq(id)?.swapped() != swapped {
                let (is, op) = if swapped { ("on the device", "swap in") } else { ("already swapped out", "swap out") };
                return Err(invalid!("cannot {op} sequence {id}: it is {is}"));
            }
            if seqs[..i].contains(&id) {
                return Err(invalid!("sequence {id} appears twice in the group to swap; each id once"));
            }
        }
        Ok(())
    }

    /// The distinct blocks of the group's tables on one tier (host entries when `host`),
    /// in first-use order, with how many of the group's table entries point at each.
    fn group_blocks(&self, seqs: &[SeqId], host: bool) -> Vec<(BlockId, u32)> {
        let mut index: HashMap<BlockId, usize> = HashMap::new();
        let mut blocks: Vec<(BlockId, u32)> = Vec::new();
        for id in seqs {
            let s = &self.seqs[id];
            for (b, _) in s.pages().filter(|&(_, h)| h == host) {
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
        Ok(self.group_blocks(seqs, false).len())
    }

    /// Moves the group to the host. Returns (gpu, cpu) copies, each device block once.
    /// A device block also used outside the group is copied and stays on the device for
    /// its other users; a cached one nobody uses any more stays cached and evictable.
    /// Host-cached pages the swap reclaims move on to the disk tier first: with a disk
    /// tier, run [`take_transfers`](Self::take_transfers) (or hand the pairs to
    /// `start_transfers`, as the scheduler does) before these copies.
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, CoreError> {
        self.check_group(seqs, false)?;
        let blocks = self.group_blocks(seqs, false);
        let mut host = Vec::with_capacity(blocks.len());
        let mut dropped = Vec::new();
        if !self.cpu.take(blocks.len(), &mut host, &mut dropped) {
            return Err(CoreError::OutOfBlocks { tier: Tier::Cpu, needed: blocks.len(), available: self.cpu.num_free() });
        }
        // Host-cached pages reclaimed for the swap move on to the disk tier first.
        self.demote(Tier::Cpu, &dropped);
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
            s.table[s.released..].iter_mut().for_each(|b| *b = to_host[b]);
            s.on_host[s.released..].fill(true);
            s.num_host = s.table.len() - s.released;
            s.paused = true;
        }
        self.stats.swap_out_blocks += copies.len() as u64;
        Ok(copies)
    }

    /// Whether the group fits on the device now, later, or never.
    pub fn can_swap_in(&self, seqs: &[SeqId]) -> Result<SwapInStatus, CoreError> {
        self.check_group(seqs, true)?;
        let needed = self.swap_in_plan(seqs).2;
        Ok(if needed > self.cfg.num_gpu_blocks {
            SwapInStatus::Never
        } else if needed <= self.gpu.num_free() {
            SwapInStatus::Ok
        } else {
            SwapInStatus::Later
        })
    }

    /// The group's host blocks (with their users), those whose content the device prefix
    /// cache still holds (host block → device block), and the device blocks a swap-in
    /// takes from the free count: one per other host block, plus each reused block that is
    /// evictable now.
    pub(super) fn swap_in_plan(&self, seqs: &[SeqId]) -> (Vec<(BlockId, u32)>, HashMap<BlockId, BlockId>, usize) {
        let blocks = self.group_blocks(seqs, true);
        let bs = self.cfg.block_size;
        let mut reuse: HashMap<BlockId, BlockId> = HashMap::new();
        for id in seqs {
            let s = &self.seqs[id];
            for (i, &h) in s.hashes.iter().enumerate() {
                if !s.on_host[i] || reuse.contains_key(&s.table[i]) {
                    continue;
                }
                let parent = s.parent_hash(i);
                if let Some(g) = self.gpu.cache.lookup(h, parent, &s.tokens[i * bs..(i + 1) * bs]) {
                    reuse.insert(s.table[i], g);
                }
            }
        }
        let mut evictable: Vec<BlockId> = reuse.values().copied().filter(|&g| self.gpu.refs.get(g) == 0).collect();
        evictable.sort_unstable();
        evictable.dedup();
        let needed = blocks.len() - reuse.len() + evictable.len();
        (blocks, reuse, needed)
    }

    /// Brings the group's host pages back to the device (entries already there stay).
    /// Returns (cpu, gpu) copies, each host block once. A committed page whose content
    /// the device prefix cache still holds (a paused sequence's page swapped out and not
    /// reclaimed since) comes back by reference, without a copy. Committed full blocks
    /// rejoin the device prefix cache where no other block caches their content.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>, CoreError> {
        self.check_group(seqs, true)?;
        let (blocks, reuse, needed) = self.swap_in_plan(seqs);
        if needed > self.gpu.num_free() {
            return Err(CoreError::OutOfBlocks { tier: Tier::Gpu, needed, available: self.gpu.num_free() });
        }
        let mut to_device: HashMap<BlockId, BlockId> = HashMap::with_capacity(blocks.len());
        // Reused blocks are retained first, so that taking the fresh ones cannot evict them.
        for &(c, users) in blocks.iter().filter(|(c, _)| reuse.contains_key(c)) {
            self.gpu.retain(reuse[&c], users);
            self.cpu.release(c, users);
            to_device.insert(c, reuse[&c]);
        }
        let blocks: Vec<(BlockId, u32)> = blocks.into_iter().filter(|(c, _)| !reuse.contains_key(c)).collect();
        self.take_gpu(blocks.len()).expect("counted above");
        let device = std::mem::take(&mut self.taken);
        let mut copies = Vec::with_capacity(blocks.len());
        for (&(c, users), &g) in blocks.iter().zip(&device) {
            self.gpu.refs.set_exclusive(g, users);
            if self.pin_swap_in_sources {
                // One user stays as the pin of the copy that reads it (see `transfer`).
                self.cpu.release(c, users - 1);
                self.pending.pin(Tier::Cpu, Tier::Gpu, (Tier::Cpu, c));
            } else {
                self.cpu.release(c, users);
            }
            copies.push((c, g));
            to_device.insert(c, g);
        }
        self.cpu.flush();
        self.gpu.flush();
        self.taken = device;
        let bs = self.cfg.block_size;
        for id in seqs {
            let mut s = self.seqs.remove(id).expect("checked");
            for (b, host) in s.table.iter_mut().zip(s.on_host.iter_mut()).filter(|(_, h)| **h) {
                *b = to_device[b];
                *host = false;
            }
            s.num_host = 0;
            s.paused = false;
            // In the scheduler's mode a page copied back is a hit once its step completes.
            for (i, &h) in s.hashes.iter().enumerate().skip(s.released) {
                self.publish_or_defer(s.table[i], h, s.parent_hash(i), &s.tokens[i * bs..(i + 1) * bs]);
            }
            self.seqs.insert(*id, s);
        }
        self.stats.swap_in_blocks += copies.len() as u64;
        Ok(copies)
    }

    /// A prefix hit on block `src` of `tier` (host or disk; the caller holds one
    /// refcount on it, the copy's pin): device block `g` (refcount 1, fresh) gets its
    /// content by a pending copy and joins the device cache.
    pub(super) fn bring_back(&mut self, tier: Tier, src: BlockId, g: BlockId, hash: u64, parent: u64, tokens: &[u32]) {
        self.pending.push(tier, Tier::Gpu, (src, g), Some((tier, src)));
        self.publish_or_defer(g, hash, parent, tokens);
    }
}
