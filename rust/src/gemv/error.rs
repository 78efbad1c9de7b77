//! Errors of the GEMV module: every one names the tensor and the field that is wrong.

use std::fmt;

/// Why a weight could not be packed or a product could not be computed.
#[derive(Debug, Clone, PartialEq)]
pub enum GemvError {
    /// The format name is not one of the supported block formats.
    UnknownFormat { tensor: String, format: String },
    /// `cols` (K) is not a positive multiple of the block size 32 (Q6_K, Q4_K, Q5_K, IQ4_XS, Q3_K: of
    /// the super-block, 256), or `rows` (N) is 0.
    BadShape { tensor: String, rows: usize, cols: usize, reason: &'static str },
    /// The raw block bytes do not match `rows * cols / 32` blocks of the format (Q6_K, Q4_K, Q5_K,
    /// IQ4_XS, Q3_K: `rows * cols / 256` super-blocks of 210, 144, 176, 136 or 110 bytes).
    ByteCount { tensor: String, format: &'static str, rows: usize, cols: usize, expected: usize, got: usize },
    /// A block's f16 scale (`d`) or minimum (`m`; Q4_K, Q5_K: `dmin`) is NaN or infinite; `block`
    /// counts the row's GGUF blocks (Q6_K, Q4_K, Q5_K, IQ4_XS, Q3_K: its super-blocks).
    NonFiniteScale { tensor: String, field: &'static str, row: usize, block: usize, bits: u16 },
    /// The activations' shape does not fit the weight, or the output buffer is the wrong size.
    Input { tensor: String, reason: String },
    /// An activation is NaN or infinite (its block cannot be quantized).
    NonFiniteInput { tensor: String, row: usize, col: usize },
    /// `threads` is 0, or the thread pool could not be built.
    Threads { reason: String },
}

impl fmt::Display for GemvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GemvError::UnknownFormat { tensor, format } => {
                write!(f, "tensor {tensor:?}: format {format:?} is not supported; allowed: \"q4_0\", \"q4_1\", \"q8_0\", \
                           \"q6_k\", \"q4_k\", \"q5_k\", \"q5_0\", \"q5_1\", \"iq4_nl\", \"iq4_xs\", \"q3_k\"")
            }
            GemvError::BadShape { tensor, rows, cols, reason } => {
                write!(f, "tensor {tensor:?}: shape (rows={rows}, cols={cols}) is invalid: {reason}")
            }
            GemvError::ByteCount { tensor, format, rows, cols, expected, got } => write!(
                f,
                "tensor {tensor:?}: {format} data for shape (rows={rows}, cols={cols}) needs {expected} bytes, got {got} (truncated or wrong shape)"
            ),
            GemvError::NonFiniteScale { tensor, field, row, block, bits } => write!(
                f,
                "tensor {tensor:?}: scale field {field:?} of row {row}, block {block} is not finite (f16 bits {bits:#06x})"
            ),
            GemvError::Input { tensor, reason } => write!(f, "tensor {tensor:?}: {reason}"),
            GemvError::NonFiniteInput { tensor, row, col } => {
                write!(f, "tensor {tensor:?}: input x[{row}, {col}] is NaN or infinite")
            }
            GemvError::Threads { reason } => write!(f, "threads: {reason}"),
        }
    }
}

impl std::error::Error for GemvError {}
