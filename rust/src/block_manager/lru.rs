//! The evictable set of one tier: cached blocks with no user, least recently used first.
//!
//! An intrusive doubly-linked list over block ids (`prev`/`next` arrays), so that a
//! prefix hit can take a block out of the middle in O(1), the reason vLLM's
//! `FreeKVCacheBlockQueue` is a linked list rather than a deque.

use crate::error::BlockId;

/// Marks "no block" in `prev`/`next` and "not in the list" in `prev` of a detached block.
const NONE: u32 = u32::MAX;
/// `prev` of a block that is not in the list (distinct from `NONE`, which marks the head).
const DETACHED: u32 = u32::MAX - 1;

pub(crate) struct EvictableList {
    /// `prev[b]`: the block before `b` (`NONE` at the head), or `DETACHED`.
    prev: Vec<u32>,
    /// `next[b]`: the block after `b` (`NONE` at the tail); meaningless when detached.
    next: Vec<u32>,
    /// Least recently released block, evicted first.
    head: u32,
    /// Most recently released block.
    tail: u32,
    len: usize,
}

impl EvictableList {
    pub(crate) fn new(num_blocks: usize) -> Self {
        EvictableList { prev: vec![DETACHED; num_blocks], next: vec![NONE; num_blocks], head: NONE, tail: NONE, len: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn contains(&self, b: BlockId) -> bool {
        self.prev[b as usize] != DETACHED
    }

    /// Appends `b` as the most recently used block. `b` must be detached.
    pub(crate) fn push_back(&mut self, b: BlockId) {
        debug_assert!(!self.contains(b), "block {b} is already evictable");
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NONE;
        if self.tail == NONE {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.len += 1;
    }

    /// Takes `b` out of the list, wherever it is. `b` must be in the list.
    pub(crate) fn remove(&mut self, b: BlockId) {
        debug_assert!(self.contains(b), "block {b} is not evictable");
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NONE {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = DETACHED;
        self.len -= 1;
    }

    /// Takes the least recently used block out.
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NONE {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Blocks from least to most recently used.
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cursor = self.head;
        std::iter::from_fn(move || {
            (cursor != NONE).then(|| {
                let b = cursor;
                cursor = self.next[b as usize];
                b
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order_and_middle_removal() {
        let mut l = EvictableList::new(6);
        for b in [4, 1, 3, 5] {
            l.push_back(b);
        }
        l.remove(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![4, 1, 5]);
        assert_eq!(l.pop_front(), Some(4));
        l.push_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 5, 3]);
        assert!(l.contains(5) && !l.contains(4));
        l.remove(3);
        l.remove(1);
        assert_eq!(l.pop_front(), Some(5));
        assert_eq!(l.pop_front(), None);
        assert_eq!(l.len(), 0);
    }
}
