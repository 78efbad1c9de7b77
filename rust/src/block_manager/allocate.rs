//! Prompt allocation with prefix reuse, and commit, which makes full blocks reusable.
//!
//! ```text
//!  prompt      | b0 | b1 | b2 | b3 |t t|     eligible for hits: (len - 1) / bs blocks,
//!  lookup        hit  hit  miss  -          so at least one token is always computed
//!  table       | h0 | h1 | n0 | n1 | n2 |   h = cached blocks (refcount + 1), n = new
//! ```
//! The lookup stops at the first miss. A hit on an evictable block costs one free
//! block (it leaves the evictable set); a hit on a block in use costs none. A manager
//! with a sliding window looks up differently (see `window`): leading blocks outside
//! the window become placeholders.

use super::plan::{Hit, Plan};
use super::prefix_cache::block_hash;
use super::window::NULL_BLOCK;
use super::{BlockManager, Sequence, PLACEHOLDER_TOKEN};
use crate::error::{invalid, BlockId, CoreError, SeqId, Tier, TokenId};

impl BlockManager {
    fn plan(&self, tokens: &[TokenId], root: u64) -> Plan {
        let bs = self.cfg.block_size;
        let num_blocks = tokens.len().div_ceil(bs);
        if let Some(window) = self.cfg.sliding_window {
            return self.window_plan(tokens, window, root);
        }
        let mut plan = Plan { skipped: 0, hits: Vec::new(), hashes: Vec::new(), cost: num_blocks };
        if !self.cfg.enable_prefix_caching {
            return plan;
        }
        let mut parent = root;
        for block in tokens[..tokens.len() - 1].chunks_exact(bs) {
            let h = block_hash(parent, block);
            let Some(hit) = self.find_hit(h, parent, block) else { break };
            if matches!(hit, Hit::Gpu(b) if self.gpu.refs.get(b) > 0) {
                plan.cost -= 1; // shared with a running sequence: costs no free block
            }
            plan.hits.push(hit);
            plan.hashes.push(h);
            parent = h;
        }
        plan
    }

    /// Where the block hashed `h` (after `parent`, holding `block`) is cached: the device
    /// first (a block the step being planned writes counts, see `publish`), then the host
    /// and disk tiers.
    pub(super) fn find_hit(&self, h: u64, parent: u64, block: &[TokenId]) -> Option<Hit> {
        if let Some(b) = self.gpu.cache.lookup(h, parent, block).or_else(|| self.current_step_block(h, parent, block)) {
            Some(Hit::Gpu(b))
        } else if let Some(c) = self.lower_lookup(Tier::Cpu, h, parent, block) {
            Some(Hit::Host(c))
        } else {
            self.lower_lookup(Tier::Disk, h, parent, block).map(Hit::Disk)
        }
    }

    fn lower_lookup(&self, tier: Tier, h: u64, parent: u64, block: &[TokenId]) -> Option<BlockId> {
        if !self.caches_pages(tier) {
            return None;
        }
        self.pool(tier).cache.lookup(h, parent, block)
    }

    fn check_prompt(&self, seq: Option<SeqId>, tokens: &[TokenId]) -> Result<(), CoreError> {
        if tokens.is_empty() {
            let who = seq.map_or(String::new(), |s| format!(" of sequence {s}"));
            return Err(invalid!("a prompt{who} needs at least one token, got 0"));
        }
        Ok(())
    }

    /// Free device blocks `allocate(tokens)` would consume (see the module diagram).
    pub fn num_blocks_to_allocate(&self, tokens: &[TokenId]) -> usize {
        self.num_blocks_to_allocate_under(tokens, self.root)
    }

    /// [`num_blocks_to_allocate`](Self::num_blocks_to_allocate) for a chain seeded by
    /// `root` (see [`salted_root`](Self::salted_root)).
    pub fn num_blocks_to_allocate_under(&self, tokens: &[TokenId], root: u64) -> usize {
        if tokens.is_empty() {
            return 0;
        }
        self.plan(tokens, root).cost
    }

