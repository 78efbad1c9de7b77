//! Property test: random operation sequences against a simple model with a simulated
//! physical memory (one token id per slot, per tier). After every operation the runner's
//! copies are applied to that memory and the new tokens written to their slots, then:
//! every invariant holds, every live sequence reads back exactly its tokens through its
//! table, prefix hits read back the right tokens, predicted block costs are exact, and a
//! failed call changed nothing. With a sliding window, positions before a sequence's
//! released pages (`NULL_BLOCK` entries) are exempt from reading back, and those
//! placeholders may only lie before the first position the sequence still needs.
//! Speculative decoding: drafts are appended as `PLACEHOLDER_TOKEN`, their K/V (the
//! draft's own token) written and committed, then a random number accepted (`truncate`,
//! then `set_token`): a rejected draft's K/V must never be read back, by its sequence or
//! through a prefix hit.

use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use std::collections::BTreeMap;

use pagedrs::block_manager::window::first_needed_pos;
use pagedrs::block_manager::{BlockManager, BlockManagerConfig, CoreError, EvictionPolicyKind, SwapInStatus, Tier, NULL_BLOCK, PLACEHOLDER_TOKEN};

#[derive(Debug, Clone)]
enum Op {
    /// A prompt of `len` tokens: the first `shared` from a common stream (so prefixes
    /// repeat), the rest from `seed`.
    Allocate { seq: u64, shared: usize, len: usize, seed: u32 },
    Append { seq: u64, n: usize, seed: u32 },
    Commit { seq: u64, frac: u8 },
    Fork { parent: u64, child: u64 },
    Free { seq: u64 },
    SwapOut { seqs: Vec<u64> },
    SwapIn { seqs: Vec<u64> },
    SwapOutPages { seq: u64, n: usize },
    /// Clean shutdown's flush of cached pages to the disk tier.
    FlushToDisk,
    /// Sliding window: release the pages before `frac / 4` of the committed tokens.
    ReleaseWindow { seq: u64, frac: u8 },
    /// A verify step: `k` drafts (from the small alphabet when `seed` is even, so prompts
    /// may match them) written and committed, the first `accepted` of them kept.
    Speculate { seq: u64, k: usize, accepted: usize, seed: u32 },
    /// Truncate to `frac / 4` of the length (refused below the hashed blocks).
    Truncate { seq: u64, frac: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0u64..4;
    prop_oneof![
        3 => (seq.clone(), 0usize..12, 1usize..14, any::<u32>()).prop_map(|(seq, shared, len, seed)| Op::Allocate { seq, shared, len, seed }),
        4 => (seq.clone(), 1usize..6, any::<u32>()).prop_map(|(seq, n, seed)| Op::Append { seq, n, seed }),
        3 => (seq.clone(), 0u8..=4).prop_map(|(seq, frac)| Op::Commit { seq, frac }),
        2 => (seq.clone(), seq.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        1 => seq.clone().prop_map(|seq| Op::Free { seq }),
        1 => proptest::collection::vec(seq.clone(), 1..3).prop_map(|seqs| Op::SwapOut { seqs }),
        1 => proptest::collection::vec(seq.clone(), 1..3).prop_map(|seqs| Op::SwapIn { seqs }),
        2 => (seq.clone(), 0usize..4).prop_map(|(seq, n)| Op::SwapOutPages { seq, n }),
        1 => Just(Op::FlushToDisk),
        2 => (seq.clone(), 0u8..=4).prop_map(|(seq, frac)| Op::ReleaseWindow { seq, frac }),
        4 => (seq.clone(), 1usize..7, 0usize..7, any::<u32>()).prop_map(|(seq, k, accepted, seed)| Op::Speculate { seq, k, accepted, seed }),
        1 => (seq, 0u8..=4).prop_map(|(seq, frac)| Op::Truncate { seq, frac }),
    ]
}

fn config() -> impl Strategy<Value = BlockManagerConfig> {
    let window = prop_oneof![Just(None), (1usize..10).prop_map(Some)];
    let policy = prop_oneof![Just(EvictionPolicyKind::Lru), Just(EvictionPolicyKind::Lfu)];
    ((4usize..16, 1usize..5, 0usize..10, any::<bool>(), any::<bool>(), prop_oneof![Just(0usize), 1usize..8], window), policy).prop_map(
        |((gpu, bs, cpu, prefix, host, disk, window), eviction_policy)| BlockManagerConfig {
            num_gpu_blocks: gpu,
            block_size: bs,
            num_cpu_blocks: cpu,
            enable_prefix_caching: prefix,
            cache_salt: None,
            host_cache_evicted: host,
            num_disk_blocks: disk,
            sliding_window: window,
            eviction_policy,
        },
    )
}

/// Tokens from a tiny alphabet, so that equal blocks (and hash lookups on them) are common.
fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (seed.wrapping_mul(31).wrapping_add(i * 7) >> 3) % 3).collect()
}

