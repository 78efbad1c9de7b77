//! Which cached page a tier gives up first when it needs a block: the eviction policy.
//!
//! A tier's evictable set holds its cached pages that nobody uses (refcount 0, hashed).
//! When the free pool is dry, [`EvictionPolicy::pop_victim`] names the page whose
//! content is dropped. Two policies:
//!
//! - [`Lru`] (the default, and DESIGN.md's promise for `bm.free`): the page released
//!   longest ago goes first. An intrusive list ([`EvictableList`]), O(1) everywhere.
//! - [`LfuAging`]: the least frequently used page goes first, with *dynamic aging*
//!   (LFU-DA, Arlitt, Cherkasova, Dilley, Friedrich and Jin, "Evaluating content
//!   management techniques for Web proxy caches", 2000): a page's key is
//!   `age + uses`, fixed when it becomes evictable, and `age` rises to the key of each
//!   page evicted. A page hit often long ago therefore does not stay for ever: once the
//!   tier has evicted enough pages, fresh pages' keys pass its own. Ties go to the page
//!   released longest ago (LRU among equals). SGLang's `--radix-eviction-policy lfu`
//!   orders by (hit count, last access); the aging is what keeps a once-hot prefix from
//!   pinning the cache after its traffic stopped. O(log n) per change (a `BTreeSet`).
//!
//! A *use* is a prefix hit on the page ([`EvictionPolicy::record_use`]), counted whether
//! the page was evictable or shared with a running sequence; the count goes with the
//! page's content ([`EvictionPolicy::forget`] when it is uncached).

use std::collections::BTreeSet;

use super::lru::EvictableList;
use crate::error::{invalid, BlockId, CoreError};

/// Which [`EvictionPolicy`] a manager's tiers use (`EngineArgs.eviction_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicyKind {
    /// Least recently released first.
    #[default]
    Lru,
    /// Least frequently used first, with dynamic aging (LFU-DA).
    Lfu,
}

impl EvictionPolicyKind {
    /// `"lru"` or `"lfu"`; anything else is an error naming what is allowed.
    pub fn parse(name: &str) -> Result<Self, CoreError> {
        match name {
            "lru" => Ok(EvictionPolicyKind::Lru),
            "lfu" => Ok(EvictionPolicyKind::Lfu),
            other => Err(invalid!("eviction_policy is {other:?}; allowed: \"lru\" or \"lfu\"")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicyKind::Lru => "lru",
            EvictionPolicyKind::Lfu => "lfu",
        }
    }

    /// An empty evictable set over blocks `0..num_blocks`.
    pub(crate) fn build(self, num_blocks: usize) -> Box<dyn EvictionPolicy> {
        match self {
            EvictionPolicyKind::Lru => Box::new(Lru(EvictableList::new(num_blocks))),
            EvictionPolicyKind::Lfu => Box::new(LfuAging::new(num_blocks)),
        }
    }
}

/// The evictable set of one tier, in the order its pages are given up.
pub(crate) trait EvictionPolicy: Send + Sync {
    fn len(&self) -> usize;
    fn contains(&self, b: BlockId) -> bool;
    /// Cached block `b` lost its last user: from now on it may be evicted. `b` is not in the set.
    fn push(&mut self, b: BlockId);
    /// `b` leaves the set (a prefix hit took it, or its content is forgotten). `b` is in the set.
    fn remove(&mut self, b: BlockId);
    /// Takes the page to evict next out of the set.
    fn pop_victim(&mut self) -> Option<BlockId>;
    /// The set, the next victim first.
    fn iter(&self) -> Box<dyn Iterator<Item = BlockId> + '_>;
    /// One more prefix hit on cached block `b` (in the set or not).
    fn record_use(&mut self, b: BlockId);
    /// `b`'s cached content is gone: its use count goes with it.
    fn forget(&mut self, b: BlockId);
}

/// Least recently released first: today's order, unchanged.
pub(crate) struct Lru(EvictableList);

impl EvictionPolicy for Lru {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn contains(&self, b: BlockId) -> bool {
        self.0.contains(b)
    }
    fn push(&mut self, b: BlockId) {
        self.0.push_back(b)
    }
    fn remove(&mut self, b: BlockId) {
        self.0.remove(b)
    }
    fn pop_victim(&mut self) -> Option<BlockId> {
        self.0.pop_front()
    }
    fn iter(&self) -> Box<dyn Iterator<Item = BlockId> + '_> {
        Box::new(self.0.iter())
    }
    fn record_use(&mut self, _b: BlockId) {}
    fn forget(&mut self, _b: BlockId) {}
}

/// Least frequently used first, with dynamic aging (see the module docs).
pub(crate) struct LfuAging {
    /// `uses[b]`: prefix hits on `b`'s current content.
    uses: Vec<u32>,
    /// `entry[b]`: `b`'s (key, release tick) while it is in the set.
    entry: Vec<Option<(u64, u64)>>,
    /// (key, release tick, block), the next victim first.
    order: BTreeSet<(u64, u64, BlockId)>,
    /// The aging term: the key of the latest victim (never decreases).
    age: u64,
    /// Counts pushes: breaks ties between equal keys by release order.
    tick: u64,
}

