//! Python bindings of the scheduler: `pagedrs._core.Scheduler` and `StepPlan`.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::core_err as to_py_err;
use crate::block_manager::{BlockManagerConfig, SeqId};
use crate::scheduler::{PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    Ok(())
}

fn pairs_to_array<'py>(py: Python<'py>, pairs: &[(u32, u32)]) -> Bound<'py, PyArray2<i64>> {
    let flat: Vec<i64> = pairs.iter().flat_map(|&(a, b)| [a as i64, b as i64]).collect();
    let rows = pairs.len();
    flat.into_pyarray(py).reshape([rows, 2]).expect("a [rows * 2] vector reshapes to [rows, 2]")
}

/// One step's plan, as NumPy arrays ready for the runner (see `pagedrs.step_input.StepInput`).
#[pyclass(name = "StepPlan", module = "pagedrs._core", frozen)]
pub struct PyStepPlan {
    #[pyo3(get)]
    seq_ids: Py<PyArray1<u64>>,
    #[pyo3(get)]
    num_scheduled_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    do_sample: Py<PyArray1<bool>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    swap_out: Py<PyArray2<i64>>,
    #[pyo3(get)]
    swap_in: Py<PyArray2<i64>>,
    #[pyo3(get)]
    copies: Py<PyArray2<i64>>,
    #[pyo3(get)]
    preempted: Py<PyArray1<u64>>,
}

impl PyStepPlan {
    fn from_output(py: Python<'_>, out: SchedulerOutput) -> PyResult<Self> {
        let rows = out.seq_ids.len();
        let block_tables = out.block_tables.into_pyarray(py).reshape([rows, out.max_blocks])?;
        Ok(Self {
            swap_out: pairs_to_array(py, &out.swap_out).unbind(),
            swap_in: pairs_to_array(py, &out.swap_in).unbind(),
            copies: pairs_to_array(py, &out.copies).unbind(),
            seq_ids: out.seq_ids.into_pyarray(py).unbind(),
            num_scheduled_tokens: out.num_scheduled_tokens.into_pyarray(py).unbind(),
            do_sample: out.do_sample.into_pyarray(py).unbind(),
            input_ids: out.input_ids.into_pyarray(py).unbind(),
            positions: out.positions.into_pyarray(py).unbind(),
            slot_mapping: out.slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: out.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: out.seq_lens.into_pyarray(py).unbind(),
            block_tables: block_tables.unbind(),
            preempted: out.preempted.into_pyarray(py).unbind(),
        })
    }
}

#[pymethods]
impl PyStepPlan {
    /// Number of scheduled sequences.
    #[getter]
    fn num_seqs(&self, py: Python<'_>) -> usize {
        self.seq_ids.bind(py).len()
    }
}

