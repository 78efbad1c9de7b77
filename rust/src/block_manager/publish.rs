//! Deferred publication: a device block becomes a prefix-cache hit only once the step
//! that writes its K/V is reported complete (the scheduler's mode, `set_defer_publish`).
//!
//! A step writes device pages three ways: its forward pass (blocks `commit` fills),
//! copies from a lower tier (prefix hits brought back, `bring_back`), and swap-ins. If the
//! step fails, none of these may ever be served to another request: the K/V was not
//! written, or written from a page that failed its checksum. So in this mode the three
//! record an [`Entry`] instead of inserting the block into the device cache:
//!
//! ```text
//!   schedule (step s)               complete_step(s, ok)
//!   commit / bring_back / swap_in   ok:   insert each entry's block into the device cache
//!     → Entry { step s, block, ..}  fail: forget the entries (the blocks stay unhashed)
//!     + one pin on the block        either way the pin is released
//! ```
//!
//! The pin (one refcount, like a copy-on-write pin) keeps the block from being reused
//! while its fate is open, even when its sequence is freed in between (an abort while a
//! step is in flight): an unpublished block can go back to the pool only after the
//! decision. Within the step being planned the entries are visible to prefix lookups
//! (`find_hit`), because every sequence that reads them is in the same step: they
//! succeed or fail together, and within one layer every K/V write of a step happens
//! before any attention read. Entries of earlier steps still in flight are not visible:
//! a later step must not depend on an earlier one that may still fail.

use std::collections::HashMap;

use super::BlockManager;
use crate::error::{BlockId, TokenId};

/// A device block waiting for its step to be reported.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    step: u64,
    block: BlockId,
    hash: u64,
    parent: u64,
    tokens: Vec<TokenId>,
}

/// The entries of every step not yet reported, oldest first.
#[derive(Default)]
pub(crate) struct Publications {
    entries: Vec<Entry>,
    /// The step being planned: its entries are found by `lookup`.
    current: Option<u64>,
    /// hash → index in `entries`, for the current step's entries only.
    index: HashMap<u64, usize>,
}

impl Publications {
    /// Blocks pinned by entries (one pin per entry).
    pub(crate) fn pinned(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.entries.iter().map(|e| e.block)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The current step's block caching `tokens` after `parent` under `hash`, if any.
    pub(crate) fn lookup(&self, hash: u64, parent: u64, tokens: &[TokenId]) -> Option<BlockId> {
        let e = &self.entries[*self.index.get(&hash)?];
        (e.parent == parent && e.tokens == tokens).then_some(e.block)
    }
}

impl BlockManager {
    /// Scheduler mode: device blocks a step writes join the prefix cache only when
    /// [`complete_step`](Self::complete_step) reports that step done (see `publish`).
    /// Off (the plain BlockManager API), `commit` caches at once, as DESIGN.md says.
    pub fn set_defer_publish(&mut self, on: bool) {
        self.defer_publish = on;
    }

    /// Starts planning step `step` (ids increase): entries recorded from now on belong
    /// to it and are visible to lookups until the next `begin_step`.
    pub fn begin_step(&mut self, step: u64) {
        self.publications.current = Some(step);
        self.publications.index.clear();
    }

    /// Step `step` is done: `ok` publishes the device blocks it wrote (where no other
    /// block caches the same content by now), otherwise they are forgotten. Either way
    /// their pins go; a block nobody else holds becomes evictable (published) or free.
    /// Returns how many entries were decided.
    pub fn complete_step(&mut self, step: u64, ok: bool) -> usize {
        let (mine, rest): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut self.publications.entries).into_iter().partition(|e| e.step == step);
        self.publications.entries = rest;
        self.reindex();
        for e in &mine {
            if ok {
                self.gpu.cache.insert(e.block, e.hash, e.parent, &e.tokens);
            }
            self.gpu.release(e.block, 1);
        }
        self.gpu.flush();
        mine.len()
    }

    /// Device pages whose content is lost (a failed step may have half written them): each
    /// leaves the device cache, and an entry still waiting for its step is forgotten when
    /// that step is reported failed. Blocks not cached are ignored.
    pub fn forget_device_pages(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if (b as usize) < self.cfg.num_gpu_blocks {
                if let Some(h) = self.gpu.forget(b) {
                    self.misses.record(h, super::MissReason::Invalidated);
                }
            }
        }
    }

    /// Device blocks waiting for their step's report (for tests and stats).
    pub fn num_unpublished_blocks(&self) -> usize {
        self.publications.len()
    }

    /// Caches device block `b` as the page `hash` now, or, in deferred mode, records it
    /// for the step being planned (pinned until that step is reported).
    pub(super) fn publish_or_defer(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[TokenId]) {
        if !self.defer_publish {
            self.gpu.cache.insert(b, hash, parent, tokens);
            return;
        }
        if self.gpu.cache.hash_of(b).is_some() || self.gpu.cache.contains_hash(hash) || self.publications.index.contains_key(&hash) {
            return; // already cached (published earlier), or the same content elsewhere
        }
        let step = self.publications.current.unwrap_or(0);
        self.gpu.retain(b, 1);
        let i = self.publications.entries.len();
        self.publications.entries.push(Entry { step, block: b, hash, parent, tokens: tokens.to_vec() });
        self.publications.index.insert(hash, i);
    }

    /// The current step's block for `hash`, if it wrote one (see the module docs).
    pub(super) fn current_step_block(&self, hash: u64, parent: u64, tokens: &[TokenId]) -> Option<BlockId> {
        self.publications.lookup(hash, parent, tokens)
    }

    fn reindex(&mut self) {
        let p = &mut self.publications;
        p.index.clear();
        if let Some(cur) = p.current {
            for (i, e) in p.entries.iter().enumerate().filter(|(_, e)| e.step == cur) {
                p.index.insert(e.hash, i);
            }
        }
    }
}
