//! Python binding of [`CoreStats`]: `pagedrs._core.CoreStats`, one frozen value with a
//! typed getter per counter, and the dict `Scheduler.stats()` returns, built from it.
//!
//! The field list below is written once; `From<&CoreStats>` destructures the core
//! struct without `..`, so a counter added there (or a name misspelt here) does not
//! compile until this list and the dict follow.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::scheduler::CoreStats;

macro_rules! core_stats_class {
    ($($field:ident: $ty:ty),* $(,)?) => {
        /// Every scheduler and KV counter of one moment (see `Scheduler.core_stats()`);
        /// the names are the keys of `Scheduler.stats()`.
        #[pyclass(name = "CoreStats", module = "pagedrs._core", frozen, get_all)]
        #[derive(Clone)]
        pub struct PyCoreStats {
            $($field: $ty,)*
        }

        impl From<&CoreStats> for PyCoreStats {
            fn from(stats: &CoreStats) -> Self {
                let CoreStats { $($field),* } = *stats;
                Self { $($field),* }
            }
        }

        impl PyCoreStats {
            /// Field names, in the order of `to_dict`.
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            pub fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let d = PyDict::new(py);
                $(d.set_item(stringify!($field), self.$field)?;)*
                Ok(d)
            }
        }
    };
}

core_stats_class! {
    num_gpu_blocks: usize,
    num_free_gpu_blocks: usize,
    num_used_gpu_blocks: usize,
    num_free_cpu_blocks: usize,
    num_running: usize,
    num_waiting: usize,
    num_swapped: usize,
    num_steps: u64,
    num_preemptions: u64,
    num_swap_preemptions: u64,
    num_recompute_preemptions: u64,
    num_deferred_forks: u64,
    num_failed_steps: u64,
    disk_pages_invalidated: u64,
    num_prompt_tokens_computed: u64,
    num_cached_prompt_tokens: u64,
    num_decode_tokens: u64,
    num_pages_swapped_out: u64,
    num_pages_swapped_in: u64,
    step_pages_swapped_out: u64,
    step_pages_swapped_in: u64,
    prefix_queries: u64,
    prefix_hits: u64,
    evictions: u64,
    cow_copies: u64,
    swap_out_blocks: u64,
    swap_in_blocks: u64,
    host_cache_hits: u64,
    prefix_hits_device: u64,
    prefix_hits_host: u64,
    prefix_hits_disk: u64,
    prefix_misses_never_seen: u64,
    prefix_misses_evicted: u64,
    prefix_misses_evicted_disk: u64,
    prefix_misses_invalidated: u64,
    window_released_blocks: u64,
    host_cache_saves: u64,
    disk_writes: u64,
    kv_events_published: u64,
    num_disk_blocks: usize,
    num_cached_gpu_blocks: usize,
    num_cached_cpu_blocks: usize,
    num_cached_disk_blocks: usize,
    num_pinned_host_blocks: usize,
    reserved_slots: usize,
    live_slots: usize,
}

#[pymethods]
impl PyCoreStats {
    /// Every field as a dict (what `Scheduler.stats()` returns).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.to_dict(py)
    }

    /// The field names, in the order of `as_dict()`.
    #[classattr]
    fn fields() -> Vec<&'static str> {
        Self::FIELDS.to_vec()
    }

    fn __repr__(&self) -> String {
        format!(
            "CoreStats(num_steps={}, num_running={}, num_waiting={}, num_free_gpu_blocks={}/{}, prefix_hits={}/{})",
            self.num_steps, self.num_running, self.num_waiting, self.num_free_gpu_blocks, self.num_gpu_blocks, self.prefix_hits, self.prefix_queries
        )
    }
}
