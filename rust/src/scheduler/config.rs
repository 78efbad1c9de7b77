//! Scheduler settings, validated once at construction.

use crate::block_manager::EvictionPolicyKind;
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

/// How the device KV memory is laid out, with the memory rules each layout implies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// Pages on demand, shared prefixes, swapping and a free-page watermark at admission.
    Paged,
    /// The traditional baseline: one region per sequence reserved up front. It cannot
    /// share (no prefix caching), cannot swap (preemption recomputes), and keeps no
    /// watermark (a reservation never grows, so held-back pages only cost it a sequence).
    Contiguous(ReservePolicy),
}

/// What a contiguous region reserves for a new sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReservePolicy {
    /// `max_model_len` tokens, whatever the request asks (what systems without paging do).
    MaxModelLen,
    /// The request's own worst case: prompt + max_tokens (capped at `max_model_len`).
    Request,
}

impl KvLayout {
    pub fn parse(layout: &str, reserve: &str) -> Result<Self, CoreError> {
        let policy = match reserve {
            "max_model_len" => ReservePolicy::MaxModelLen,
            "request" => ReservePolicy::Request,
            other => {
                return Err(CoreError::InvalidArgument(format!(
                    "contiguous_reserve is {other:?}; allowed: \"max_model_len\", \"request\""
                )))
            }
        };
        match layout {
            "paged" => Ok(Self::Paged),
            "contiguous" => Ok(Self::Contiguous(policy)),
            other => Err(CoreError::InvalidArgument(format!("kv_layout is {other:?}; allowed: \"paged\", \"contiguous\""))),
        }
    }
}

/// The KV memory the scheduler manages, before the layout's rules are applied.
#[derive(Clone, Debug)]
pub struct KvConfig {
    pub layout: KvLayout,
    pub num_gpu_blocks: usize,
    pub block_size: usize,
    /// Host tier for swapped pages (ignored by the contiguous layout).
    pub num_cpu_blocks: usize,
    pub enable_prefix_caching: bool,
    pub host_cache_evicted: bool,
    /// Slots of the persistent disk page tier (0 = off; ignored by the contiguous layout).
    pub num_disk_blocks: usize,
    /// Fraction of device blocks an admission must leave free, in `[0, 1)` (paged only).
    pub watermark: f64,
    /// Which cached page each tier gives up first (paged only; the baseline caches nothing).
    pub eviction_policy: EvictionPolicyKind,
}

impl KvConfig {
    pub fn validate(&self) -> Result<(), CoreError> {
        if !(self.watermark.is_finite() && (0.0..1.0).contains(&self.watermark)) {
            return Err(CoreError::InvalidArgument(format!("watermark is {}; it must be in [0, 1)", self.watermark)));
        }
        Ok(())
    }

    /// Host blocks this layout actually uses: none for the contiguous baseline.
    pub fn effective_cpu_blocks(&self) -> usize {
        match self.layout {
            KvLayout::Paged => self.num_cpu_blocks,
            KvLayout::Contiguous(_) => 0,
        }
    }

    /// Disk slots this layout uses: none for the contiguous baseline (it caches nothing).
    pub fn effective_disk_blocks(&self) -> usize {
        match self.layout {
            KvLayout::Paged => self.num_disk_blocks,
            KvLayout::Contiguous(_) => 0,
        }
    }

    /// Device blocks an admission must leave free.
    pub fn watermark_blocks(&self) -> usize {
        match self.layout {
            KvLayout::Paged => (self.watermark * self.num_gpu_blocks as f64) as usize,
            KvLayout::Contiguous(_) => 0,
        }
    }

    /// The rules the scheduler applies for this layout (see [`KvRules`]).
    pub fn rules(&self) -> KvRules {
        KvRules { layout: self.layout, watermark_blocks: self.watermark_blocks() }
    }
}

/// What the scheduler derives from the KV memory it was built over, once, at
/// construction (`Scheduler::build` from a [`KvConfig`]; `Scheduler::paged` and
/// `Scheduler::contiguous` from their arguments): never set by the caller of a
/// [`SchedulerConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRules {
    /// The layout, for the reservation rule of `add_sequence`.
    pub layout: KvLayout,
    /// Free blocks an admission must leave behind, so new prompts do not
    /// immediately force the running set into preemption (0 for the contiguous layout).
    pub watermark_blocks: usize,
}

