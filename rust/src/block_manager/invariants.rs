//! `check_invariants`: every invariant of DESIGN.md that the manager can see by itself.
//! (Invariant 3, reading tokens back through the tables, needs the runner's memory; the
//! property tests simulate that memory and check it.)

use super::prefix_cache::block_hash;
use super::tier::TierPool;
use super::window::NULL_BLOCK;
use super::BlockManager;
use crate::error::{BlockId, Tier, TokenId, PLACEHOLDER_TOKEN};

impl BlockManager {
    /// Ok, or a description of the first broken invariant found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let bs = self.cfg.block_size;
        let mut gpu_users = vec![0u32; self.cfg.num_gpu_blocks];
        let mut cpu_users = vec![0u32; self.cfg.num_cpu_blocks];
        let mut disk_users = vec![0u32; self.cfg.num_disk_blocks];
        for &(tier, b) in self.pending.all_pins().chain(self.inflight_pins.values().flatten()) {
            let users = match tier {
                Tier::Cpu => &mut cpu_users,
                Tier::Disk => &mut disk_users,
                Tier::Gpu => return Err(format!("device block {b} is pinned; only host and disk blocks take pins")),
            };
            *users.get_mut(b as usize).ok_or_else(|| format!("pinned {tier} block {b} out of range"))? += 1;
        }
        for b in self.publications.pinned() {
            *gpu_users.get_mut(b as usize).ok_or_else(|| format!("publication pin on device block {b} out of range"))? += 1;
        }
        for &b in &self.cow_pins {
            *gpu_users.get_mut(b as usize).ok_or_else(|| format!("copy-on-write pin on device block {b} out of range"))? += 1;
        }
        // A pin (see `pins`) is a live sequence on the device, every block of it full,
        // committed and hashed: it never holds a page whose K/V is unwritten.
        for id in &self.pinned {
            let s = self.seqs.get(id).ok_or_else(|| format!("pin {id} is not a live sequence"))?;
            if s.paused || s.num_host > 0 || s.committed != s.tokens.len() || s.hashes.len() * bs != s.tokens.len() {
                return Err(format!("pin {id}: {} tokens, {} committed, {} hashed blocks, paused = {}", s.tokens.len(), s.committed, s.hashes.len(), s.paused));
            }
        }
        for (&id, s) in &self.seqs {
            if s.table.len() != s.tokens.len().div_ceil(bs) {
                return Err(format!("seq {id}: {} blocks for {} tokens of block size {bs}", s.table.len(), s.tokens.len()));
            }
            if s.committed > s.tokens.len() || s.hashes.len() * bs > s.committed {
                return Err(format!(
                    "seq {id}: committed {} / hashed blocks {} inconsistent with {} tokens",
                    s.committed,
                    s.hashes.len(),
                    s.tokens.len()
                ));
            }
            // Each entry is on exactly one tier: the one `on_host` names.
            if s.on_host.len() != s.table.len() || s.num_host != s.on_host.iter().filter(|&&h| h).count() {
                return Err(format!(
                    "seq {id}: {} tier flags ({} on the host, counted {}) for {} table entries",
                    s.on_host.len(),
                    s.on_host.iter().filter(|&&h| h).count(),
                    s.num_host,
                    s.table.len()
                ));
            }
            // A sequence with host pages is paused; a paused one without any holds no page.
            if (s.num_host > 0 && !s.paused) || (s.paused && s.num_host == 0 && s.released != s.table.len()) {
                return Err(format!(
                    "seq {id}: paused = {} with {} host pages and {} of {} entries released",
                    s.paused,
                    s.num_host,
                    s.released,
                    s.table.len()
                ));
            }
            // Placeholders (released out of the sliding window) lead the table, wholly
            // before the committed tokens, and use no page.
            if s.released * bs > s.committed || s.table[..s.released].iter().any(|&b| b != NULL_BLOCK) {
                return Err(format!("seq {id}: {} released entries, committed {}: {:?}", s.released, s.committed, &s.table[..s.released]));
            }
            if s.on_host[..s.released].iter().any(|&h| h) {
                return Err(format!("seq {id}: a released entry is marked as on the host"));
            }
            if s.released > 0 && self.cfg.sliding_window.is_none() {
                return Err(format!("seq {id}: {} entries released without a sliding window", s.released));
            }
            for (b, host) in s.pages() {
                let (users, tier) = if host { (&mut cpu_users, "host") } else { (&mut gpu_users, "device") };
                *users.get_mut(b as usize).ok_or_else(|| format!("seq {id}: {tier} block {b} out of range"))? += 1;
            }
            for (i, &h) in s.hashes.iter().enumerate().skip(s.released) {
                let b = s.table[i];
                if s.on_host[i] {
                    continue;
                }
                // Invariant 4: a block that holds a hash holds this block's content.
                if let Some(bh) = self.gpu.cache.hash_of(b) {
                    if bh != h || self.gpu.cache.block_tokens(b) != &s.tokens[i * bs..(i + 1) * bs] {
                        return Err(format!("seq {id}: block {b} at index {i} is cached with other content"));
                    }
                }
            }
        }
        check_tier("gpu", &self.gpu, &gpu_users)?;
        check_tier("cpu", &self.cpu, &cpu_users)?;
        check_tier("disk", &self.disk, &disk_users)?;
        // A disk slot is only ever a cached page: in use means pinned by a copy.
        // (A slot invalidated while pinned caches nothing until its pin goes.)
        let uncached_in_use = |b: BlockId| self.disk.refs.get(b) > 0 && self.disk.cache.hash_of(b).is_none() && !self.disk_invalidated_pinned.contains(&b);
        if let Some(b) = (0..self.cfg.num_disk_blocks as BlockId).find(|&b| uncached_in_use(b)) {
            return Err(format!("disk: block {b} is in use but caches no page"));
        }
        if !self.cfg.host_cache_evicted && self.cpu.cache.num_cached() > 0 {
            return Err("host blocks are cached while host_cache_evicted is off".into());
        }
        Ok(())
    }
}

