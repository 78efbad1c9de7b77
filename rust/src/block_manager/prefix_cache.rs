//! Content addressing of full, committed blocks of one tier: chained hashes, the
//! hash → block map, each cached block's tokens, and the evictable set (see `eviction`).
//!
//! A block's hash is `xxh3(tokens of the block, seed = hash of the previous block)`,
//! the first block seeded by the root (which folds in the optional cache salt). A hit
//! compares the stored tokens and the stored parent hash too, so a 64-bit collision
//! can never share the K/V of different tokens.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::eviction::{EvictionPolicy, EvictionPolicyKind};
use super::kv_events::{PageEvent, TierLog};
use crate::error::{BlockId, TokenId};

/// Seed of the first block's hash when there is no cache salt.
const ROOT_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// The seed of a sequence's first block: salted prompts never share blocks with others.
pub(crate) fn root_seed(salt: Option<u64>) -> u64 {
    match salt {
        None => ROOT_SEED,
        Some(s) => xxhash_rust::xxh3::xxh3_64_with_seed(&s.to_le_bytes(), ROOT_SEED),
    }
}

/// The seed of the chains of prompts salted with `salt` (a per-request cache salt) under
/// the manager's `root`; `None` keeps `root`. Domain-separated from block hashes.
pub(crate) fn salted_root(root: u64, salt: Option<&[u8]>) -> u64 {
    match salt {
        None => root,
        Some(s) => {
            let mut bytes = Vec::with_capacity(s.len() + 16);
            bytes.extend_from_slice(b"pagedrs-salt\0");
            bytes.extend_from_slice(s);
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, root)
        }
    }
}

/// The chained hash of one full block.
#[inline]
///
/// The token ids are hashed as little-endian bytes on every machine, so a hash written
/// to disk (the disk page tier) means the same on a big-endian reader.
pub(crate) fn block_hash(parent: u64, tokens: &[TokenId]) -> u64 {
    if cfg!(target_endian = "little") {
        // SAFETY: `u32` has no padding and every byte pattern is a valid `u8`; the byte
        // slice covers exactly the memory of `tokens` and lives no longer than it. On a
        // little-endian target these are the tokens' little-endian bytes.
        let bytes = unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) };
        xxhash_rust::xxh3::xxh3_64_with_seed(bytes, parent)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent)
    }
}

/// The chained hashes of the full blocks of `tokens`, seeded as a scheduler seeds a prompt
/// salted with `salt` (its manager unsalted, as the engine builds it): what a replica's
/// prefix cache and its KV events call these blocks, so a router outside the replica can
/// score a prompt against a replica's cached hashes exactly.
pub fn prompt_block_hashes(tokens: &[TokenId], block_size: usize, salt: Option<&[u8]>) -> Vec<u64> {
    let mut parent = salted_root(root_seed(None), salt);
    if block_size == 0 {
        return Vec::new();
    }
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = block_hash(parent, block);
            parent
        })
        .collect()
}

/// Hasher for keys that are already well-mixed (xxh3 hashes) or small ids: one multiply.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01B3);
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        // Fibonacci hashing; the rotate brings the well-mixed high bits to the bucket bits.
        self.0 = x.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64)
    }
}

pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The prefix cache of one tier.
pub(crate) struct PrefixCache {
    block_size: usize,
    /// Content hash → the block caching it. `map[h] == b` iff `hash[b] == Some(h)`.
    map: IdMap<u64, BlockId>,
    /// `hash[b]`: set once when `b` is full and committed, cleared when evicted.
    hash: Vec<Option<u64>>,
    /// `parent[b]`: the seed `hash[b]` was computed with (meaningful while hashed).
    parent: Vec<u64>,
    /// `tokens[b * bs .. (b + 1) * bs]`: the tokens whose K/V block `b` caches.
    tokens: Vec<TokenId>,
    /// Cached blocks with refcount 0, in the order the eviction policy gives them up.
    pub(crate) evictable: Box<dyn EvictionPolicy>,
    /// Every insert and uncache, while KV events are on (see `kv_events`).
    pub(crate) log: Option<TierLog>,
}

impl PrefixCache {
    pub(crate) fn new(num_blocks: usize, block_size: usize, policy: EvictionPolicyKind) -> Self {
        PrefixCache {
            block_size,
            map: IdMap::default(),
            hash: vec![None; num_blocks],
            parent: vec![0; num_blocks],
            tokens: vec![0; num_blocks * block_size],
            evictable: policy.build(num_blocks),
            log: None,
        }
    }

