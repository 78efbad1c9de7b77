//! Atomics used by the lock-free parts of the core, swapped for loom's under `--cfg loom`.
//!
//! Everything concurrent in the crate imports its atomics from here, never from
//! `std::sync::atomic` directly, so that `RUSTFLAGS="--cfg loom"` model-checks the
//! very code that ships (the approach of sharded-slab and crossbeam).

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
