//! Page copies between tiers, as values: `Transfer { id, src, dst, pairs }`.
//!
//! A step hands the runner its transfers in one fixed order of (src, dst) tier pairs,
//! [`ORDER`]: every copy that reads a page out of a tier comes before any copy that
//! overwrites a page of that tier, because a block whose content leaves in this step
//! may be refilled in the same step (an evicted host page goes to disk before the host
//! block takes a device page; a device page goes to the host before its block takes a
//! host or disk hit).
//!
//! Host and disk blocks that a transfer reads or writes hold one pin (a refcount) from
//! the moment the copy is planned until the runner reports it finished with
//! [`BlockManager::complete_transfers`]: on a GPU the copy runs on a side stream and
//! may still be in flight after the step that planned it, so a pin released when the
//! copy is merely handed out (vLLM's `complete_load`/`complete_store` exist for the
//! same reason) could let a later swap overwrite a page that is still being read.
//!
//! ```text
//!   plan (schedule)          hand out (start_transfers)        runner done
//!   pins in pending     ──►  pins in inflight_pins[id]   ──►   complete_transfers([id]) releases them
//! ```
//!
//! A tier is a value: the runner maps a tier name to its storage, not a code path per
//! pair of tiers.

use super::{BlockManager, CopyPairs, MissReason};
use crate::error::{invalid, BlockId, CoreError, SeqId, Tier};

fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::Gpu => 0,
        Tier::Cpu => 1,
        Tier::Disk => 2,
    }
}

/// Identifies one handed-out transfer until it completes. Never reused.
pub type TransferId = u64;

/// One batch of block copies from tier `src` to tier `dst`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    pub id: TransferId,
    pub src: Tier,
    pub dst: Tier,
    /// (source block, destination block) pairs; each destination once.
    pub pairs: CopyPairs,
}

/// The order in which a step's batches run (see the module docs).
pub(crate) const ORDER: [(Tier, Tier); 5] =
    [(Tier::Cpu, Tier::Disk), (Tier::Gpu, Tier::Disk), (Tier::Gpu, Tier::Cpu), (Tier::Cpu, Tier::Gpu), (Tier::Disk, Tier::Gpu)];

/// A pinned block: one refcount held on `(tier, block)` until its copy completes.
pub(crate) type Pin = (Tier, BlockId);

/// Copies planned and not yet handed out, one batch per entry of [`ORDER`].
#[derive(Default)]
pub(crate) struct Pending {
    pairs: [CopyPairs; 5],
    pins: [Vec<Pin>; 5],
}

fn slot(src: Tier, dst: Tier) -> usize {
    ORDER.iter().position(|&p| p == (src, dst)).unwrap_or_else(|| panic!("no transfer batch {src} -> {dst}"))
}

impl Pending {
    /// Plans one copy `src_block → dst_block`, with an optional pin.
    pub(crate) fn push(&mut self, src: Tier, dst: Tier, pair: (BlockId, BlockId), pin: Option<Pin>) {
        let i = slot(src, dst);
        self.pairs[i].push(pair);
        self.pins[i].extend(pin);
    }

    /// A pin for a copy whose pair the caller hands in itself (the scheduler's swap-ins).
    pub(crate) fn pin(&mut self, src: Tier, dst: Tier, pin: Pin) {
        self.pins[slot(src, dst)].push(pin);
    }

    /// Every pin planned and not handed out.
    pub(crate) fn all_pins(&self) -> impl Iterator<Item = &Pin> + '_ {
        self.pins.iter().flatten()
    }
}

impl BlockManager {
    /// Hands out every copy planned since the last call, in [`ORDER`]: `to_host`
    /// (device→host, the scheduler's swap-outs) goes before the evicted pages saved to the
    /// host, `to_device` (host→device, swap-ins) before the host prefix hits. Empty batches
    /// are omitted. Their pins stay until [`complete_transfers`](Self::complete_transfers).
    pub fn start_transfers(&mut self, mut to_host: CopyPairs, mut to_device: CopyPairs) -> Vec<Transfer> {
        let mut pending = std::mem::take(&mut self.pending);
        let (i_out, i_in) = (slot(Tier::Gpu, Tier::Cpu), slot(Tier::Cpu, Tier::Gpu));
        to_host.append(&mut pending.pairs[i_out]);
        pending.pairs[i_out] = to_host;
        to_device.append(&mut pending.pairs[i_in]);
        pending.pairs[i_in] = to_device;
        let mut transfers = Vec::new();
        for ((src, dst), (pairs, pins)) in ORDER.into_iter().zip(pending.pairs.into_iter().zip(pending.pins)) {
            if pairs.is_empty() {
                debug_assert!(pins.is_empty(), "pins without copies");
                continue;
            }
            let id = self.next_transfer_id;
            self.next_transfer_id += 1;
            self.inflight_pins.insert(id, pins);
            self.inflight_dst.insert(id, (dst, pairs.iter().map(|&(_, d)| d).collect()));
            transfers.push(Transfer { id, src, dst, pairs });
        }
        transfers
    }