    /// The block caching `tokens` after the prefix hashed to `parent`, if any.
    #[inline]
    pub(crate) fn lookup(&self, hash: u64, parent: u64, tokens: &[TokenId]) -> Option<BlockId> {
        let &b = self.map.get(&hash)?;
        (self.parent[b as usize] == parent && self.block_tokens(b) == tokens).then_some(b)
    }

    /// A prefix hit on cached block `b` (its eviction policy may count it).
    #[inline]
    pub(crate) fn note_hit(&mut self, b: BlockId) {
        self.evictable.record_use(b);
    }

    pub(crate) fn contains_hash(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    #[inline]
    pub(crate) fn hash_of(&self, b: BlockId) -> Option<u64> {
        self.hash[b as usize]
    }

    pub(crate) fn parent_of(&self, b: BlockId) -> u64 {
        self.parent[b as usize]
    }

    #[inline]
    pub(crate) fn block_tokens(&self, b: BlockId) -> &[TokenId] {
        let start = b as usize * self.block_size;
        &self.tokens[start..start + self.block_size]
    }

    /// Caches `b` under `hash`. Returns `false`, changing nothing, when `b` is already
    /// hashed or another block already caches `hash` (the same content computed twice:
    /// the second copy stays uncached and is freed, not kept, on release).
    pub(crate) fn insert(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[TokenId]) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.hash[b as usize].is_some() || self.map.contains_key(&hash) {
            return false;
        }
        self.map.insert(hash, b);
        self.hash[b as usize] = Some(hash);
        self.parent[b as usize] = parent;
        let start = b as usize * self.block_size;
        self.tokens[start..start + self.block_size].copy_from_slice(tokens);
        if let Some(log) = &mut self.log {
            log.push(PageEvent::Stored { hash, parent, tokens: tokens.to_vec() });
        }
        true
    }

    /// Forgets `b`'s content (its tokens stay readable until it is cached again).
    /// Returns the hash it had.
    pub(crate) fn uncache(&mut self, b: BlockId) -> Option<u64> {
        let hash = self.hash[b as usize].take()?;
        self.evictable.forget(b);
        let removed = self.map.remove(&hash);
        debug_assert_eq!(removed, Some(b), "hash map and block hash disagree on block {b}");
        if let Some(log) = &mut self.log {
            log.push(PageEvent::Removed { hash });
        }
        Some(hash)
    }

    /// (hash, block) of every cached block, for invariant checks.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.map.iter().map(|(&h, &b)| (h, b))
    }

    pub(crate) fn num_cached(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hash_is_over_little_endian_token_bytes() {
        // The on-disk meaning: xxh3 over each token's 4 little-endian bytes, whatever the host.
        let bytes: Vec<u8> = [1u32, 0x0102_0304].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(block_hash(7, &[1, 0x0102_0304]), xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 7));
    }

    #[test]
    fn hit_needs_equal_tokens_and_parent() {
        let mut c = PrefixCache::new(4, 2, EvictionPolicyKind::Lru);
        let root = root_seed(None);
        let h = block_hash(root, &[1, 2]);
        assert!(c.insert(3, h, root, &[1, 2]));
        assert_eq!(c.lookup(h, root, &[1, 2]), Some(3));
        // Same hash key but other tokens or parent (as after a collision): no hit.
        assert_eq!(c.lookup(h, root, &[1, 3]), None);
        assert_eq!(c.lookup(h, root ^ 1, &[1, 2]), None);
        assert!(!c.insert(2, h, root, &[1, 2]), "duplicate content stays uncached");
        assert_eq!(c.uncache(3), Some(h));
        assert_eq!(c.lookup(h, root, &[1, 2]), None);
        assert_eq!(c.num_cached(), 0);
    }

    #[test]
    fn salt_and_chain_change_hashes() {
        let a = block_hash(root_seed(None), &[5, 6]);
        assert_ne!(a, block_hash(root_seed(Some(1)), &[5, 6]));
        assert_ne!(block_hash(a, &[7, 8]), block_hash(root_seed(None), &[7, 8]));
        assert_eq!(a, block_hash(root_seed(None), &[5, 6]));
    }
}