/// Appended tokens come from a wide alphabet, so that a write into the wrong block shows.
fn wide_tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed.wrapping_mul(2_654_435_761).wrapping_add(i) % 1000).collect()
}

/// The runner's view: memory of both tiers, and the model of what each sequence holds.
struct Sim {
    bm: BlockManager,
    bs: usize,
    gpu: Vec<Option<u32>>,
    cpu: Vec<Option<u32>>,
    disk: Vec<Option<u32>>,
    /// seq → (tokens, swapped)
    model: BTreeMap<u64, (Vec<u32>, bool)>,
    /// seq → the first position it still needs (sliding window; 0 without one).
    needed_from: BTreeMap<u64, usize>,
}

type Snapshot = (usize, usize, Vec<(u64, Vec<u32>, Vec<bool>, Vec<u32>, bool)>, pagedrs::block_manager::BlockManagerStats);

impl Sim {
    fn snapshot(&self) -> Snapshot {
        let seqs = self
            .model
            .keys()
            .map(|&s| {
                let table = self.bm.block_table(s).unwrap().to_vec();
                let host = self.bm.host_entries(s).unwrap().to_vec();
                (s, table, host, self.bm.tokens(s).unwrap().to_vec(), self.bm.is_swapped(s).unwrap())
            })
            .collect();
        (self.bm.num_free_gpu_blocks(), self.bm.num_free_cpu_blocks(), seqs, self.bm.stats())
    }

