//! Python binding of the scheduler's settings: `pagedrs._core.SchedulerConfig`.

use pyo3::prelude::*;

use super::convert::core_err as to_py_err;
use crate::block_manager::EvictionPolicyKind;
use crate::scheduler::{AdmissionConfig, AdmissionPolicy, KvConfig, KvLayout, PreemptionCost, PreemptionMode, SchedulerConfig};

/// Every setting of a scheduler and its KV memory, in one value (`pagedrs.EngineArgs`
/// builds it). The layout's memory rules are applied by the core, not by the caller.
#[pyclass(name = "SchedulerConfig", module = "pagedrs._core", frozen)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    pub(super) sched: SchedulerConfig,
    pub(super) kv: KvConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (
        *, num_gpu_blocks, block_size, num_cpu_blocks = 0, enable_prefix_caching = true,
        kv_layout = "paged", contiguous_reserve = "max_model_len", max_num_seqs = 256,
        max_num_batched_tokens = 2048, max_model_len = 2048, preemption_mode = "auto",
        watermark = 0.0, aging_steps = 100, swap_cost_per_block = 1.0,
        recompute_cost_per_token = 1.0, host_cache_evicted = false, num_disk_blocks = 0,
        sliding_window = None, admission_policy = "expected_growth", admission_init_ratio = 0.7, admission_min_ratio = 0.1,
        admission_decay_steps = 600, prefill_first = false, eviction_policy = "lru"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: usize,
        block_size: usize,
        num_cpu_blocks: usize,
        enable_prefix_caching: bool,
        kv_layout: &str,
        contiguous_reserve: &str,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        preemption_mode: &str,
        watermark: f64,
        aging_steps: u64,
        swap_cost_per_block: f64,
        recompute_cost_per_token: f64,
        host_cache_evicted: bool,
        num_disk_blocks: usize,
        sliding_window: Option<usize>,
        admission_policy: &str,
        admission_init_ratio: f64,
        admission_min_ratio: f64,
        admission_decay_steps: u64,
        prefill_first: bool,
        eviction_policy: &str,
    ) -> PyResult<Self> {
        let layout = KvLayout::parse(kv_layout, contiguous_reserve).map_err(to_py_err)?;
        let sched = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            preemption_mode: PreemptionMode::parse(preemption_mode).map_err(to_py_err)?,
            aging_steps,
            cost: PreemptionCost { swap_cost_per_block, recompute_cost_per_token },
            admission: AdmissionConfig {
                policy: AdmissionPolicy::parse(admission_policy).map_err(to_py_err)?,
                init_ratio: admission_init_ratio,
                min_ratio: admission_min_ratio,
                decay_steps: admission_decay_steps,
            },
            sliding_window,
            prefill_first,
        };
        let kv = KvConfig {
            layout,
            num_gpu_blocks,
            block_size,
            num_cpu_blocks,
            enable_prefix_caching,
            host_cache_evicted,
            num_disk_blocks,
            watermark,
            eviction_policy: EvictionPolicyKind::parse(eviction_policy).map_err(to_py_err)?,
        };
        kv.validate().map_err(to_py_err)?;
        sched.validate().map_err(to_py_err)?;
        Ok(Self { sched, kv })
    }

    /// Host blocks the layout uses (0 for the contiguous baseline, which cannot swap).
    #[getter]
    fn num_cpu_blocks(&self) -> usize {
        self.kv.effective_cpu_blocks()
    }
    #[getter]
    fn num_gpu_blocks(&self) -> usize {
        self.kv.num_gpu_blocks
    }
    /// Disk page slots the layout uses (0 when off, and for the contiguous baseline).
    #[getter]
    fn num_disk_blocks(&self) -> usize {
        self.kv.effective_disk_blocks()
    }
    /// Whether evicted prefix pages are kept on the host tier.
    #[getter]
    fn host_cache_evicted(&self) -> bool {
        self.kv.host_cache_evicted
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.kv.block_size
    }
    /// The attention window whose outside pages the core releases (None: every page kept).
    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        self.sched.sliding_window
    }
    /// "lru" or "lfu": which cached page each tier gives up first.
    #[getter]
    fn eviction_policy(&self) -> &'static str {
        self.kv.eviction_policy.name()
    }
    /// Device blocks an admission leaves free (0 for the contiguous baseline).
    #[getter]
    fn watermark_blocks(&self) -> usize {
        self.kv.watermark_blocks()
    }
}