    /// The runner finished these transfers: their pins are released. All ids must be in
    /// flight and distinct; otherwise nothing changes.
    pub fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError> {
        self.check_in_flight(ids)?;
        self.release_transfers(ids);
        Ok(())
    }

    /// The runner could not finish these transfers (their step failed): every destination
    /// page may hold anything, so it is forgotten on its tier — a host or disk page leaves
    /// that tier's cache, a device page never joined it (the failed step's publications
    /// are dropped, see `publish`) or leaves it — and the pins go. Returns the live
    /// sequences whose block tables point at a destination (a swap-out's host pages, a
    /// swap-in's or a prefix hit's device pages): their K/V is lost, so the caller must
    /// recompute or end them. All ids must be in flight and distinct; otherwise nothing
    /// changes.
    pub fn fail_transfers(&mut self, ids: &[TransferId]) -> Result<Vec<SeqId>, CoreError> {
        self.check_in_flight(ids)?;
        let mut lost: [std::collections::HashSet<BlockId>; 3] = Default::default();
        for id in ids {
            let (tier, blocks) = self.inflight_dst.get(id).expect("checked above");
            let i = tier_index(*tier);
            lost[i].extend(blocks.iter().copied());
        }
        for (tier, blocks) in [Tier::Gpu, Tier::Cpu, Tier::Disk].into_iter().zip(&lost) {
            for &b in blocks {
                if let Some(h) = self.pool_mut(tier).cache.uncache(b) {
                    self.misses.record(h, MissReason::Invalidated);
                }
            }
        }
        let mut seqs: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.pages().any(|(b, host)| lost[tier_index(if host { Tier::Cpu } else { Tier::Gpu })].contains(&b)))
            .map(|(&id, _)| id)
            .collect();
        seqs.sort_unstable();
        self.release_transfers(ids);
        Ok(seqs)
    }

    fn check_in_flight(&self, ids: &[TransferId]) -> Result<(), CoreError> {
        for (i, id) in ids.iter().enumerate() {
            if !self.inflight_pins.contains_key(id) || ids[..i].contains(id) {
                return Err(invalid!(
                    "transfer {id} is not in flight (unknown, already completed, or listed twice); in flight: {:?}",
                    self.inflight_pins.keys().collect::<Vec<_>>()
                ));
            }
        }
        Ok(())
    }

    fn release_transfers(&mut self, ids: &[TransferId]) {
        for id in ids {
            self.inflight_dst.remove(id);
            for (tier, b) in self.inflight_pins.remove(id).expect("checked above") {
                self.pool_mut(tier).release(b, 1);
            }
        }
        let disk = &self.disk;
        self.disk_invalidated_pinned.retain(|&b| disk.refs.get(b) > 0);
        self.cpu.flush();
        self.disk.flush();
    }

    /// Ids of transfers handed out and not yet completed, oldest first.
    pub fn transfers_in_flight(&self) -> Vec<TransferId> {
        self.inflight_pins.keys().copied().collect()
    }

    /// Scheduler mode: `swap_in` pins its host sources until their transfer completes.
    pub fn set_pin_swap_in_sources(&mut self, on: bool) {
        self.pin_swap_in_sources = on;
    }

    /// Every copy planned since the last call, handed out and completed at once (the
    /// caller runs them synchronously, in the order returned).
    pub fn take_transfers(&mut self) -> Vec<Transfer> {
        let transfers = self.start_transfers(Vec::new(), Vec::new());
        let ids: Vec<TransferId> = transfers.iter().map(|t| t.id).collect();
        self.complete_transfers(&ids).expect("just started");
        transfers
    }

    /// The plain API's view of [`take_transfers`](Self::take_transfers) without a disk
    /// tier: (device→host, host→device) copies since the last call.
    pub fn take_pending_host_copies(&mut self) -> (CopyPairs, CopyPairs) {
        let (mut evict, mut hits) = (Vec::new(), Vec::new());
        for t in self.take_transfers() {
            match (t.src, t.dst) {
                (Tier::Gpu, Tier::Cpu) => evict = t.pairs,
                (Tier::Cpu, Tier::Gpu) => hits = t.pairs,
                (src, dst) => debug_assert!(false, "take_pending_host_copies dropped {src} -> {dst} copies; use take_transfers"),
            }
        }
        (evict, hits)
    }

    /// Blocks of `tier` pinned by copies not yet completed (handed out or not).
    pub fn num_pinned_blocks(&self, tier: Tier) -> usize {
        self.pending.all_pins().chain(self.inflight_pins.values().flatten()).filter(|p| p.0 == tier).count()
    }

    /// Host blocks pinned by copies not yet completed (handed out or not).
    pub fn num_pinned_host_blocks(&self) -> usize {
        self.num_pinned_blocks(Tier::Cpu)
    }
}
