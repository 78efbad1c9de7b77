//! Pinned prefixes at the scheduler (issue 27, `LLM.pin_prefix`): each pin is a hidden
//! sequence of the KV space (see `block_manager::pins`), never queued, never scheduled,
//! never preempted, holding its pages until `unpin`.
//!
//! The scheduler's fit checks subtract the pinned pages: a request that could only run
//! with the pool to itself is refused at `add_sequence` when the pins leave it too
//! little, rather than admitted to wait forever (see [`Scheduler::usable_blocks`]).

use std::collections::BTreeMap;

use super::Scheduler;
use crate::block_manager::{SeqId, TokenId};
use crate::error::CoreError;

/// Hidden pin sequences take ids from here up; `add_sequence` refuses ids this large.
pub const PIN_SEQ_BASE: SeqId = 1 << 62;

/// One live pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinInfo {
    /// The pin's id (what `unpin` takes).
    pub id: u64,
    /// Leading prompt tokens whose pages the pin holds (a multiple of the block size).
    pub num_tokens: usize,
    /// Device pages the pin holds (some may be shared with other pins).
    pub num_pages: usize,
}

/// The scheduler's pins, by pin id.
#[derive(Debug, Default)]
pub(super) struct Pins {
    live: BTreeMap<u64, PinInfo>,
    next_id: u64,
}

impl Scheduler {
    /// Pins the leading full blocks of `tokens` that are committed and cached on the
    /// device (compute the prompt first: a pin never holds unwritten K/V), under the chain
    /// of `cache_salt`. Fails, nothing changed, when not one block is cached, or the
    /// layout has no prefix cache.
    pub fn pin_prefix(&mut self, tokens: &[TokenId], cache_salt: Option<&[u8]>) -> Result<PinInfo, CoreError> {
        self.check_usable()?;
        let id = self.pins.next_id;
        let root = self.kv.salted_root(cache_salt);
        let num_pages = self.kv.pin_cached(PIN_SEQ_BASE + id, tokens, root)?;
        self.pins.next_id += 1;
        let info = PinInfo { id, num_tokens: num_pages * self.kv.block_size(), num_pages };
        self.pins.live.insert(id, info);
        Ok(info)
    }

    /// Releases a pin's pages (cached ones stay evictable, as any freed page's).
    pub fn unpin(&mut self, id: u64) -> Result<(), CoreError> {
        if !self.pins.live.contains_key(&id) {
            return Err(CoreError::InvalidArgument(format!("unknown pin id {id}: it was never made or is already unpinned")));
        }
        self.kv.free(PIN_SEQ_BASE + id)?;
        self.pins.live.remove(&id);
        Ok(())
    }

    /// Every live pin, by id.
    pub fn pins(&self) -> Vec<PinInfo> {
        self.pins.live.values().copied().collect()
    }

    /// Pages a pin of `tokens` (salted with `cache_salt`) would add to the pinned pages.
    pub fn num_new_pinned_blocks(&self, tokens: &[TokenId], cache_salt: Option<&[u8]>) -> usize {
        self.kv.num_new_pinned_blocks(tokens, self.kv.salted_root(cache_salt))
    }

    /// Distinct device pages that pins hold.
    pub fn num_pinned_blocks(&self) -> usize {
        self.kv.num_pinned_prefix_blocks()
    }

    /// Device blocks a sequence may ever have: the pool less the pinned pages.
    pub fn usable_blocks(&self) -> usize {
        self.kv.num_blocks() - self.kv.num_pinned_prefix_blocks()
    }

    /// [`usable_blocks`](Self::usable_blocks) for a sequence of `tokens` under the chain
    /// `root`: the pinned pages its prompt starts with count for it (it shares them).
    pub(super) fn usable_blocks_for(&self, tokens: &[TokenId], root: u64) -> usize {
        if self.pins.live.is_empty() {
            return self.kv.num_blocks(); // no prefix walk on every admission check while nothing is pinned
        }
        let shared = (tokens.len() / self.kv.block_size()).saturating_sub(self.kv.num_new_pinned_blocks(tokens, root));
        self.usable_blocks() + shared
    }

    /// The scheduler's pins agree with the KV space: each pin's hidden sequence holds
    /// exactly its pages.
    pub(super) fn check_pins(&self) -> Result<(), String> {
        for (id, pin) in &self.pins.live {
            let held = self.kv.num_held_blocks(PIN_SEQ_BASE + id).map_err(|e| format!("pin {id}: {e}"))?;
            if held != pin.num_pages {
                return Err(format!("pin {id} records {} pages but its sequence holds {held}", pin.num_pages));
            }
        }
        Ok(())
    }
}