/// What a waiting prompt must leave room for before it is admitted (paged layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionPolicy {
    /// Its prompt's pages and the watermark only: running sequences then grow into the
    /// pool and decodes preempt (vLLM v0's rule).
    PromptOnly,
    /// Also the growth the running set and the prompt itself are expected to need at
    /// their peak (see `scheduler::admission`).
    ExpectedGrowth,
}

impl AdmissionPolicy {
    pub fn parse(value: &str) -> Result<Self, CoreError> {
        match value {
            "prompt_only" => Ok(Self::PromptOnly),
            "expected_growth" => Ok(Self::ExpectedGrowth),
            other => Err(CoreError::InvalidArgument(format!(
                "admission_policy is {other:?}; allowed: \"expected_growth\", \"prompt_only\""
            ))),
        }
    }
}

/// The expected-growth rule's settings: each running sequence is expected to still
/// generate `ratio x` its remaining `max_tokens`. The ratio starts at `init_ratio`,
/// decays linearly to `min_ratio` over `decay_steps` steps without a preemption, and
/// rises halfway to 1 after each step that preempts; it never goes below the share of
/// their allowed outputs that finished sequences actually generated.
#[derive(Clone, Copy, Debug)]
pub struct AdmissionConfig {
    pub policy: AdmissionPolicy,
    pub init_ratio: f64,
    pub min_ratio: f64,
    pub decay_steps: u64,
}

impl Default for AdmissionConfig {
    /// SGLang's defaults (0.7, about 0.1, 600 steps).
    fn default() -> Self {
        Self { policy: AdmissionPolicy::ExpectedGrowth, init_ratio: 0.7, min_ratio: 0.1, decay_steps: 600 }
    }
}

impl AdmissionConfig {
    pub fn validate(&self) -> Result<(), CoreError> {
        for (name, value) in [("admission_init_ratio", self.init_ratio), ("admission_min_ratio", self.min_ratio)] {
            if !(value.is_finite() && (0.0..=1.0).contains(&value)) {
                return Err(CoreError::InvalidArgument(format!("{name} is {value}; it must be in [0, 1]")));
            }
        }
        if self.min_ratio > self.init_ratio {
            return Err(CoreError::InvalidArgument(format!(
                "admission_min_ratio is {}; it must not exceed admission_init_ratio ({})",
                self.min_ratio, self.init_ratio
            )));
        }
        Ok(())
    }
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
    /// Steps a waiting sequence waits per priority level it gains (anti-starvation); 0 disables aging.
    pub aging_steps: u64,
    pub cost: PreemptionCost,
    /// How much room a waiting prompt must leave for growth (paged layout only).
    pub admission: AdmissionConfig,
    /// The attention window of every layer (Mistral): after each step's commit, pages
    /// wholly before the window of the sequence's earliest next query are released (paged
    /// layout; see `block_manager::window`). `None`, the default, keeps every page: full
    /// attention, and models that mix full and windowed layers.
    pub sliding_window: Option<usize>,
    /// A step that can admit a waiting prompt runs the admissions (and pending prompt
    /// chunks) without the running decodes, as vLLM v0 did without chunked prefill: a new
    /// request's first token then costs its prefill alone, not its prefill plus a decode
    /// step of the whole batch. Never two such steps in a row, so a decode waits at most
    /// one extra step (the time between two of its tokens at most doubles). Off by default.
    pub prefill_first: bool,
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
        if self.sliding_window == Some(0) {
            return Err(CoreError::InvalidArgument("sliding_window is 0; it must be at least 1 token, or None".into()));
        }
        for (name, value) in [
            ("swap_cost_per_block", self.cost.swap_cost_per_block),
            ("recompute_cost_per_token", self.cost.recompute_cost_per_token),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CoreError::InvalidArgument(format!("{name} is {value}; it must be finite and >= 0")));
            }
        }
        self.admission.validate()
    }
}
