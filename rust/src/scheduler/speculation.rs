//! Speculative decoding in the scheduler: a decode carries the draft tokens a proposer
//! guessed, the step computes them all, and `accept_drafts` keeps the verified ones.
//!
//! ```text
//!  before the step   tokens | ... x |                 x = last sampled token (not yet in the KV space)
//!  set_proposal      proposal d1 d2 d3                 (held by the scheduler, not the sequence)
//!  schedule          tokens | ... x d1 d2 d3 |         4 query rows; the KV space records
//!                    kv     | ... x  ?  ?  ? |         the drafts as PLACEHOLDER_TOKEN (never hashed)
//!  accept_drafts(1)  tokens | ... x d1 |               d2 d3 truncated (tokens and pages);
//!                    kv     | ... x d1 |               d1 given by set_token, its blocks hashed
//!  append_tokens     tokens | ... x d1 y |             y = the correction (or bonus) token
//! ```
//!
//! Drafts join a decode only when they cost no preemption: the budget and the free pages
//! (above the watermark) must hold them after the decode's own token; otherwise the
//! decode runs alone. A proposal not used by the next `schedule` is dropped. Drafts live
//! only between a `schedule` and its `accept_drafts`: `schedule` refuses while any are
//! unverified, and a sequence reset for recompute (a failed step) drops its drafts, so a
//! prefill never computes a guessed token as if it were real.

use super::sequence::SeqStatus;
use super::{Scheduler, SchedulerOutput};
use crate::block_manager::{SeqId, TokenId, PLACEHOLDER_TOKEN};
use crate::error::CoreError;

impl Scheduler {
    /// Draft tokens for `id`'s next decode (replacing an earlier proposal). Used by the next
    /// `schedule` if it runs the sequence as a decode with room for them (fewer when its
    /// budget, its `max_tokens` or the pool allows fewer), dropped otherwise.
    pub fn set_proposal(&mut self, id: SeqId, tokens: &[TokenId]) -> Result<(), CoreError> {
        if !self.seqs.contains_key(&id) {
            return Err(CoreError::UnknownSequence(id));
        }
        if tokens.contains(&PLACEHOLDER_TOKEN) {
            return Err(CoreError::InvalidArgument(format!("proposal for sequence {id}: token {PLACEHOLDER_TOKEN} is the placeholder itself")));
        }
        if tokens.is_empty() {
            self.proposals.remove(&id);
        } else {
            self.proposals.insert(id, tokens.to_vec());
        }
        Ok(())
    }

    /// Refuses to plan while a sequence holds drafts nobody verified (see the module docs).
    pub(super) fn check_no_drafts(&self) -> Result<(), CoreError> {
        let unverified: Vec<SeqId> = self.running.iter().copied().filter(|id| self.seqs[id].drafts > 0).collect();
        if unverified.is_empty() {
            return Ok(());
        }
        Err(CoreError::InvalidArgument(format!(
            "sequences {unverified:?} hold unverified draft tokens from the last step; call accept_drafts for each before schedule"
        )))
    }

    /// After `append_sampled` recorded a decode's `pending` tokens: its proposal's drafts that
    /// fit the budget (`budget_tokens` left before this decode), its longest length and the
    /// free pages, appended (as placeholders in the KV space). Returns how many.
    pub(super) fn append_drafts(&mut self, id: SeqId, pending: usize, budget_tokens: usize, out: &mut SchedulerOutput) -> Result<usize, CoreError> {
        let Some(proposal) = self.proposals.remove(&id) else { return Ok(0) };
        let seq = &self.seqs[&id];
        // Drafts follow a sampled token: a prompt's last chunk carries none (its first row is
        // the one `n > 1` samples fork from, each drawing its own first token).
        if seq.tokens.len() <= seq.prompt_len || seq.status != SeqStatus::Running {
            return Ok(0);
        }
        // Every accepted draft and the bonus token are outputs: at most max_len - len of them.
        let room = seq.max_len.saturating_sub(seq.tokens.len() + 1);
        let mut k = proposal.len().min(room).min(budget_tokens.saturating_sub(pending));
        let free = self.kv.num_free_blocks().saturating_sub(self.rules.watermark_blocks);
        while k > 0 && self.kv.blocks_to_append(id, k)? > free {
            k -= 1; // the pool is tight: speculate less, never preempt for a guess
        }
        if k == 0 {
            return Ok(0);
        }
        out.copies.extend(self.kv.append(id, &vec![PLACEHOLDER_TOKEN; k])?);
        let seq = self.seqs.get_mut(&id).expect("known sequence");
        seq.tokens.extend_from_slice(&proposal[..k]);
        seq.kv_tokens += k;
        seq.drafts = k;
        self.stats.draft_tokens_scheduled += k as u64;
        Ok(k)
    }

