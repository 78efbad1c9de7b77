//! Persistent thread pools, one per thread count, built on first use and kept.
//!
//! Why persistent: a decode step calls the kernel ~120 times; spawning threads per call would
//! cost more than the smaller products take.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::error::GemvError;

static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();

/// The pool of exactly `threads` workers.
pub fn pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, GemvError> {
    if threads == 0 {
        return Err(GemvError::Threads { reason: "threads is 0; allowed: >= 1".to_string() });
    }
    let mut pools = POOLS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.get(&threads) {
        return Ok(p.clone());
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("pagedrs-gemv-{i}"))
        .build()
        .map_err(|e| GemvError::Threads { reason: format!("could not start {threads} threads: {e}") })?;
    let p = Arc::new(p);
    pools.insert(threads, p.clone());
    Ok(p)
}
