//! The one error type of the core, and the memory tiers it names.
//!
//! Every fallible call of the core returns [`CoreError`]; a call that fails changes
//! no state. The Python bindings map the variants onto `OutOfBlocksError`,
//! `KeyError` and `ValueError`.

use std::fmt;

/// A sequence (request sample) id, chosen by the caller.
pub type SeqId = u64;
/// A physical block (page) id, dense in `0..num_blocks` of its tier.
pub type BlockId = u32;
/// A token id.
pub type TokenId = u32;

/// A token not sampled yet: asynchronous scheduling plans a sequence's next step before its
/// previous step's token is known, and the runner fills the input from the device. No block
/// holding one is hashed (so none is ever a prefix-cache hit) until `BlockManager::set_token` gives it.
pub const PLACEHOLDER_TOKEN: TokenId = TokenId::MAX;

/// A memory tier: device (GPU) pages, host (CPU) pages, or page slots of the
/// persistent disk store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Gpu,
    Cpu,
    Disk,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
        })
    }
}

/// Why a core call failed. The state is unchanged after any of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// The tier cannot provide `needed` blocks; only `available` can be had now.
    OutOfBlocks { tier: Tier, needed: usize, available: usize },
    /// No live sequence has this id.
    UnknownSequence(SeqId),
    /// An argument is outside what the call allows; the message says which and why.
    InvalidArgument(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::OutOfBlocks { tier, needed, available } => write!(
                f,
                "out of {tier} blocks: needed {needed}, only {available} free (free or evictable); nothing was changed"
            ),
            CoreError::UnknownSequence(seq) => {
                write!(f, "unknown sequence id {seq}: it was never allocated or was already freed")
            }
            CoreError::InvalidArgument(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for CoreError {}

/// Shorthand for an [`CoreError::InvalidArgument`] built with `format!`.
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::CoreError::InvalidArgument(format!($($arg)*)) };
}
pub(crate) use invalid;
