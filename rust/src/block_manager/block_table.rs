//! Per-sequence block tables and the operations that grow, share and drop them:
//! append (with copy-on-write), fork and free.
//!
//! Block tables are append-only except for copy-on-write, which replaces the last
//! entry, swapping, which maps entries to the other tier (all of them: whole-sequence
//! swap; some: page-granular preemption, `page_swap`, so that one table may point at
//! device and host pages at once, `on_host` saying which), and the sliding window, which
//! turns leading entries into placeholders (`window::NULL_BLOCK`, no page).

use super::BlockManager;
use crate::error::{invalid, BlockId, CoreError, SeqId, TokenId};

/// One sequence's view of the cache.
#[derive(Debug, Clone)]
pub(crate) struct Sequence {
    /// Logical block i → physical block, on the tier `on_host[i]` names;
    /// `table.len() == ceil(tokens.len() / block_size)`.
    pub(crate) table: Vec<BlockId>,
    /// Whether entry i is a host block (else a device block); as long as `table`.
    pub(crate) on_host: Vec<bool>,
    /// How many entries of `on_host` are set.
    pub(crate) num_host: usize,
    /// Whether the sequence is *swapped* (paused: no append, commit or slots until
    /// `swap_in` brings every host entry back). Set by `swap_out` and by a
    /// `swap_out_pages` that moved a page, cleared by `swap_in`. Kept apart from
    /// `num_host > 0` because a sequence whose every page was released out of the
    /// window holds none, yet a `swap_out` of it must still pause it: the scheduler
    /// calls `swap_in` on it next, and that must not fail as "on the device".
    pub(crate) paused: bool,
    /// Every token recorded so far.
    pub(crate) tokens: Vec<TokenId>,
    /// Chain hashes of the leading full committed blocks (`hashes.len() * bs <= committed`).
    pub(crate) hashes: Vec<u64>,
    /// Tokens whose K/V is written (or written this step before anything reads it).
    pub(crate) committed: usize,
    /// Leading entries released out of the sliding window: each is `NULL_BLOCK`, uses no
    /// page, and lies wholly before `committed` (see `window`); never on the host.
    pub(crate) released: usize,
    /// The seed of this sequence's hash chain (the manager's root, or a salted one).
    pub(crate) root: u64,
    /// Blocks its allocation found cached, by the tier they were found on: device
    /// (window placeholders included), host, disk (see `reset::cached_tokens_by_tier`).
    pub(crate) hit_blocks: [usize; 3],
}

impl Sequence {
    /// A sequence on the device: every entry a device block (or a released placeholder).
    pub(crate) fn on_device(table: Vec<BlockId>, tokens: Vec<TokenId>, hashes: Vec<u64>, committed: usize, released: usize, root: u64) -> Self {
        Sequence {
            on_host: vec![false; table.len()],
            num_host: 0,
            paused: false,
            table,
            tokens,
            hashes,
            committed,
            released,
            root,
            hit_blocks: [0; 3],
        }
    }

    /// The hash of the block before block `i` of the chain (the root for the first).
    pub(crate) fn parent_hash(&self, i: usize) -> u64 {
        if i == 0 {
            self.root
        } else {
            self.hashes[i - 1]
        }
    }

    /// Paused by a swap: the sequence cannot run until it is swapped in.
    pub(crate) fn swapped(&self) -> bool {
        self.paused
    }

    /// (block, on the host) of every entry that holds a page (released ones hold none).
    pub(crate) fn pages(&self) -> impl DoubleEndedIterator<Item = (BlockId, bool)> + '_ {
        self.table[self.released..].iter().copied().zip(self.on_host[self.released..].iter().copied())
    }
}

