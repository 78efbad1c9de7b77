//! Scheduler settings, validated once at construction.

use crate::error::CoreError;

/// How a preempted sequence gives its device pages back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Copy its pages to the host tier; they come back with a swap-in.
    Swap,
    /// Drop its pages; its tokens are prefilled again later (prefix-cache hits make that cheaper).
    Recompute,
    /// Per victim, whichever [`PreemptionCost`] says is cheaper.
    Auto,
}

impl PreemptionMode {
    pub fn parse(value: &str) -> Result<Self, CoreError> {
        match value {
            "swap" => Ok(Self::Swap),
            "recompute" => Ok(Self::Recompute),
            "auto" => Ok(Self::Auto),
            other => Err(CoreError::InvalidArgument(format!(
                "preemption_mode is {other:?}; allowed: \"swap\", \"recompute\", \"auto\""
            ))),
        }
    }
}

/// The cost model of `PreemptionMode::Auto`, in one unit the caller picks (seconds work).
///
/// Swapping a victim costs moving its pages over the host link twice (out now, in
/// later): `2 × blocks × swap_cost_per_block`. Recomputing costs one prefill of all
/// its tokens: `tokens × recompute_cost_per_token`. The engine derives both from the
/// device (bytes per block / host-link bandwidth, and 2 × parameters / device FLOP/s),
/// so short sequences recompute and long ones swap; a full host tier forces recompute.
#[derive(Clone, Copy, Debug)]
pub struct PreemptionCost {
    pub swap_cost_per_block: f64,
    pub recompute_cost_per_token: f64,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in the running set.
    pub max_num_seqs: usize,
    /// Token budget of one step (prompt chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Longest sequence, prompt plus output.
    pub max_model_len: usize,
    pub preemption_mode: PreemptionMode,
    /// Free blocks an admission must leave behind, so new prompts do not
    /// immediately force the running set into preemption.
    pub watermark_blocks: usize,
    /// Steps a waiting sequence waits per priority level it gains (anti-starvation); 0 disables aging.
    pub aging_steps: u64,
    pub cost: PreemptionCost,
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), CoreError> {
        let positive = [
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(CoreError::InvalidArgument(format!("{name} is 0; it must be at least 1")));
            }
        }
        for (name, value) in [
            ("swap_cost_per_block", self.cost.swap_cost_per_block),
            ("recompute_cost_per_token", self.cost.recompute_cost_per_token),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CoreError::InvalidArgument(format!("{name} is {value}; it must be finite and >= 0")));
            }
        }
        Ok(())
    }
}