/// Invariants 1, 2, 4 (hash/map/content agreement) and 5 for one tier.
fn check_tier(name: &str, tier: &TierPool, users: &[u32]) -> Result<(), String> {
    let n = tier.num_blocks();
    let mut state = vec![0u8; n]; // 0 unseen, 1 free, 2 evictable
    let free = tier.pool.free_ids();
    if free.len() != tier.pool.num_free() {
        return Err(format!("{name}: free counter {} but {} blocks on the free stack", tier.pool.num_free(), free.len()));
    }
    for b in free {
        let i = b as usize;
        if i >= n || state[i] != 0 {
            return Err(format!("{name}: block {b} out of range or twice on the free stack"));
        }
        if tier.refs.get(b) != 0 || tier.cache.hash_of(b).is_some() {
            return Err(format!("{name}: free block {b} has refcount {} or a hash", tier.refs.get(b)));
        }
        state[i] = 1;
    }
    for b in tier.cache.evictable.iter() {
        let i = b as usize;
        if state[i] != 0 {
            return Err(format!("{name}: block {b} is both free and evictable, or evictable twice"));
        }
        if tier.refs.get(b) != 0 || tier.cache.hash_of(b).is_none() {
            return Err(format!("{name}: evictable block {b} has refcount {} or no hash", tier.refs.get(b)));
        }
        state[i] = 2;
    }
    let mut used = 0;
    for b in 0..n as BlockId {
        let rc = tier.refs.get(b);
        if rc != users[b as usize] {
            return Err(format!("{name}: block {b} has refcount {rc} but {} users", users[b as usize]));
        }
        if state[b as usize] == 0 {
            if rc == 0 {
                return Err(format!("{name}: block {b} is neither free, evictable nor used"));
            }
            used += 1;
        }
    }
    let (num_free, num_evictable) = (tier.pool.num_free(), tier.cache.evictable.len());
    if num_free + num_evictable + used != n {
        return Err(format!("{name}: free {num_free} + evictable {num_evictable} + used {used} != {n}"));
    }
    for (h, b) in tier.cache.entries() {
        if tier.cache.hash_of(b) != Some(h) {
            return Err(format!("{name}: hash map points {h:#x} at block {b}, which holds {:?}", tier.cache.hash_of(b)));
        }
        let tokens: &[TokenId] = tier.cache.block_tokens(b);
        if tokens.contains(&PLACEHOLDER_TOKEN) {
            return Err(format!("{name}: cached block {b} holds an unverified token (PLACEHOLDER_TOKEN)"));
        }
        if block_hash(tier.cache.parent_of(b), tokens) != h {
            return Err(format!("{name}: cached block {b}'s tokens do not hash to {h:#x}"));
        }
    }
    Ok(())
}
