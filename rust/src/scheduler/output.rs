//! The one value a step hands the runner: what runs, where its K/V goes, what moves.

use crate::block_manager::{BlockId, SeqId, Transfer};

/// Everything the runner needs for one step, flattened for NumPy.
#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    /// This step's id: report it with `Scheduler::complete_step` once it ran (or failed).
    pub step_id: u64,
    /// Scheduled sequences in batch order. [S]
    pub seq_ids: Vec<SeqId>,
    /// New tokens of each scheduled sequence. [S]
    pub num_scheduled_tokens: Vec<i32>,
    /// Whether the sequence's last new token is its last known token, so a token is sampled after the step. [S]
    pub do_sample: Vec<bool>,
    /// Draft tokens (speculative decoding) among each sequence's new tokens, its last ones:
    /// its last `1 + drafts` rows each give a logits row to verify. [S]
    pub num_draft_tokens: Vec<i32>,
    /// Tokens to compute, sequences back to back. [T]
    pub input_ids: Vec<i64>,
    /// Position of each token in its sequence. [T]
    pub positions: Vec<i64>,
    /// Slot receiving each token's K/V. [T]
    pub slot_mapping: Vec<i64>,
    /// Cumulative new-token counts; sequence i owns `[q[i], q[i+1])`. [S+1]
    pub query_start_loc: Vec<i32>,
    /// Context length after the step. [S]
    pub seq_lens: Vec<i32>,
    /// Row-major [S, max_blocks] block tables, padded with 0.
    pub block_tables: Vec<i32>,
    pub max_blocks: usize,
    /// Tier copies to run first, in order (device→host before host→device); report each
    /// id back with `complete_transfers` once its copy has finished.
    pub transfers: Vec<Transfer>,
    /// (src, dst) device copies (copy-on-write) to run after the transfers, before the
    /// forward. No transfer of the step writes a block they read: their sources stay
    /// allocated (pinned) until every page of the step is taken.
    pub copies: Vec<(BlockId, BlockId)>,
    /// Sequences preempted in this step (swapped out or dropped for recompute).
    pub preempted: Vec<SeqId>,
}