impl LfuAging {
    pub(crate) fn new(num_blocks: usize) -> Self {
        LfuAging { uses: vec![0; num_blocks], entry: vec![None; num_blocks], order: BTreeSet::new(), age: 0, tick: 0 }
    }
}

impl EvictionPolicy for LfuAging {
    fn len(&self) -> usize {
        self.order.len()
    }
    fn contains(&self, b: BlockId) -> bool {
        self.entry[b as usize].is_some()
    }
    fn push(&mut self, b: BlockId) {
        debug_assert!(!self.contains(b), "block {b} is already evictable");
        // One for the use that computed the page, plus its hits since.
        let key = self.age + 1 + self.uses[b as usize] as u64;
        self.tick += 1;
        self.entry[b as usize] = Some((key, self.tick));
        self.order.insert((key, self.tick, b));
    }
    fn remove(&mut self, b: BlockId) {
        let (key, tick) = self.entry[b as usize].take().expect("block is evictable");
        let removed = self.order.remove(&(key, tick, b));
        debug_assert!(removed, "entry and order disagree on block {b}");
    }
    fn pop_victim(&mut self) -> Option<BlockId> {
        let (key, _, b) = self.order.pop_first()?;
        self.entry[b as usize] = None;
        self.age = self.age.max(key);
        Some(b)
    }
    fn iter(&self) -> Box<dyn Iterator<Item = BlockId> + '_> {
        Box::new(self.order.iter().map(|&(_, _, b)| b))
    }
    fn record_use(&mut self, b: BlockId) {
        self.uses[b as usize] = self.uses[b as usize].saturating_add(1);
    }
    fn forget(&mut self, b: BlockId) {
        self.uses[b as usize] = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(p: &mut dyn EvictionPolicy) -> Vec<BlockId> {
        std::iter::from_fn(|| p.pop_victim()).collect()
    }

    #[test]
    fn lru_evicts_in_release_order_and_ignores_uses() {
        let mut p = EvictionPolicyKind::Lru.build(8);
        for b in [5, 2, 7, 0] {
            p.push(b);
        }
        p.record_use(5); // LRU counts no hits: 5 was released first, it goes first
        p.remove(7);
        assert_eq!(p.iter().collect::<Vec<_>>(), vec![5, 2, 0]);
        p.push(7);
        assert_eq!(drain(p.as_mut()), vec![5, 2, 0, 7]);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn lfu_evicts_least_used_first_ties_by_release_order() {
        let mut p = EvictionPolicyKind::Lfu.build(8);
        for _ in 0..3 {
            p.record_use(1);
        }
        p.record_use(4);
        for b in [1, 4, 6, 3] {
            p.push(b); // keys: 1 -> 4, 4 -> 2, 6 -> 1, 3 -> 1
        }
        assert_eq!(p.iter().collect::<Vec<_>>(), vec![6, 3, 4, 1]);
        assert!(p.contains(4) && !p.contains(0));
        p.remove(3);
        assert_eq!(drain(p.as_mut()), vec![6, 4, 1]);
    }

    #[test]
    fn lfu_ages_a_once_hot_page_out() {
        // Page 0 was hit 3 times (key 4). Each eviction raises the age to the victim's
        // key, so fresh single-use pages soon outrank it, and it goes before them.
        let mut p = EvictionPolicyKind::Lfu.build(16);
        for _ in 0..3 {
            p.record_use(0);
        }
        p.push(0);
        let mut evicted = Vec::new();
        let mut next = 1;
        while !evicted.contains(&0) {
            p.push(next);
            next += 1;
            evicted.push(p.pop_victim().unwrap());
        }
        // Pages 1..=3 arrive with keys 1, 2, 3 (the age rising with each victim); page 4
        // arrives with key 4 = page 0's, and page 0, released earlier, wins the tie.
        assert_eq!(evicted, vec![1, 2, 3, 0]);
        assert_eq!(p.iter().collect::<Vec<_>>(), vec![4]);
    }

    #[test]
    fn lfu_forget_drops_the_count() {
        let mut p = EvictionPolicyKind::Lfu.build(4);
        p.record_use(2);
        p.record_use(2);
        p.forget(2); // new content in block 2: it starts from nothing
        p.push(2);
        p.push(3);
        assert_eq!(drain(p.as_mut()), vec![2, 3]);
    }

    #[test]
    fn parse_names_what_is_allowed() {
        assert_eq!(EvictionPolicyKind::parse("lfu").unwrap(), EvictionPolicyKind::Lfu);
        let err = EvictionPolicyKind::parse("fifo").unwrap_err().to_string();
        assert!(err.contains("eviction_policy") && err.contains("\"lru\""), "{err}");
    }
}
