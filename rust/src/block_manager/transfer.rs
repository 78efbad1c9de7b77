//! Page copies between tiers, as values: `Transfer { id, src, dst, pairs }`.
//!
//! A step hands the runner its transfers in order (every device→host copy before any
//! host→device copy, so a block freed by a swap-out may be refilled in the same step).
//! Host blocks that a transfer reads or writes hold one pin (a refcount) from the moment
//! the copy is planned until the runner reports it finished with
//! [`BlockManager::complete_transfers`]: on a GPU the copy runs on a side stream and
//! may still be in flight after the step that planned it, so a pin released when the
//! copy is merely handed out (vLLM's `complete_load`/`complete_store` exist for the
//! same reason) could let a later swap overwrite a page that is still being read.
//!
//! ```text
//!   plan (schedule)          hand out (start_transfers)        runner done
//!   pins in host_pins  ──►   pins in inflight_pins[id]   ──►   complete_transfers([id]) releases them
//! ```
//!
//! A new tier (disk) is one more `Tier` value and one more pair of pin lists; the
//! runner maps a tier to its storage, not a code path per pair of tiers.

use super::{BlockManager, CopyPairs};
use crate::error::{invalid, CoreError, Tier};

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

impl BlockManager {
    /// Hands out every copy planned since the last call: `to_host` (device→host, e.g.
    /// swap-outs) merged with evicted pages saved to the host, then `to_device`
    /// (host→device, e.g. swap-ins) merged with host prefix hits. Empty batches are
    /// omitted. Their host pins stay until [`complete_transfers`](Self::complete_transfers).
    pub fn start_transfers(&mut self, to_host: CopyPairs, to_device: CopyPairs) -> Vec<Transfer> {
        let mut out_pairs = to_host;
        out_pairs.append(&mut self.pending_evict_copies);
        let mut in_pairs = to_device;
        in_pairs.append(&mut self.pending_hit_copies);
        let (out_pins, in_pins) = std::mem::take(&mut self.host_pins);
        let mut transfers = Vec::with_capacity(2);
        for (src, dst, pairs, pins) in [(Tier::Gpu, Tier::Cpu, out_pairs, out_pins), (Tier::Cpu, Tier::Gpu, in_pairs, in_pins)] {
            if pairs.is_empty() {
                debug_assert!(pins.is_empty(), "pins without copies");
                continue;
            }
            let id = self.next_transfer_id;
            self.next_transfer_id += 1;
            self.inflight_pins.insert(id, pins);
            transfers.push(Transfer { id, src, dst, pairs });
        }
        transfers
    }

    /// The runner finished these transfers: their host pins are released. All ids must
    /// be in flight and distinct; otherwise nothing changes.
    pub fn complete_transfers(&mut self, ids: &[TransferId]) -> Result<(), CoreError> {
        for (i, id) in ids.iter().enumerate() {
            if !self.inflight_pins.contains_key(id) || ids[..i].contains(id) {
                return Err(invalid!(
                    "transfer {id} is not in flight (unknown, already completed, or listed twice); in flight: {:?}",
                    self.inflight_pins.keys().collect::<Vec<_>>()
                ));
            }
        }
        for id in ids {
            for c in self.inflight_pins.remove(id).expect("checked above") {
                self.cpu.release(c, 1);
            }
        }
        self.cpu.flush();
        Ok(())
    }

    /// Ids of transfers handed out and not yet completed, oldest first.
    pub fn transfers_in_flight(&self) -> Vec<TransferId> {
        self.inflight_pins.keys().copied().collect()
    }

    /// Scheduler mode: `swap_in` pins its host sources until their transfer completes.
    pub fn set_pin_swap_in_sources(&mut self, on: bool) {
        self.pin_swap_in_sources = on;
    }

    /// The plain API's view: (device→host, host→device) copies since the last call,
    /// handed out and completed at once (the caller runs them synchronously).
    pub fn take_pending_host_copies(&mut self) -> (CopyPairs, CopyPairs) {
        let transfers = self.start_transfers(Vec::new(), Vec::new());
        let ids: Vec<TransferId> = transfers.iter().map(|t| t.id).collect();
        self.complete_transfers(&ids).expect("just started");
        let (mut evict, mut hits) = (Vec::new(), Vec::new());
        for t in transfers {
            if t.src == Tier::Gpu { evict = t.pairs } else { hits = t.pairs }
        }
        (evict, hits)
    }
}
