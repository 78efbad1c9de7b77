//! KV events for routers: every page that joins or leaves a tier's prefix cache, as
//! vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, so an external router
//! (llm-d, Dynamo) can route by what each replica holds.
//!
//! The log is kept at the one place a page's cached state changes: each tier's
//! [`PrefixCache`](super::prefix_cache::PrefixCache) `insert` and `uncache`. Every
//! path (a step's publication, a page moved down a tier, an eviction, a lost page, a
//! disk seed) goes through those two, so the stream cannot miss one. A page moved down
//! a tier is a `Removed` on the upper tier and a `Stored` on the lower.
//!
//! ```text
//!   tier caches ── insert/uncache ──▶ TierLog (stamp, block event)   one per tier
//!   take_kv_events: merge the three logs by stamp, coalesce runs:
//!     Stored(gpu, h1, parent r) + Stored(gpu, h2, parent h1) → Stored(gpu, [h1, h2], r)
//! ```
//!
//! Off by default: with no log a cache change costs one `Option` test. Turning it on
//! announces what is cached already (a snapshot), so the stream alone rebuilds the cache.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Tier, TokenId};

/// One change of what the tiers cache, as a router reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive pages of one chain joined `tier`'s cache: `hashes[0]` follows
    /// `parent` (None: it is the first page of its chain), each next one the previous;
    /// `tokens` are all their tokens, block after block.
    Stored { tier: Tier, hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<TokenId> },
    /// Pages that left `tier`'s cache (evicted, moved down, or lost).
    Removed { tier: Tier, hashes: Vec<u64> },
    /// Every tier's cache was cleared (`reset_prefix_cache`).
    AllCleared,
}

/// A single page's change, stamped with the manager-wide order it happened in.
#[derive(Debug, Clone)]
pub(crate) enum PageEvent {
    Stored { hash: u64, parent: u64, tokens: Vec<TokenId> },
    Removed { hash: u64 },
}

/// The log of one tier's cache; the stamps come from a clock the three tiers share.
pub(crate) struct TierLog {
    pub(crate) tier: Tier,
    clock: Arc<AtomicU64>,
    pub(crate) events: Vec<(u64, PageEvent)>,
}

impl TierLog {
    pub(crate) fn new(tier: Tier, clock: Arc<AtomicU64>) -> Self {
        TierLog { tier, clock, events: Vec::new() }
    }

    pub(crate) fn push(&mut self, e: PageEvent) {
        let stamp = self.clock.fetch_add(1, Ordering::Relaxed);
        self.events.push((stamp, e));
    }
}

/// Merges the tiers' logs into the order the changes happened in and coalesces runs
/// (a chain stored on one tier in a row, removals from one tier in a row) into the
/// multi-block events vLLM sends. `is_root(parent)`: the parent is a chain seed, not a page.
pub(crate) fn merge(logs: [&mut TierLog; 3], is_root: impl Fn(u64) -> bool) -> Vec<KvEvent> {
    let mut all: Vec<(u64, Tier, PageEvent)> = Vec::new();
    for log in logs {
        let tier = log.tier;
        all.extend(log.events.drain(..).map(|(s, e)| (s, tier, e)));
    }
    all.sort_unstable_by_key(|(s, _, _)| *s);
    let mut out: Vec<KvEvent> = Vec::new();
    for (_, tier, e) in all {
        match (e, out.last_mut()) {
            (PageEvent::Stored { hash, parent, tokens }, Some(KvEvent::Stored { tier: t, hashes, tokens: toks, .. }))
                if *t == tier && hashes.last() == Some(&parent) =>
            {
                hashes.push(hash);
                toks.extend_from_slice(&tokens);
            }
            (PageEvent::Stored { hash, parent, tokens }, _) => {
                let parent = (!is_root(parent)).then_some(parent);
                out.push(KvEvent::Stored { tier, hashes: vec![hash], parent, tokens });
            }
            (PageEvent::Removed { hash }, Some(KvEvent::Removed { tier: t, hashes })) if *t == tier => hashes.push(hash),
            (PageEvent::Removed { hash }, _) => out.push(KvEvent::Removed { tier, hashes: vec![hash] }),
        }
    }
    out
}

/// What the manager keeps while KV events are on.
pub(crate) struct EventState {
    /// Chain seeds seen (the manager's root and each salted one): a page whose parent is
    /// one is the first of its chain (`parent_block_hash` None, as vLLM sends it).
    pub(crate) roots: std::collections::HashSet<u64>,
    /// A reset cleared every tier since the last take: `AllCleared` goes first.
    cleared: bool,
}

