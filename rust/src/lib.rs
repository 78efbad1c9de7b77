//! pagedrs core: every decision about KV-cache memory.
//!
//! Which physical page holds which token, who shares it, when it is copied,
//! evicted or moved to host memory, and which requests run in the next step.
//! The core never touches tensors: everything it returns is plain integers
//! (block ids, slots, copy pairs) that the Python runner executes. The two CPU
//! compute modules ([`gemv`], [`cpu_decode`]) are separate from it and used only
//! by the model runner.
//!
//! Modules (one concept each):
//! - [`sync`]: atomics, swapped for loom's under `--cfg loom`.
//! - [`page_pool`]: the lock-free pool of free block ids of one tier.
//! - [`block_manager`]: block tables, refcounts, copy-on-write, prefix cache, swap tiers.
//! - [`scheduler`]: continuous batching with chunked prefill and preemption.
//! - [`gemv`]: GEMV over GGUF block formats (the CPU decode's linear layers).
//! - [`cpu_decode`]: a whole decoder forward on the CPU over GEMV weights (batch-1 decode without torch ops).
//! - [`huge_pages`]: buffers streamed every step (weights, the CPU's KV cache) placed in 2 MiB pages.
//! - `py` (feature `python`): the PyO3 bindings, and nothing else of PyO3.

pub mod sync;
pub mod error;
pub mod page_pool;
pub mod block_manager;
pub mod scheduler;
pub mod gemv;
pub mod cpu_decode;
pub mod huge_pages;

#[cfg(feature = "python")]
mod py;