    fn mem(&mut self, tier: Tier) -> &mut Vec<Option<u32>> {
        match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
            Tier::Disk => &mut self.disk,
        }
    }

    fn copy(&mut self, pairs: &[(u32, u32)], src: Tier, dst: Tier) {
        let bs = self.bs;
        for &(s, d) in pairs {
            for off in 0..bs {
                let v = self.mem(src)[s as usize * bs + off];
                self.mem(dst)[d as usize * bs + off] = v;
            }
        }
    }

    /// Runs every planned tier copy in the order handed out.
    fn run_host_copies(&mut self) {
        for t in self.bm.take_transfers() {
            self.copy(&t.pairs, t.src, t.dst);
        }
    }

    /// Writes the K/V ("tokens") of positions `start..` of a device sequence.
    fn write(&mut self, seq: u64, start: usize) {
        let toks = self.bm.tokens(seq).unwrap().to_vec();
        let mut slots = Vec::new();
        self.bm.slot_mapping_into(seq, start, toks.len(), &mut slots).unwrap();
        for (slot, t) in slots.into_iter().zip(&toks[start..]) {
            self.gpu[slot as usize] = Some(*t);
        }
    }

    /// Tokens read through the table, from the first one after its placeholders.
    fn read_back(&self, seq: u64) -> Vec<Option<u32>> {
        // Each entry on its own tier: a paused sequence may hold device and host pages at once.
        let table = self.bm.block_table(seq).unwrap();
        let host = self.bm.host_entries(seq).unwrap();
        (self.readable_from(seq)..self.bm.num_tokens(seq).unwrap())
            .map(|p| {
                let mem = if host[p / self.bs] { &self.cpu } else { &self.gpu };
                mem[table[p / self.bs] as usize * self.bs + p % self.bs]
            })
            .collect()
    }

    /// The first position whose page was not released out of the window.
    fn readable_from(&self, seq: u64) -> usize {
        self.bm.block_table(seq).unwrap().iter().take_while(|&&b| b == NULL_BLOCK).count() * self.bs
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.bm.check_invariants().map_err(TestCaseError::fail)?;
        let s = self.bm.stats();
        let misses = s.prefix_misses_never_seen + s.prefix_misses_evicted + s.prefix_misses_evicted_disk + s.prefix_misses_invalidated;
        prop_assert_eq!(misses, s.prefix_queries - s.prefix_hits, "every missed block has one reason");
        prop_assert_eq!(self.bm.num_pinned_host_blocks() + self.bm.num_pinned_blocks(Tier::Disk), 0, "pins left after completion");
        prop_assert_eq!(self.bm.seq_ids().count(), self.model.len());
        for (&seq, (toks, swapped)) in &self.model {
            prop_assert_eq!(self.bm.tokens(seq).unwrap(), &toks[..]);
            prop_assert_eq!(self.bm.is_swapped(seq).unwrap(), *swapped);
            let from = self.readable_from(seq);
            prop_assert!(from <= self.needed_from[&seq], "seq {} released pages it still needs", seq);
            let expected: Vec<Option<u32>> = toks[from..].iter().map(|&t| Some(t)).collect();
            prop_assert_eq!(self.read_back(seq), expected, "seq {} reads back wrong tokens", seq);
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let before = self.snapshot();
        let result: Result<(), CoreError> = match op {
            Op::Allocate { seq, shared, len, seed } => {
                let mut prompt = tokens(0, *shared.min(len));
                prompt.extend(tokens(*seed, len - prompt.len()));
                let cost = self.bm.num_blocks_to_allocate(&prompt);
                let can = self.bm.can_allocate(&prompt);
                let free = self.bm.num_free_gpu_blocks();
                match self.bm.allocate(*seq, &prompt) {
                    Ok(cached) => {
                        prop_assert!(can && cost <= free);
                        prop_assert_eq!(free - self.bm.num_free_gpu_blocks(), cost);
                        prop_assert!(cached % self.bs == 0 && cached < prompt.len());
                        self.run_host_copies();
                        // The cached prefix must already hold the right tokens: with a window,
                        // those the first computed token reads.
                        let needed = self.bm.sliding_window().map_or(0, |w| first_needed_pos(cached, w));
                        let from = self.readable_from(*seq);
                        prop_assert!(from <= needed);
                        let head: Vec<Option<u32>> = self.read_back(*seq)[..cached - from].to_vec();
                        prop_assert_eq!(head, prompt[from..cached].iter().map(|&t| Some(t)).collect::<Vec<_>>());
                        self.write(*seq, cached);
                        self.model.insert(*seq, (prompt, false));
                        self.needed_from.insert(*seq, needed);
                        Ok(())
                    }
                    Err(e) => {
                        if matches!(e, CoreError::OutOfBlocks { .. }) {
                            prop_assert!(!can && cost > free);
                        }
                        Err(e)
                    }
                }
            }
            Op::Append { seq, n, seed } => {
                let new = wide_tokens(*seed, *n);
                let predicted = self.bm.num_blocks_to_append(*seq, *n);
                if let Ok(p) = predicted {
                    prop_assert_eq!(self.bm.num_blocks_to_resume(*seq, *n).unwrap(), p, "resume = append on the device");
                }
                let free = self.bm.num_free_gpu_blocks();
                self.bm.append_tokens(*seq, &new).map(|cow| {
                    let (toks, _) = self.model.get_mut(seq).unwrap();
                    let start = toks.len();
                    toks.extend(&new);
                    // A copy-on-write source left with no user stays cached (evictable, so free).
                    let freed = cow.iter().filter(|&&(src, _)| self.bm.gpu_refcount(src) == Some(0)).count();
                    assert_eq!(free - self.bm.num_free_gpu_blocks(), predicted.unwrap() - freed);
                    self.run_host_copies();
                    self.copy(&cow, Tier::Gpu, Tier::Gpu);
                    self.write(*seq, start);
                })
            }
            Op::Commit { seq, frac } => {
                let n = self.model.get(seq).map_or(0, |(t, _)| t.len() * *frac as usize / 4);
                self.bm.commit(*seq, n)
            }
            Op::Fork { parent, child } => self.bm.fork(*parent, *child).map(|()| {
                let copy = self.model[parent].clone();
                self.model.insert(*child, copy);
                self.needed_from.insert(*child, self.needed_from[parent]);
            }),
            Op::Free { seq } => self.bm.free(*seq).map(|()| {
                self.model.remove(seq);
                self.needed_from.remove(seq);
            }),
            Op::ReleaseWindow { seq, frac } => {
                let pos = self.bm.num_committed_tokens(*seq).unwrap_or(0) * *frac as usize / 4;
                let held = self.bm.num_held_blocks(*seq);
                self.bm.release_outside_window(*seq, pos).map(|n| {
                    assert_eq!(held.unwrap() - n, self.bm.num_held_blocks(*seq).unwrap());
                    let needed = self.needed_from.get_mut(seq).unwrap();
                    *needed = (*needed).max(pos);
                })
            }
            Op::SwapOut { seqs } => {
                let predicted = self.bm.num_blocks_to_swap_out(seqs);
                self.bm.swap_out(seqs).map(|pairs| {
                    assert_eq!(pairs.len(), predicted.unwrap());
                    self.run_host_copies(); // host pages reclaimed by the swap go to disk first
                    self.copy(&pairs, Tier::Gpu, Tier::Cpu);
                    seqs.iter().for_each(|s| self.model.get_mut(s).unwrap().1 = true);
                })
            }
            Op::SwapIn { seqs } => {
                let status = self.bm.can_swap_in(seqs);
                // One sequence's resume cost: the device blocks its swap-in takes (a copy, or
                // its page still cached there), then a token's append.
                let (resume, free) = (self.bm.num_blocks_to_resume(seqs[0], 1), self.bm.num_free_gpu_blocks());
                let r = self.bm.swap_in(seqs).map(|pairs| {
                    if seqs.len() == 1 {
                        let taken = free - self.bm.num_free_gpu_blocks();
                        assert_eq!(taken + self.bm.num_blocks_to_append(seqs[0], 1).unwrap(), resume.unwrap());
                    }
                    self.run_host_copies();
                    self.copy(&pairs, Tier::Cpu, Tier::Gpu);
                    seqs.iter().for_each(|s| self.model.get_mut(s).unwrap().1 = false);
                });
                if let Ok(status) = status {
                    prop_assert_eq!(r.is_ok(), status == SwapInStatus::Ok);
                }
                r
            }
            Op::SwapOutPages { seq, n } => {
                let swappable = self.bm.num_swappable_pages(*seq);
                let (free, host_pages) = (self.bm.num_free_gpu_blocks(), self.bm.num_host_pages(*seq));
                self.bm.swap_out_pages(*seq, *n).map(|pairs| {
                    // Exactly min(n, swappable) exclusive pages move, each freeing one device block.
                    let moved = (*n).min(swappable.unwrap());
                    assert_eq!(pairs.len(), moved);
                    assert_eq!(self.bm.num_free_gpu_blocks() - free, moved);
                    assert_eq!(self.bm.num_host_pages(*seq).unwrap(), host_pages.unwrap() + moved);
                    self.run_host_copies(); // host pages reclaimed by the swap go to disk first
                    self.copy(&pairs, Tier::Gpu, Tier::Cpu);
                    let swapped = &mut self.model.get_mut(seq).unwrap().1;
                    *swapped |= moved > 0;
                })
            }
            Op::Speculate { seq, k, accepted, seed } => {
                let drafts = if seed % 2 == 0 { tokens(*seed, *k) } else { wide_tokens(*seed, *k) };
                let a = (*accepted).min(*k);
                let (free, predicted) = (self.bm.num_free_gpu_blocks(), self.bm.num_blocks_to_append(*seq, a));
                self.bm.append_tokens(*seq, &vec![PLACEHOLDER_TOKEN; *k]).map(|cow| {
                    let freed = cow.iter().filter(|&&(src, _)| self.bm.gpu_refcount(src) == Some(0)).count();
                    self.run_host_copies();
                    self.copy(&cow, Tier::Gpu, Tier::Gpu);
                    let start = self.model[seq].0.len();
                    let mut slots = Vec::new();
                    self.bm.slot_mapping_into(*seq, start, start + *k, &mut slots).unwrap();
                    for (slot, &d) in slots.into_iter().zip(&drafts) {
                        self.gpu[slot as usize] = Some(d); // the verify step writes every draft's K/V
                    }
                    self.bm.commit(*seq, start + *k).unwrap();
                    self.bm.truncate(*seq, start + a).unwrap();
                    for (i, &d) in drafts[..a].iter().enumerate() {
                        self.bm.set_token(*seq, start + i, d, false).unwrap();
                    }
                    if a > 0 {
                        // Exactly what appending the accepted tokens alone would have taken.
                        assert_eq!(free - self.bm.num_free_gpu_blocks(), predicted.unwrap() - freed);
                    }
                    self.model.get_mut(seq).unwrap().0.extend(&drafts[..a]);
                })
            }
            Op::Truncate { seq, frac } => {
                let n = self.model.get(seq).map_or(0, |(t, _)| t.len() * *frac as usize / 4);
                self.bm.truncate(*seq, n).map(|_| self.model.get_mut(seq).unwrap().0.truncate(n))
            }
            Op::FlushToDisk => {
                for t in self.bm.flush_to_disk() {
                    self.copy(&t.pairs, t.src, t.dst);
                    self.bm.complete_transfers(&[t.id]).unwrap();
                }
                Ok(())
            }
        };
        if result.is_err() {
            prop_assert_eq!(self.snapshot(), before, "failed {:?} changed state", op);
        }
        self.check()
    }
}