impl BlockManager {
    /// New device blocks `append_tokens(seq, n new tokens)` would take, including a
    /// copy-on-write block when the last block is partially filled and shared.
    pub fn num_blocks_to_append(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError> {
        let s = self.seq_on_device(seq, "append to")?;
        Ok(self.append_cost(s, num_new_tokens).0)
    }

    /// Device blocks `seq` needs to run again with `num_new_tokens` more: what its
    /// `swap_in` takes (as `can_swap_in` counts: a block per host page, less the pages the
    /// device prefix cache still holds in use) and what the append then takes. A page
    /// swapped in is the sequence's own, so only a partial last page still on the device
    /// and shared is copied on write. Equal to [`num_blocks_to_append`](Self::num_blocks_to_append)
    /// for a sequence on the device.
    pub fn num_blocks_to_resume(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize, CoreError> {
        let s = self.seq(seq)?;
        let swap_in = if s.num_host > 0 { self.swap_in_plan(&[seq]).2 } else { 0 };
        Ok(swap_in + self.append_cost(s, num_new_tokens).0)
    }

    /// (blocks to take, whether the first of them replaces a shared partial last block).
    /// A last page on the host (a paused sequence's, see `num_blocks_to_resume`) comes back
    /// as the sequence's own, so only one still on the device can be shared. A partial last
    /// page the prefix cache holds (full for the sequence that hashed it: only a `truncate`
    /// into a page shared at the time leaves one) is copied too, even with no other user left:
    /// writing into it would change a cached page's content.
    fn append_cost(&self, s: &Sequence, num_new_tokens: usize) -> (usize, bool) {
        if num_new_tokens == 0 {
            return (0, false);
        }
        let bs = self.cfg.block_size;
        let len = s.tokens.len();
        let grow = (len + num_new_tokens).div_ceil(bs) - s.table.len();
        let last = s.table.len() - 1;
        let b = s.table[last];
        let cow = len % bs != 0 && !s.on_host[last] && (self.shared_on_device(b) || self.gpu.cache.hash_of(b).is_some());
        (grow + cow as usize, cow)
    }

    /// Whether another table uses device block `b` too (a copy-on-write pin is no user).
    fn shared_on_device(&self, b: BlockId) -> bool {
        let pins = self.cow_pins.iter().filter(|&&p| p == b).count() as u32;
        self.gpu.refs.get(b) - pins > 1
    }

    /// Scheduler mode: a copy on write keeps a pin on its source block until
    /// [`release_cow_pins`](Self::release_cow_pins).
    ///
    /// A step's runner copies the tier transfers first, then the copies on write (see
    /// `SchedulerOutput`). Without the pin, a source block whose other users leave later
    /// in the same step (a paused sharer moving its pages to the host, or dropped for
    /// recompute) goes back to the pool and can be the destination of one of this step's
    /// swap-ins: the swap-in then overwrites it before the copy on write reads it. The
    /// scheduler releases the pins when its step is planned: nothing takes a block again
    /// until the next step, and the runner has run the copies by then.
    pub fn set_pin_cow_sources(&mut self, on: bool) {
        self.pin_cow_sources = on;
    }

    /// Releases every copy-on-write pin (see [`set_pin_cow_sources`](Self::set_pin_cow_sources)).
    pub fn release_cow_pins(&mut self) {
        for b in std::mem::take(&mut self.cow_pins) {
            self.gpu.release(b, 1);
        }
        self.gpu.flush();
    }

    /// Device blocks held by copy-on-write pins now.
    pub fn num_cow_pins(&self) -> usize {
        self.cow_pins.len()
    }

    /// Records `tokens` appended to `seq`, growing its table on demand. Returns the
    /// copy-on-write pairs (src, dst) to copy before writing the new tokens' K/V: at most
    /// one, when the last block is partially filled and shared. A full shared block is
    /// never copied. All or nothing: on OutOfBlocks the sequence is unchanged.
    pub fn append_tokens(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<Vec<(BlockId, BlockId)>, CoreError> {
        let s = self.seq_on_device(seq, "append to")?;
        let (needed, cow) = self.append_cost(s, tokens.len());
        self.take_gpu(needed)?;
        let mut copies = Vec::new();
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let mut fresh = self.taken.iter().copied();
        if cow {
            let dst = fresh.next().expect("took the cow block");
            let last = s.table.last_mut().expect("partial block exists");
            let src = std::mem::replace(last, dst);
            if self.pin_cow_sources {
                self.cow_pins.push(src); // this table's user becomes the pin
            } else {
                self.gpu.release(src, 1); // shared (it keeps a user), or cached (it stays evictable)
            }
            copies.push((src, dst));
            self.stats.cow_copies += 1;
        }
        s.table.extend(fresh);
        s.on_host.resize(s.table.len(), false);
        s.tokens.extend_from_slice(tokens);
        Ok(copies)
    }

    /// A new sequence `child` sharing every page of `parent` (refcounts + 1, nothing
    /// allocated). The child inherits the parent's committed count and hashes.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CoreError> {
        if parent == child {
            return Err(invalid!("fork needs a child id other than the parent's, got {child} for both"));
        }
        if self.seqs.contains_key(&child) {
            return Err(invalid!("cannot fork {parent} into {child}: sequence {child} already exists"));
        }
        let copy = self.seq(parent)?.clone();
        for (b, host) in copy.pages() {
            let tier = if host { &mut self.cpu } else { &mut self.gpu };
            tier.retain(b, 1);
        }
        self.seqs.insert(child, copy);
        Ok(())
    }

    /// Drops the sequence. Pages with no other user become free; cached ones stay
    /// evictable, released last-block-first so that a prompt's tail is evicted first.
    pub fn free(&mut self, seq: SeqId) -> Result<(), CoreError> {
        let s = self.seqs.remove(&seq).ok_or(CoreError::UnknownSequence(seq))?;
        self.pinned.remove(&seq);
        for (b, host) in s.pages().rev() {
            let tier = if host { &mut self.cpu } else { &mut self.gpu };
            tier.release(b, 1);
        }
        self.gpu.flush();
        self.cpu.flush();
        Ok(())
    }
}
