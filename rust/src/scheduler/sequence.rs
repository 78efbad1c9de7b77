//! One sequence as the scheduler sees it: its tokens and how far its K/V goes.
//!
//! ```text
//!  tokens:  | prompt ............................ | outputs ...... |
//!           0                  num_computed       kv_tokens      len
//!           |<- K/V written ->|<- scheduled next ->|<- sampled, not yet in the KV space ->|
//! ```
//! `kv_tokens` is what the KV space has recorded (its block table covers it);
//! sampled tokens join it at the next schedule, which is when pages are taken.

use crate::block_manager::{SeqId, TokenId};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    /// Paused by a swap preemption: out of the running set, holding its pages, each on
    /// the device or already moved to the host (page-granular preemption takes them one
    /// by one as other sequences need them; whole-sequence swap moves all at once).
    Swapped,
}

#[derive(Clone, Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Lower runs first (vLLM's convention).
    pub priority: i64,
    /// Arrival order of its request; siblings from `n > 1` share it.
    pub arrival: u64,
    pub tokens: Vec<TokenId>,
    /// Tokens recorded in the KV space; 0 while it holds no pages.
    pub kv_tokens: usize,
    /// Of the tokens past `kv_tokens`, those still to prefill (not freshly sampled): a
    /// sliding-window model admits a prompt one chunk at a time (see `Scheduler::admit`),
    /// so its pages never cover much more than its window. 0 otherwise.
    pub prefill_left: usize,
    /// Leading tokens whose K/V is written (or scheduled in the current step).
    pub num_computed: usize,
    /// Length the contiguous layout reserves up front.
    pub reserve_tokens: usize,
    /// Tokens of its prompt (the outputs follow them in `tokens`).
    pub prompt_len: usize,
    /// Longest it may grow: prompt + max_tokens, capped at max_model_len (admission
    /// expects part of the rest to come, see `scheduler::admission`).
    pub max_len: usize,
    pub status: SeqStatus,
    /// Step at which it last entered the waiting queue, for aging.
    pub waiting_since: u64,
    /// Preempted by recompute while it had nothing to compute (its logits row taken, its
    /// next token not given yet: a beam waiting for its siblings' rows). It is not
    /// admitted again until a token is appended: it would only compute the same row.
    pub parked: bool,
    /// The seed of its prefix-hash chain: the KV space's root, or one salted by the
    /// request's `cache_salt` (forks inherit it).
    pub root: u64,
    /// Prompt tokens whose K/V its first admission found cached (None before it).
    pub cached_tokens: Option<usize>,
    /// Trailing tokens not sampled yet (`PLACEHOLDER_TOKEN`: asynchronous scheduling planned
    /// the step that computes them before the step that samples them finished). A waiting
    /// sequence with one is not admitted: a prefill would compute a token nobody knows.
    pub placeholders: usize,
    /// Trailing tokens that are drafts of speculative decoding, computed by the step just
    /// planned and not yet verified (see `scheduler::speculation`); 0 outside that window.
    pub drafts: usize,
}

impl Sequence {
    /// Sort key of the running set: best first, so the preemption victim is the last.
    pub fn rank(&self) -> (i64, u64, SeqId) {
        (self.priority, self.arrival, self.id)
    }

    /// Waiting order: priority improved by one level per `aging_steps` steps waited.
    pub fn waiting_rank(&self, now: u64, aging_steps: u64) -> (i64, u64, SeqId) {
        let boost = now.saturating_sub(self.waiting_since).checked_div(aging_steps).unwrap_or(0) as i64;
        (self.priority.saturating_sub(boost), self.arrival, self.id)
    }

    /// Back to waiting with no pages, to be prefilled again from its first token (a
    /// recompute preemption, or a fork whose region the pool cannot give yet). Parked if
    /// it had nothing to compute (see `parked`).
    pub fn reset_for_recompute(&mut self, now: u64) {
        self.tokens.truncate(self.tokens.len() - self.drafts); // a guess is never prefilled as real
        self.drafts = 0;
        self.parked = self.waits_for_token();
        self.kv_tokens = 0;
        self.prefill_left = 0;
        self.num_computed = 0;
        self.status = SeqStatus::Waiting;
        self.waiting_since = now;
    }

    pub fn has_pages(&self) -> bool {
        self.kv_tokens > 0
    }

    /// Nothing to compute until a token is appended: idle while running, parked while
    /// waiting, every token's K/V already on the host while swapped out.
    pub fn waits_for_token(&self) -> bool {
        match self.status {
            SeqStatus::Running => self.num_computed == self.kv_tokens && self.kv_tokens == self.tokens.len(),
            SeqStatus::Waiting => self.parked || self.placeholders > 0,
            SeqStatus::Swapped => self.kv_tokens == self.tokens.len(),
        }
    }
}