use super::BlockManager;

impl BlockManager {
    /// Turns KV events on (idempotent): from now on every change of a tier's cache is
    /// logged for [`take_kv_events`](Self::take_kv_events), and the first take starts
    /// with what is cached already (a `Stored` per page), so a subscriber needs nothing
    /// else to know the cache's contents.
    pub fn enable_kv_events(&mut self) {
        if self.kv_events.is_some() {
            return;
        }
        let clock = Arc::new(AtomicU64::new(0));
        let mut roots = std::collections::HashSet::new();
        roots.insert(self.root);
        self.kv_events = Some(EventState { roots, cleared: false });
        for tier in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
            let cache = &mut self.pool_mut(tier).cache;
            let mut log = TierLog::new(tier, clock.clone());
            let mut cached: Vec<(u64, super::BlockId)> = cache.entries().collect();
            cached.sort_unstable(); // a deterministic snapshot order
            for (hash, b) in cached {
                log.push(PageEvent::Stored { hash, parent: cache.parent_of(b), tokens: cache.block_tokens(b).to_vec() });
            }
            cache.log = Some(log);
        }
    }

    /// Whether KV events are on.
    pub fn kv_events_enabled(&self) -> bool {
        self.kv_events.is_some()
    }

    /// The changes of every tier's cache since the last take, in the order they
    /// happened (see the module docs); empty while events are off.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        let Some(state) = self.kv_events.as_mut() else { return Vec::new() };
        let cleared = std::mem::take(&mut state.cleared);
        let roots = &state.roots;
        let [g, c, d] = [&mut self.gpu.cache.log, &mut self.cpu.cache.log, &mut self.disk.cache.log];
        let (Some(g), Some(c), Some(d)) = (g, c, d) else { unreachable!("every tier logs while events are on") };
        let mut out = if cleared { vec![KvEvent::AllCleared] } else { Vec::new() };
        out.extend(merge([g, c, d], |p| roots.contains(&p)));
        self.stats.kv_events_published += out.len() as u64;
        out
    }

    /// Hashes of the pages `tier` caches now, sorted (what a subscriber's rebuild of the
    /// cache from the stream must equal).
    pub fn cached_hashes(&self, tier: Tier) -> Vec<u64> {
        let pool = match tier {
            Tier::Gpu => &self.gpu,
            Tier::Cpu => &self.cpu,
            Tier::Disk => &self.disk,
        };
        let mut h: Vec<u64> = pool.cache.entries().map(|(h, _)| h).collect();
        h.sort_unstable();
        h
    }

    /// A reset forgot every tier's pages: what the logs hold since the last take is
    /// superseded by one `AllCleared`.
    /// After an `AllCleared`: a `Stored` for every page `tier` still caches (pinned ones).
    pub(super) fn note_still_cached(&mut self, tier: Tier) {
        if self.kv_events.is_none() {
            return;
        }
        let cache = &mut self.pool_mut(tier).cache;
        let mut cached: Vec<(u64, super::BlockId)> = cache.entries().collect();
        cached.sort_unstable();
        let events: Vec<PageEvent> =
            cached.into_iter().map(|(hash, b)| PageEvent::Stored { hash, parent: cache.parent_of(b), tokens: cache.block_tokens(b).to_vec() }).collect();
        if let Some(log) = &mut cache.log {
            for event in events {
                log.push(event);
            }
        }
    }

    pub(super) fn note_all_cleared(&mut self) {
        let Some(state) = self.kv_events.as_mut() else { return };
        state.cleared = true;
        for tier in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
            if let Some(log) = &mut self.pool_mut(tier).cache.log {
                log.events.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::super::{BlockManager, BlockManagerConfig};
    use super::*;

    fn manager() -> BlockManager {
        let cfg = BlockManagerConfig { num_cpu_blocks: 3, host_cache_evicted: true, num_disk_blocks: 4, ..BlockManagerConfig::new(3, 2) };
        BlockManager::new(cfg).unwrap()
    }

    fn serve(bm: &mut BlockManager, seq: u64, prompt: &[u32]) {
        bm.allocate(seq, prompt).unwrap();
        bm.commit(seq, prompt.len()).unwrap();
        let ids: Vec<_> = bm.start_transfers(Vec::new(), Vec::new()).iter().map(|t| t.id).collect();
        bm.complete_transfers(&ids).unwrap();
        bm.free(seq).unwrap();
    }

    /// A subscriber's view: the hashes each tier holds, from the events alone.
    #[derive(Default)]
    struct Mirror(BTreeMap<Tier, BTreeSet<u64>>);

    impl Mirror {
        fn apply(&mut self, events: &[KvEvent]) {
            for e in events {
                match e {
                    KvEvent::Stored { tier, hashes, tokens, .. } => {
                        assert_eq!(tokens.len(), hashes.len() * 2, "block_size tokens per hash");
                        for h in hashes {
                            assert!(self.0.entry(*tier).or_default().insert(*h), "{h} stored twice on {tier}");
                        }
                    }
                    KvEvent::Removed { tier, hashes } => {
                        for h in hashes {
                            assert!(self.0.entry(*tier).or_default().remove(h), "{h} removed from {tier} but never stored");
                        }
                    }
                    KvEvent::AllCleared => self.0.clear(),
                }
            }
        }

        fn assert_equals(&self, bm: &BlockManager) {
            for tier in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
                let mine: Vec<u64> = self.0.get(&tier).map(|s| s.iter().copied().collect()).unwrap_or_default();
                assert_eq!(mine, bm.cached_hashes(tier), "tier {tier}");
            }
        }
    }

    #[test]
    fn off_by_default_and_logs_nothing() {
        let mut bm = manager();
        serve(&mut bm, 1, &[1, 2, 3, 4, 5]);
        assert!(!bm.kv_events_enabled());
        assert!(bm.take_kv_events().is_empty());
        assert!(bm.gpu.cache.log.is_none());
    }

    #[test]
    fn stream_rebuilds_every_tier_through_evictions_and_a_reset() {
        let mut bm = manager();
        serve(&mut bm, 1, &[1, 2, 3, 4, 5]); // cached before events are on: the snapshot tells
        bm.enable_kv_events();
        let mut mirror = Mirror::default();
        let snapshot = bm.take_kv_events();
        assert_eq!(snapshot.len(), 2, "one Stored per page already cached: {snapshot:?}");
        mirror.apply(&snapshot);
        mirror.assert_equals(&bm);
        let mut moved_down = false;
        for (i, p) in [[9u32, 9, 9, 9, 9], [8, 8, 8, 8, 8], [7, 7, 7, 7, 7], [1, 2, 3, 4, 5], [6, 6, 6, 6, 6]].iter().enumerate() {
            serve(&mut bm, 10 + i as u64, p);
            let events = bm.take_kv_events();
            moved_down |= events.iter().any(|e| matches!(e, KvEvent::Removed { tier: Tier::Gpu, .. }))
                && events.iter().any(|e| matches!(e, KvEvent::Stored { tier: Tier::Cpu | Tier::Disk, .. }));
            mirror.apply(&events);
            mirror.assert_equals(&bm);
        }
        assert!(moved_down, "an eviction moved a page down a tier: Removed above, Stored below");
        let (d, h, k) = bm.num_cached_blocks();
        assert!(d > 0 && h > 0 && k > 0, "every tier holds pages: {:?}", (d, h, k));

        bm.reset_prefix_cache().unwrap();
        serve(&mut bm, 30, &[4, 4, 4]);
        let events = bm.take_kv_events();
        assert_eq!(events[0], KvEvent::AllCleared);
        mirror.apply(&events);
        mirror.assert_equals(&bm);
        assert_eq!(bm.cached_hashes(Tier::Gpu).len(), 1);
    }

    #[test]
    fn a_chain_stored_in_one_go_is_one_event_with_no_parent() {
        let mut bm = manager();
        bm.enable_kv_events();
        serve(&mut bm, 1, &[1, 2, 3, 4, 5]);
        let events = bm.take_kv_events();
        let root = bm.root_hash();
        let h1 = super::super::prefix_cache::block_hash(root, &[1, 2]);
        let h2 = super::super::prefix_cache::block_hash(h1, &[3, 4]);
        assert_eq!(events, vec![KvEvent::Stored { tier: Tier::Gpu, hashes: vec![h1, h2], parent: None, tokens: vec![1, 2, 3, 4] }]);
        // A continuation of the chain names its parent page.
        serve(&mut bm, 2, &[1, 2, 3, 4, 5, 6]);
        let h3 = super::super::prefix_cache::block_hash(h2, &[5, 6]);
        assert_eq!(bm.take_kv_events(), vec![KvEvent::Stored { tier: Tier::Gpu, hashes: vec![h3], parent: Some(h2), tokens: vec![5, 6] }]);
    }
}