    /// Leading tokens `allocate(_, tokens)` would find cached (its return value).
    pub fn num_cached_tokens(&self, tokens: &[TokenId]) -> usize {
        self.num_cached_tokens_under(tokens, self.root)
    }

    /// [`num_cached_tokens`](Self::num_cached_tokens) for a chain seeded by `root`.
    pub fn num_cached_tokens_under(&self, tokens: &[TokenId], root: u64) -> usize {
        if tokens.is_empty() {
            return 0;
        }
        let plan = self.plan(tokens, root);
        (plan.skipped + plan.hits.len()) * self.cfg.block_size
    }

    /// Whether `allocate(_, tokens)` would succeed now.
    pub fn can_allocate(&self, tokens: &[TokenId]) -> bool {
        !tokens.is_empty() && self.plan(tokens, self.root).cost <= self.gpu.num_free()
    }

    /// Pages for the whole prompt, reusing cached blocks of an equal prefix. Returns how
    /// many leading tokens already have K/V: a multiple of block_size, < tokens.len().
    ///
    /// On OutOfBlocks nothing changes, counters included: the scheduler retries a
    /// failed allocation later and must not count its queries twice.
    pub fn allocate(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<usize, CoreError> {
        self.allocate_under(seq, tokens, self.root)
    }

    /// [`allocate`](Self::allocate) for a chain seeded by `root` (a salted prompt's, see
    /// [`salted_root`](Self::salted_root)); the sequence keeps hashing under it.
    pub fn allocate_under(&mut self, seq: SeqId, tokens: &[TokenId], root: u64) -> Result<usize, CoreError> {
        if self.seqs.contains_key(&seq) {
            return Err(invalid!("sequence id {seq} is already allocated; free it first or use a new id"));
        }
        self.check_prompt(Some(seq), tokens)?;
        let plan = self.plan(tokens, root);
        if let Some(ev) = &mut self.kv_events {
            ev.roots.insert(root);
        }
        let available = self.gpu.num_free();
        if plan.cost > available {
            return Err(CoreError::OutOfBlocks { tier: Tier::Gpu, needed: plan.cost, available });
        }
        let bs = self.cfg.block_size;
        let num_blocks = tokens.len().div_ceil(bs);
        // Hold every hit first (a lower tier's hit as the pin of its copy back), so that
        // the evictions of taking new blocks, which cascade down the tiers, cannot reuse them.
        let mut table = vec![NULL_BLOCK; plan.skipped];
        table.reserve(num_blocks - plan.skipped);
        let (mut num_host_hits, mut num_disk_hits) = (0, 0);
        for hit in &plan.hits {
            match *hit {
                Hit::Gpu(b) => {
                    self.gpu.cache.note_hit(b);
                    self.gpu.retain(b, 1);
                    table.push(b);
                    continue;
                }
                Hit::Host(c) => {
                    num_host_hits += 1;
                    self.cpu.cache.note_hit(c);
                    self.cpu.retain(c, 1);
                }
                Hit::Disk(d) => {
                    num_disk_hits += 1;
                    self.disk.cache.note_hit(d);
                    self.disk.retain(d, 1);
                }
            }
            table.push(BlockId::MAX); // filled below
        }
        let num_hits = plan.skipped + plan.hits.len();
        self.take_gpu(num_host_hits + num_disk_hits + num_blocks - num_hits).expect("cost was checked");
        let mut fresh = std::mem::take(&mut self.taken);
        let mut fresh_iter = fresh.iter().copied();
        for (i, hit) in plan.hits.iter().enumerate().map(|(j, hit)| (plan.skipped + j, hit)) {
            let (tier, src) = match *hit {
                Hit::Gpu(_) => continue,
                Hit::Host(c) => (Tier::Cpu, c),
                Hit::Disk(d) => (Tier::Disk, d),
            };
            let g = fresh_iter.next().expect("took one per lower-tier hit");
            table[i] = g;
            let parent = if i == 0 { root } else { plan.hashes[i - 1] };
            self.bring_back(tier, src, g, plan.hashes[i], parent, &tokens[i * bs..(i + 1) * bs]);
        }
        table.extend(fresh_iter);
        fresh.clear();
        self.taken = fresh;

        if self.cfg.enable_prefix_caching {
            self.stats.prefix_queries += ((tokens.len() - 1) / bs) as u64;
            self.stats.prefix_hits += num_hits as u64;
            self.stats.host_cache_hits += num_host_hits as u64;
            self.stats.disk_cache_hits += num_disk_hits as u64;
            let parent = plan.hashes.last().copied().unwrap_or(root);
            self.count_misses(tokens, num_hits, parent);
        }
        let mut seq_state = Sequence::on_device(table, tokens.to_vec(), plan.hashes, num_hits * bs, plan.skipped, root);
        seq_state.hit_blocks = [num_hits - num_host_hits - num_disk_hits, num_host_hits, num_disk_hits];
        self.seqs.insert(seq, seq_state);
        Ok(num_hits * bs)
    }

    /// Gives the token at `pos` of `seq`, recorded as [`PLACEHOLDER_TOKEN`] while its step
    /// was planned before it was sampled (asynchronous scheduling), and hashes the blocks
    /// it completes up to the committed count (they become prefix-cache hits like any other,
    /// once their step is reported done). A swapped-out sequence is hashed when it commits next.
    /// `in_flight`: the step that computes `pos` is still open, the one being planned last
    /// (its publication waits for it, as a commit's does); otherwise the blocks are published now.
    pub fn set_token(&mut self, seq: SeqId, pos: usize, token: TokenId, in_flight: bool) -> Result<(), CoreError> {
        let s = self.seqs.get_mut(&seq).ok_or(CoreError::UnknownSequence(seq))?;
        match s.tokens.get_mut(pos) {
            Some(t) if *t == PLACEHOLDER_TOKEN => *t = token,
            Some(t) => return Err(invalid!("set_token of sequence {seq}: position {pos} holds token {t}, not a placeholder")),
            None => return Err(invalid!("set_token of sequence {seq}: position {pos} is past its {} tokens", s.tokens.len())),
        }
        let (committed, swapped) = (s.committed, s.swapped());
        if swapped {
            return Ok(());
        }
        let defer = self.defer_publish;
        self.defer_publish = defer && in_flight;
        let done = self.commit(seq, committed);
        self.defer_publish = defer;
        done
    }

    /// Declares the K/V of the first `num_computed_tokens` tokens written (or written in
    /// this step before anything reads it). Full blocks up to there join the prefix
    /// cache; a block merely reserved for a prompt still being prefilled never does.
    /// A count below the current one changes nothing.
    pub fn commit(&mut self, seq: SeqId, num_computed_tokens: usize) -> Result<(), CoreError> {
        let s = self.seq_on_device(seq, "commit")?;
        if num_computed_tokens > s.tokens.len() {
            return Err(invalid!(
                "commit of sequence {seq}: num_computed_tokens = {num_computed_tokens} exceeds its {} tokens",
                s.tokens.len()
            ));
        }
        let caching = self.cfg.enable_prefix_caching;
        let bs = self.cfg.block_size;
        let mut s = self.seqs.remove(&seq).expect("checked above");
        s.committed = s.committed.max(num_computed_tokens);
        if caching {
            for i in s.hashes.len()..s.committed / bs {
                let parent = s.parent_hash(i);
                let block = &s.tokens[i * bs..(i + 1) * bs];
                if block.contains(&PLACEHOLDER_TOKEN) {
                    break; // its token is not known yet (asynchronous scheduling): hashed once set_token gives it
                }
                let h = block_hash(parent, block);
                // Already hashed (shared with a fork that committed first) or the same content
                // cached in another block: either way this block stays as it is. A placeholder
                // (released out of the sliding window) has no page; its hash keeps the chain.
                // In the scheduler's mode the block is a hit only once its step completes.
                if s.table[i] != NULL_BLOCK {
                    self.publish_or_defer(s.table[i], h, parent, block);
                }
                s.hashes.push(h);
            }
        }
        self.seqs.insert(seq, s);
        Ok(())
    }
}
