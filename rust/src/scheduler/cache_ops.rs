//! The prefix cache as its users ask for it, at the scheduler: what a sequence's
//! admission found cached on each tier, and a reset of every tier.

use super::Scheduler;
use crate::block_manager::{KvEvent, PrefixCacheReset, SeqId};
use crate::error::{CoreError, Tier};

impl Scheduler {
    /// The split of [`num_cached_tokens_of`](Self::num_cached_tokens_of) by the tier the
    /// tokens were found on, `[device, host, disk]`; None until the sequence is admitted,
    /// and None when its pages were dropped since (a recompute's re-admission is not
    /// the one its `cached_tokens` reports).
    pub fn num_cached_tokens_by_tier_of(&self, id: SeqId) -> Result<Option<[usize; 3]>, CoreError> {
        let seq = self.seqs.get(&id).ok_or(CoreError::UnknownSequence(id))?;
        let Some(cached) = seq.cached_tokens else { return Ok(None) };
        if !seq.has_pages() {
            return Ok(None);
        }
        let split = self.kv.cached_tokens_by_tier(id)?;
        Ok((split.iter().sum::<usize>() == cached).then_some(split))
    }

    /// Forgets every cached page on every tier (device, host, disk); returns how many
    /// each dropped. Refused, with nothing changed, while a step is in flight or a
    /// sequence holds pages (vLLM's `reset_prefix_cache` fails the same way while blocks
    /// are in use): waiting sequences hold none and stay queued.
    pub fn reset_prefix_cache(&mut self) -> Result<PrefixCacheReset, CoreError> {
        self.check_usable()?;
        if !self.open_steps.is_empty() {
            return Err(CoreError::InvalidArgument(format!(
                "cannot reset the prefix cache while {} step(s) are in flight; report them first",
                self.open_steps.len()
            )));
        }
        let holding = self.seqs.values().filter(|s| s.has_pages()).count();
        if holding > 0 {
            return Err(CoreError::InvalidArgument(format!(
                "cannot reset the prefix cache while {holding} sequence(s) hold pages; finish or abort them first"
            )));
        }
        self.kv.reset_prefix_cache()
    }

    /// Turns KV events on: every page joining or leaving a tier's prefix cache is logged
    /// for [`take_kv_events`](Self::take_kv_events), starting with what is cached now.
    pub fn enable_kv_events(&mut self) {
        self.kv.enable_kv_events()
    }

    /// The tiers' cache changes since the last take, in order (empty while off).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.kv.take_kv_events()
    }

    /// Sorted hashes of the pages `tier` caches now.
    pub fn cached_hashes(&self, tier: Tier) -> Vec<u64> {
        self.kv.cached_hashes(tier)
    }
}