/// The continuous-batching scheduler over a paged (or contiguous) KV space.
#[pyclass(name = "Scheduler", module = "pagedrs._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        num_gpu_blocks, block_size, *, num_cpu_blocks = 0, enable_prefix_caching = true,
        kv_layout = "paged", max_num_seqs = 256, max_num_batched_tokens = 2048,
        max_model_len = 2048, preemption_mode = "auto", watermark_blocks = 0, aging_steps = 100,
        swap_cost_per_block = 1.0, recompute_cost_per_token = 1.0, host_cache_evicted = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: usize,
        block_size: usize,
        num_cpu_blocks: usize,
        enable_prefix_caching: bool,
        kv_layout: &str,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        preemption_mode: &str,
        watermark_blocks: usize,
        aging_steps: u64,
        swap_cost_per_block: f64,
        recompute_cost_per_token: f64,
        host_cache_evicted: bool,
    ) -> PyResult<Self> {
        let config = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            preemption_mode: PreemptionMode::parse(preemption_mode).map_err(to_py_err)?,
            watermark_blocks,
            aging_steps,
            cost: PreemptionCost { swap_cost_per_block, recompute_cost_per_token },
        };
        let inner = match kv_layout {
            "paged" => Scheduler::paged(
                config,
                BlockManagerConfig {
                    num_gpu_blocks,
                    block_size,
                    num_cpu_blocks,
                    enable_prefix_caching,
                    host_cache_evicted,
                    cache_salt: None,
                },
            ),
            "contiguous" => Scheduler::contiguous(config, num_gpu_blocks, block_size),
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "kv_layout is {other:?}; allowed: \"paged\", \"contiguous\""
                )))
            }
        }
        .map_err(to_py_err)?;
        Ok(Self { inner })
    }

    /// Queues a sequence. `reserve_tokens` is what the contiguous layout reserves up front.
    #[pyo3(signature = (seq_id, token_ids, priority = 0, arrival = 0, reserve_tokens = 0))]
    fn add_sequence(
        &mut self,
        seq_id: SeqId,
        token_ids: PyReadonlyArray1<'_, u32>,
        priority: i64,
        arrival: u64,
        reserve_tokens: usize,
    ) -> PyResult<()> {
        let tokens = token_ids.as_slice()?.to_vec();
        self.inner.add_sequence(seq_id, tokens, priority, arrival, reserve_tokens).map_err(to_py_err)
    }

    /// Plans the next step (and commits the scheduled tokens' blocks).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyStepPlan> {
        let out = self.inner.schedule().map_err(to_py_err)?;
        PyStepPlan::from_output(py, out)
    }

    /// Records one sampled token per sequence (batched: equal-length arrays).
    fn append_tokens(&mut self, seq_ids: PyReadonlyArray1<'_, u64>, token_ids: PyReadonlyArray1<'_, u32>) -> PyResult<()> {
        let (ids, tokens) = (seq_ids.as_slice()?, token_ids.as_slice()?);
        if ids.len() != tokens.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "seq_ids has {} entries but token_ids has {}; they must match",
                ids.len(),
                tokens.len()
            )));
        }
        for (&id, &token) in ids.iter().zip(tokens) {
            self.inner.append_token(id, token).map_err(to_py_err)?;
        }
        Ok(())
    }

    /// Child shares the running parent's pages. Fork before appending the step's sampled tokens.
    fn fork(&mut self, parent_id: SeqId, child_id: SeqId) -> PyResult<()> {
        self.inner.fork(parent_id, child_id).map_err(to_py_err)
    }

    /// Ends a sequence (finished or aborted); its pages go back now.
    fn finish(&mut self, seq_id: SeqId) -> PyResult<()> {
        self.inner.finish(seq_id).map_err(to_py_err)
    }

    fn contains(&self, seq_id: SeqId) -> bool {
        self.inner.contains(seq_id)
    }

    /// Whether a sequence of this length could ever run (the whole pool to itself).
    #[pyo3(signature = (num_tokens, reserve_tokens = 0))]
    fn fits_in_pool(&self, num_tokens: usize, reserve_tokens: usize) -> bool {
        self.inner.fits_in_pool(num_tokens, reserve_tokens)
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }
    #[getter]
    fn num_swapped(&self) -> usize {
        self.inner.num_swapped()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.kv().block_size()
    }
    #[getter]
    fn num_gpu_blocks(&self) -> usize {
        self.inner.kv().num_blocks()
    }

    /// Scheduler and KV counters plus utilization, as one dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let kv = self.inner.kv();
        let s = self.inner.stats();
        let bm = kv.block_manager_stats();
        let usage = self.inner.kv_usage();
        d.set_item("num_gpu_blocks", kv.num_blocks())?;
        d.set_item("num_free_gpu_blocks", kv.num_free_blocks())?;
        d.set_item("num_used_gpu_blocks", kv.num_blocks() - kv.num_free_blocks())?;
        d.set_item("num_free_cpu_blocks", kv.num_free_host_blocks())?;
        d.set_item("num_running", self.inner.num_running())?;
        d.set_item("num_waiting", self.inner.num_waiting())?;
        d.set_item("num_swapped", self.inner.num_swapped())?;
        d.set_item("num_steps", s.num_steps)?;
        d.set_item("num_preemptions", s.num_swap_preemptions + s.num_recompute_preemptions)?;
        d.set_item("num_swap_preemptions", s.num_swap_preemptions)?;
        d.set_item("num_recompute_preemptions", s.num_recompute_preemptions)?;
        d.set_item("num_prompt_tokens_computed", s.prompt_tokens_computed)?;
        d.set_item("num_cached_prompt_tokens", s.cached_prompt_tokens)?;
        d.set_item("num_decode_tokens", s.decode_tokens)?;
        d.set_item("prefix_queries", bm.prefix_queries)?;
        d.set_item("prefix_hits", bm.prefix_hits)?;
        d.set_item("evictions", bm.evictions)?;
        d.set_item("cow_copies", bm.cow_copies)?;
        d.set_item("swap_out_blocks", bm.swap_out_blocks)?;
        d.set_item("swap_in_blocks", bm.swap_in_blocks)?;
        d.set_item("reserved_slots", usage.reserved_slots)?;
        d.set_item("live_slots", usage.live_slots)?;
        Ok(d)
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
}
