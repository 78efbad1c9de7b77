//! Errors of the fused CPU decode: each names the field, the value and what is allowed.

use std::fmt;

use crate::gemv::GemvError;

#[derive(Debug, Clone, PartialEq)]
pub enum DecodeError {
    /// A step input (slot mapping, block tables, lengths, activations) that does not fit.
    Step { field: &'static str, reason: String },
    /// The weights handed to the stack do not fit its geometry.
    Weights { field: String, reason: String },
    /// A product failed (a non-finite activation, a thread pool that could not start).
    Gemv(GemvError),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Step { field, reason } => write!(f, "{field}: {reason}"),
            DecodeError::Weights { field, reason } => write!(f, "{field}: {reason}"),
            DecodeError::Gemv(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl From<GemvError> for DecodeError {
    fn from(e: GemvError) -> Self {
        DecodeError::Gemv(e)
    }
}
