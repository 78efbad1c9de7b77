//! A sequence's life in the scheduler: queued by `add_sequence`, grown by
//! `append_tokens`, forked into samples, ended by `finish`.

use super::sequence::{SeqStatus, Sequence};
use super::Scheduler;
use crate::block_manager::{SeqId, TokenId, PLACEHOLDER_TOKEN};
use crate::error::CoreError;

impl Scheduler {
    /// Queues a new sequence; it is admitted by a later `schedule`. It must be able to
    /// run to `max_tokens` outputs with all of its `num_samples` samples (forked later)
    /// holding their own pages, with the pool to itself; otherwise it is refused here,
    /// so that no admitted request can wait forever.
    pub fn add_sequence(
        &mut self,
        id: SeqId,
        tokens: Vec<TokenId>,
        priority: i64,
        arrival: u64,
        max_tokens: usize,
        num_samples: usize,
    ) -> Result<(), CoreError> {
        self.add_salted_sequence(id, tokens, priority, arrival, max_tokens, num_samples, None)
    }

    /// [`add_sequence`](Self::add_sequence) with a cache salt (vLLM's `cache_salt`): the
    /// salt seeds the sequence's prefix-hash chain, so it shares pages only with sequences
    /// of the same salt, on every tier and across restarts (the disk tier keys by it).
    #[allow(clippy::too_many_arguments)]
    pub fn add_salted_sequence(
        &mut self,
        id: SeqId,
        tokens: Vec<TokenId>,
        priority: i64,
        arrival: u64,
        max_tokens: usize,
        num_samples: usize,
        cache_salt: Option<&[u8]>,
    ) -> Result<(), CoreError> {
        self.check_usable()?;
        if self.seqs.contains_key(&id) {
            return Err(CoreError::InvalidArgument(format!("sequence {id} already exists")));
        }
        if id >= super::pins::PIN_SEQ_BASE {
            return Err(CoreError::InvalidArgument(format!("sequence id {id} is reserved for pins: use ids below {}", super::pins::PIN_SEQ_BASE)));
        }
        if tokens.is_empty() {
            return Err(CoreError::InvalidArgument(format!("sequence {id} has no tokens; at least 1 is needed")));
        }
        if tokens.len() > self.config.max_model_len {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} has {} tokens; max_model_len is {}",
                tokens.len(),
                self.config.max_model_len
            )));
        }
        let needed = self.worst_case_blocks(tokens.len(), max_tokens, num_samples);
        let root = self.kv.salted_root(cache_salt);
        if needed > self.usable_blocks_for(&tokens, root) {
            let longest = tokens.len().saturating_add(max_tokens).min(self.config.max_model_len);
            let pinned = self.num_pinned_blocks();
            let pins = if pinned > 0 { format!(", {pinned} of them pinned (unpin a prefix to make room)") } else { String::new() };
            return Err(CoreError::InvalidArgument(format!(
                "the request needs up to {needed} blocks of KV cache (prompt {} + max_tokens {max_tokens} = {longest} tokens \
                 x n = {num_samples} samples); the pool holds {} blocks of {} tokens{pins}",
                tokens.len(),
                self.kv.num_blocks(),
                self.kv.block_size()
            )));
        }
        let longest = tokens.len().saturating_add(max_tokens).min(self.config.max_model_len);
        let seq = Sequence {
            id,
            priority,
            arrival,
            reserve_tokens: self.reserve_tokens(longest),
            prompt_len: tokens.len(),
            max_len: longest.max(tokens.len()),
            tokens,
            kv_tokens: 0,
            prefill_left: 0,
            num_computed: 0,
            status: SeqStatus::Waiting,
            waiting_since: self.stats.num_steps,
            parked: false,
            root,
            cached_tokens: None,
            placeholders: 0,
            drafts: 0,
        };
        self.seqs.insert(id, seq);
        self.waiting.push(id);
        Ok(())
    }

    /// Records a token sampled for a running sequence; its page is taken at the next schedule.
    pub fn append_token(&mut self, id: SeqId, token: TokenId) -> Result<(), CoreError> {
        self.append_tokens(&[(id, token)])
    }

    /// Records one sampled token per sequence, all or nothing: every id must be known,
    /// listed once and below `max_model_len`, or no sequence changes.
    pub fn append_tokens(&mut self, items: &[(SeqId, TokenId)]) -> Result<(), CoreError> {
        self.check_appendable(items.iter().map(|&(id, _)| id))?;
        for &(id, token) in items {
            let seq = self.seqs.get_mut(&id).expect("checked above");
            seq.tokens.push(token);
            seq.parked = false;
        }
        Ok(())
    }

    /// Asynchronous scheduling: each sequence gets its next token as a placeholder
    /// (`PLACEHOLDER_TOKEN`), so the next `schedule` plans its decode before the token is
    /// sampled; `resolve_placeholders` gives the tokens, `drop_placeholders` takes them
    /// back. Same checks as `append_tokens`, all or nothing.
    pub fn append_placeholders(&mut self, ids: &[SeqId]) -> Result<(), CoreError> {
        self.check_appendable(ids.iter().copied())?;
        for id in ids {
            let seq = self.seqs.get_mut(id).expect("checked above");
            seq.tokens.push(PLACEHOLDER_TOKEN);
            seq.placeholders += 1;
            seq.parked = false;
        }
        Ok(())
    }

    /// The sampled tokens of placeholders, oldest placeholder first. A sequence that is no
    /// longer here (finished or aborted meanwhile) is skipped; one without a placeholder is
    /// an error (nothing changes for it). Returns how many were resolved.
    pub fn resolve_placeholders(&mut self, items: &[(SeqId, TokenId)]) -> Result<usize, CoreError> {
        let mut resolved = 0;
        for &(id, token) in items {
            if token == PLACEHOLDER_TOKEN {
                return Err(CoreError::InvalidArgument(format!("sequence {id}: token {token} is the placeholder itself")));
            }
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            if seq.placeholders == 0 {
                return Err(CoreError::InvalidArgument(format!("sequence {id} has no placeholder to resolve")));
            }
            let pos = seq.tokens.len() - seq.placeholders;
            seq.tokens[pos] = token;
            seq.placeholders -= 1;
            let in_kv = pos < seq.kv_tokens;
            if in_kv {
                self.kv.set_token(id, pos, token, !self.open_steps.is_empty())?;
            }
            resolved += 1;
        }
        Ok(resolved)
    }

    /// Takes back the placeholders of sequences whose token will never come (the step that
    /// was to sample it failed). Only placeholders not yet in the KV space can go: a
    /// failed step has reset its sequences to be recomputed, so theirs are not.
    pub fn drop_placeholders(&mut self, ids: &[SeqId]) -> Result<usize, CoreError> {
        let mut dropped = 0;
        for id in ids {
            let Some(seq) = self.seqs.get_mut(id) else { continue };
            while seq.placeholders > 0 {
                if seq.tokens.len() <= seq.kv_tokens {
                    return Err(CoreError::InvalidArgument(format!(
                        "sequence {id}: its placeholder is in the KV space already; only a reset sequence's can be dropped"
                    )));
                }
                seq.tokens.pop();
                seq.placeholders -= 1;
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    fn check_appendable(&self, ids: impl Iterator<Item = SeqId>) -> Result<(), CoreError> {
        let mut seen = std::collections::HashSet::new();
        for id in ids {
            let seq = self.seqs.get(&id).ok_or(CoreError::UnknownSequence(id))?;
            if !seen.insert(id) {
                return Err(CoreError::InvalidArgument(format!("sequence {id} is listed twice; one token per sequence per call")));
            }
            if seq.tokens.len() >= self.config.max_model_len {
                return Err(CoreError::InvalidArgument(format!(
                    "sequence {id} already has max_model_len = {} tokens",
                    self.config.max_model_len
                )));
            }
        }
        Ok(())
    }

    /// `n > 1` sampling and beam search: the child continues the parent's tokens and
    /// shares its pages (copy-on-write later), in whatever state the parent is in:
    ///
    /// - running: the child runs too, on the parent's pages;
    /// - swapped out: the child shares its host pages and comes back with a later swap-in;
    /// - waiting (never admitted, or preempted by recompute): it holds no pages, so the
    ///   child is a waiting copy that is prefilled on admission (a prefix hit on the
    ///   parent's cached blocks where there are any).
    ///
    /// Beam search needs the last two: a beam whose logits row is buffered until its
    /// siblings' rows arrive may be preempted meanwhile and still be the parent of the
    /// next beams.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CoreError> {
        if self.seqs.contains_key(&child) {
            return Err(CoreError::InvalidArgument(format!("sequence {child} already exists")));
        }
        let parent_seq = self.seqs.get(&parent).ok_or(CoreError::UnknownSequence(parent))?;
        if parent_seq.drafts > 0 {
            return Err(CoreError::InvalidArgument(format!("cannot fork sequence {parent}: it holds unverified draft tokens")));
        }
        let mut child_seq = parent_seq.clone();
        child_seq.id = child;
        if parent_seq.has_pages() {
            match self.kv.fork(parent, child) {
                Ok(copies) => self.pending_copies.extend(copies),
                // The contiguous layout copies the parent's region into a new one, which
                // a full pool cannot give now: the child waits and is prefilled when
                // admitted, as a sequence preempted by recompute would be. A paged fork
                // only shares pages and never takes one.
                Err(CoreError::OutOfBlocks { .. }) => {
                    child_seq.reset_for_recompute(self.stats.num_steps);
                    self.stats.num_deferred_forks += 1;
                }
                Err(e) => return Err(e),
            }
        }
        let queue = match child_seq.status {
            SeqStatus::Waiting => &mut self.waiting,
            SeqStatus::Running => &mut self.running,
            SeqStatus::Swapped => &mut self.swapped,
        };
        queue.push(child);
        self.seqs.insert(child, child_seq);
        Ok(())
    }

    /// Ends a sequence (finished or aborted) and gives its pages back.
    pub fn finish(&mut self, id: SeqId) -> Result<(), CoreError> {
        let seq = self.seqs.remove(&id).ok_or(CoreError::UnknownSequence(id))?;
        self.admission.observe_finish(&seq);
        if seq.has_pages() {
            self.kv.free(id)?;
        }
        let queue = match seq.status {
            SeqStatus::Waiting => &mut self.waiting,
            SeqStatus::Running => &mut self.running,
            SeqStatus::Swapped => &mut self.swapped,
        };
        queue.retain(|&s| s != id);
        Ok(())
    }
}

