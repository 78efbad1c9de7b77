//! A whole decoder forward (every layer but the embedding lookup and the final norm) on the
//! CPU in one call, for models whose linear layers all run the GGUF GEMV ([`crate::gemv`]).
//!
//! Why: with the linear layers on the Rust kernel, a batch-1 decode step on a 2-core Xeon
//! spent about half its time in ~190 small torch ops per layer (norms, rotary, the page
//! gather, SDPA, residual adds), each costing microseconds of dispatch for nanoseconds of
//! work, and all of it on one thread. Here a layer is a handful of loops over the step's
//! rows, and attention reads the pages where they are (no gather, no mask).
//!
//! Every row is computed on its own: its norms, its products (the GEMV's rows are
//! independent), its attention over its own visible keys. So a row's bits do not depend on
//! which other rows share the step, how many threads run it, or whether it is a decode
//! token, a speculative verification row or a prompt token (batch-invariant by construction).
//!
//! Files: [`step`] (the step's rows, validated once), [`ops`] (norm, rotary, residual adds),
//! [`lanes`] (attention's products and softmax weights, SwiGLU: portable and AVX2 builds of one
//! float order), [`attention`] (paged attention over block tables) and [`attention_split`] (one
//! row's cut finer for a team), [`kv_cache`] (the cache as float32 values or fp8 codes), `kv_rows`
//! (attention's reads of it, fp8 widened run by run) and [`kv_fp8`] (the codes: written and widened
//! by the torch backend's rule), [`stack`] (the layers), `chain` (the layers on a team of threads,
//! one call a step), [`logits`] (each logits row's argmax and log-sum-exp, for sampling), [`error`].

pub mod attention;
pub mod attention_split;
#[cfg(test)]
mod attention_timing;
mod chain;
pub mod error;
pub mod kv_cache;
pub mod kv_bf16;
pub mod kv_fp8;
mod kv_rows;
pub mod lanes;
pub mod logits;
pub mod ops;
pub mod stack;
pub mod step;

pub use error::DecodeError;
pub use stack::{DecodeStack, LayerWeights, StackGeometry};
pub use step::{KvGeometry, StepLayout, StepMeta};