/// `make test` replays a fixed seed (32,768 cases, about 2 s), so a CI run passes or fails
/// on the code alone; `make fuzz` sets `PAGEDRS_FUZZ_RANDOM=1` and `PROPTEST_CASES` to
/// search afresh. A failure found there is saved to `block_manager_proptest.proptest-regressions`, which
/// every run replays first; commit it with the fix.
fn fuzz_config() -> ProptestConfig {
    let random = std::env::var("PAGEDRS_FUZZ_RANDOM").is_ok_and(|v| v == "1");
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32768);
    let rng_seed = if random { RngSeed::Random } else { RngSeed::Fixed(0x7061_6765_6472_7321) };
    ProptestConfig { cases, rng_seed, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(fuzz_config())]

    #[test]
    fn random_operations_keep_every_invariant(cfg in config(), ops in proptest::collection::vec(op(), 1..60)) {
        let bs = cfg.block_size;
        let mut sim = Sim {
            gpu: vec![None; cfg.num_gpu_blocks * bs],
            cpu: vec![None; cfg.num_cpu_blocks * bs],
            disk: vec![None; cfg.num_disk_blocks * bs],
            bm: BlockManager::new(cfg).unwrap(),
            bs,
            model: BTreeMap::new(),
            needed_from: BTreeMap::new(),
        };
        for op in &ops {
            sim.apply(op)?;
        }
        for seq in sim.model.keys().copied().collect::<Vec<_>>() {
            sim.bm.free(seq).unwrap();
        }
        sim.run_host_copies();
        sim.bm.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(sim.bm.num_free_gpu_blocks(), sim.bm.num_gpu_blocks());
        prop_assert_eq!(sim.bm.num_free_cpu_blocks(), sim.bm.num_cpu_blocks());
        prop_assert_eq!(sim.bm.num_free_disk_blocks(), sim.bm.num_disk_blocks());
    }
}