    /// Replaces the drafts the last `schedule` gave `id` (a proposer that guesses only after
    /// the plan: the draft model runs on the step's own slots, so a proposal of reserved
    /// tokens came first). `tokens` must be exactly as many as it holds; the KV space keeps
    /// them as placeholders until `accept_drafts`, so nothing is hashed here.
    pub fn set_draft_tokens(&mut self, id: SeqId, tokens: &[TokenId]) -> Result<(), CoreError> {
        let seq = self.seqs.get_mut(&id).ok_or(CoreError::UnknownSequence(id))?;
        if tokens.len() != seq.drafts {
            return Err(CoreError::InvalidArgument(format!(
                "set_draft_tokens of sequence {id}: {} tokens but it holds {} draft tokens (it must be exactly that many)",
                tokens.len(),
                seq.drafts
            )));
        }
        if tokens.contains(&PLACEHOLDER_TOKEN) {
            return Err(CoreError::InvalidArgument(format!("set_draft_tokens of sequence {id}: token {PLACEHOLDER_TOKEN} is the placeholder itself")));
        }
        let start = seq.tokens.len() - seq.drafts;
        seq.tokens[start..].copy_from_slice(tokens);
        Ok(())
    }

    /// After the step that computed `id`'s drafts: its first `num_accepted` drafts are
    /// verified (they stay, and their blocks may join the prefix cache), the rest are cut
    /// from its tokens and its pages. Call it before appending the correction token. A
    /// sequence no longer here (finished meanwhile) is skipped. Returns the tokens dropped.
    pub fn accept_drafts(&mut self, id: SeqId, num_accepted: usize) -> Result<usize, CoreError> {
        let Some(seq) = self.seqs.get(&id) else { return Ok(0) };
        if num_accepted > seq.drafts {
            return Err(CoreError::InvalidArgument(format!(
                "accept_drafts of sequence {id}: num_accepted = {num_accepted} but it holds {} draft tokens",
                seq.drafts
            )));
        }
        if seq.drafts == 0 {
            return Ok(0);
        }
        let keep = seq.tokens.len() - seq.drafts + num_accepted;
        let dropped = seq.drafts - num_accepted;
        if seq.has_pages() {
            self.kv.truncate(id, keep)?;
        }
        let in_flight = !self.open_steps.is_empty();
        let seq = self.seqs.get_mut(&id).expect("checked above");
        seq.tokens.truncate(keep);
        seq.kv_tokens = seq.kv_tokens.min(keep);
        seq.num_computed = seq.num_computed.min(keep);
        seq.drafts = 0;
        if seq.has_pages() {
            for pos in keep - num_accepted..keep {
                let token = seq.tokens[pos];
                self.kv.set_token(id, pos, token, in_flight)?;
            }
        }
        self.stats.draft_tokens_accepted += num_accepted as u64;
        Ok(dropped)
    }

    /// A verify step cut short after it was reported done (an interrupt while a later round
    /// was drawn, or before its token was recorded): the caller's record of `id` holds its
    /// first `num_tokens` tokens, and the row that was to give the next one is lost. Makes the
    /// scheduler agree with that record and compute the last recorded token again, so its
    /// next decode gives that row:
    ///
    /// - still holding drafts, with `num_tokens` past its last sampled token: the drafts below
    ///   the last recorded one are accepted, the rest cut, and the last recorded one is
    ///   appended as a sampled token (its K/V is written again by the next step);
    /// - every recorded token computed and none to come (the drawn token never appended), or
    ///   nothing past its last sampled token recorded: back to waiting, prefilled again
    ///   (its committed pages are prefix hits);
    /// - already consistent (the last recorded token still to compute): nothing changes.
    ///
    /// Returns whether anything changed. A sequence no longer here is skipped (false). Refused,
    /// with nothing changed, while a step is in flight, for a sequence holding placeholders,
    /// or for a `num_tokens` outside what it holds.
    pub fn rewind(&mut self, id: SeqId, num_tokens: usize) -> Result<bool, CoreError> {
        if !self.open_steps.is_empty() {
            return Err(CoreError::InvalidArgument(format!(
                "rewind of sequence {id}: steps {:?} are in flight; report them first",
                self.open_steps()
            )));
        }
        let Some(seq) = self.seqs.get(&id) else { return Ok(false) };
        let len = seq.tokens.len();
        let sampled = len - seq.drafts; // its tokens up to the last sampled one
        if seq.placeholders > 0 || num_tokens > len || num_tokens < sampled {
            return Err(CoreError::InvalidArgument(format!(
                "rewind of sequence {id} to num_tokens = {num_tokens}: it holds {len} tokens ({} of them drafts, {} \
                 placeholders); allowed: {sampled}..={len}, without placeholders",
                seq.drafts, seq.placeholders
            )));
        }
        if seq.drafts > 0 && num_tokens > sampled {
            let last = seq.tokens[num_tokens - 1];
            self.accept_drafts(id, num_tokens - 1 - sampled)?;
            self.append_token(id, last)?;
            return Ok(true);
        }
        if seq.drafts == 0 && !seq.waits_for_token() {
            return Ok(false);
        }
        // here `num_tokens` is its last sampled token (drafts held) or its length (none held):
        // the reset drops the drafts and keeps the rest
        self.reset_after_failure(id, true)?;
        Ok(true)
    }
}
