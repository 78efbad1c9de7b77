//! Python bindings of the scheduler: `pagedrs._core.Scheduler` and `StepPlan`.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::core_err as to_py_err;
use crate::block_manager::{DiskPage, SeqId, Transfer};
use crate::scheduler::{
    AdmissionConfig, AdmissionPolicy, KvConfig, KvLayout, PreemptionCost, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput,
};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PySchedulerConfig>()?;
    Ok(())
}

fn pairs_to_array<'py>(py: Python<'py>, pairs: &[(u32, u32)]) -> Bound<'py, PyArray2<i64>> {
    let flat: Vec<i64> = pairs.iter().flat_map(|&(a, b)| [a as i64, b as i64]).collect();
    let rows = pairs.len();
    flat.into_pyarray(py).reshape([rows, 2]).expect("a [rows * 2] vector reshapes to [rows, 2]")
}

/// Transfers as `[(id, src tier, dst tier, int64 [N, 2] pairs)]`.
fn transfers_to_list<'py>(py: Python<'py>, transfers: &[Transfer]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for t in transfers {
        list.append((t.id, t.src.to_string(), t.dst.to_string(), pairs_to_array(py, &t.pairs)))?;
    }
    Ok(list)
}

/// One step's plan, as NumPy arrays ready for the runner. Its Python twin is
/// `pagedrs.step_input.StepInput` (built by `StepInput.from_plan`); a test checks that
/// the two name the same fields.
#[pyclass(name = "StepPlan", module = "pagedrs._core", frozen)]
pub struct PyStepPlan {
    /// This step's id: report it with `Scheduler.complete_step` once it ran or failed.
    #[pyo3(get)]
    step_id: u64,
    /// uint64 [S] scheduled sequences in batch order.
    #[pyo3(get)]
    seq_ids: Py<PyArray1<u64>>,
    /// bool [S] whether a token is sampled after the step (its last new token is its last token).
    #[pyo3(get)]
    do_sample: Py<PyArray1<bool>>,
    /// int64 [T] tokens to compute, sequences back to back.
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    /// int64 [T] position of each token in its sequence.
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    /// int64 [T] slot receiving each token's K/V.
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    /// int32 [S+1] cumulative new-token counts.
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    /// int32 [S] context length after the step.
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    /// int32 [S, max_blocks] block tables, padded with 0.
    #[pyo3(get)]
    block_tables: Py<PyArray2<i32>>,
    /// list of (transfer id, src tier, dst tier, int64 [N, 2] pairs), in execution order.
    #[pyo3(get)]
    transfers: Py<PyList>,
    /// int64 [N, 2] (src, dst) device copies (copy-on-write), after the transfers.
    #[pyo3(get)]
    copies: Py<PyArray2<i64>>,
}

impl PyStepPlan {
    fn from_output(py: Python<'_>, out: SchedulerOutput) -> PyResult<Self> {
        let rows = out.seq_ids.len();
        let block_tables = out.block_tables.into_pyarray(py).reshape([rows, out.max_blocks])?;
        let transfers = transfers_to_list(py, &out.transfers)?;
        Ok(Self {
            step_id: out.step_id,
            transfers: transfers.unbind(),
            copies: pairs_to_array(py, &out.copies).unbind(),
            seq_ids: out.seq_ids.into_pyarray(py).unbind(),
            do_sample: out.do_sample.into_pyarray(py).unbind(),
            input_ids: out.input_ids.into_pyarray(py).unbind(),
            positions: out.positions.into_pyarray(py).unbind(),
            slot_mapping: out.slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: out.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: out.seq_lens.into_pyarray(py).unbind(),
            block_tables: block_tables.unbind(),
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

/// Every setting of a scheduler and its KV memory, in one value (`pagedrs.EngineArgs`
/// builds it). The layout's memory rules are applied by the core, not by the caller.
#[pyclass(name = "SchedulerConfig", module = "pagedrs._core", frozen)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    sched: SchedulerConfig,
    kv: KvConfig,
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
        admission_decay_steps = 600, prefill_first = false
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
    ) -> PyResult<Self> {
        let layout = KvLayout::parse(kv_layout, contiguous_reserve).map_err(to_py_err)?;
        let sched = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            preemption_mode: PreemptionMode::parse(preemption_mode).map_err(to_py_err)?,
            watermark_blocks: 0,
            aging_steps,
            cost: PreemptionCost { swap_cost_per_block, recompute_cost_per_token },
            admission: AdmissionConfig {
                policy: AdmissionPolicy::parse(admission_policy).map_err(to_py_err)?,
                init_ratio: admission_init_ratio,
                min_ratio: admission_min_ratio,
                decay_steps: admission_decay_steps,
            },
            layout,
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
    /// Device blocks an admission leaves free (0 for the contiguous baseline).
    #[getter]
    fn watermark_blocks(&self) -> usize {
        self.kv.watermark_blocks()
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
    fn new(config: PySchedulerConfig) -> PyResult<Self> {
        let inner = Scheduler::build(config.sched, config.kv).map_err(to_py_err)?;
        Ok(Self { inner })
    }

    /// Queues a sequence that may grow by `max_tokens` outputs and fork into `num_samples`
    /// samples; refused (ValueError, nothing changed) when that can never fit the pool.
    /// `cache_salt` (bytes): the sequence shares prefix pages only with equally salted ones.
    #[pyo3(signature = (seq_id, token_ids, *, priority = 0, arrival = 0, max_tokens = 0, num_samples = 1, cache_salt = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_sequence(
        &mut self,
        seq_id: SeqId,
        token_ids: PyReadonlyArray1<'_, u32>,
        priority: i64,
        arrival: u64,
        max_tokens: usize,
        num_samples: usize,
        cache_salt: Option<Vec<u8>>,
    ) -> PyResult<()> {
        let tokens = token_ids.as_slice()?.to_vec();
        self.inner
            .add_salted_sequence(seq_id, tokens, priority, arrival, max_tokens, num_samples, cache_salt.as_deref())
            .map_err(to_py_err)
    }

    /// Plans the next step. The blocks it fills become prefix-cache hits for later steps
    /// once it is reported with `complete_step` (scheduling the next step reports it done).
    /// RuntimeError when planning fails part-way: the scheduler is then unusable.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyStepPlan> {
        let out = self.inner.schedule().map_err(|e| match self.inner.broken() {
            Some(why) => pyo3::exceptions::PyRuntimeError::new_err(why.to_string()),
            None => to_py_err(e),
        })?;
        PyStepPlan::from_output(py, out)
    }

    /// Reports step `step_id` (the oldest in flight): `ok` publishes the blocks it wrote;
    /// otherwise nothing it wrote is ever served, its transfers still in flight fail, and
    /// the sequences it ran or whose pages it lost are reset to be recomputed. Report the
    /// finished transfers with `complete_transfers` first. Returns the reset sequence ids.
    fn complete_step(&mut self, step_id: u64, ok: bool) -> PyResult<Vec<SeqId>> {
        self.inner.complete_step(step_id, ok).map_err(to_py_err)
    }

    /// Ids of the steps handed out and not yet reported, oldest first.
    fn open_steps(&self) -> Vec<u64> {
        self.inner.open_steps()
    }

    /// Disk slots whose page was lost (a failed write, a failed checksum): dropped from
    /// the disk tier's index. Returns how many were dropped.
    fn invalidate_disk_slots(&mut self, slots: Vec<u32>) -> usize {
        self.inner.invalidate_disk_slots(&slots)
    }

    /// Prompt tokens the sequence's first admission found cached (None before it).
    fn num_cached_tokens_of(&self, seq_id: SeqId) -> PyResult<Option<usize>> {
        self.inner.num_cached_tokens_of(seq_id).map_err(to_py_err)
    }

    /// Records one sampled token per sequence (batched: equal-length arrays), all or
    /// nothing: an unknown, repeated or full sequence anywhere in the list changes none.
    fn append_tokens(&mut self, seq_ids: PyReadonlyArray1<'_, u64>, token_ids: PyReadonlyArray1<'_, u32>) -> PyResult<()> {
        let (ids, tokens) = (seq_ids.as_slice()?, token_ids.as_slice()?);
        if ids.len() != tokens.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "seq_ids has {} entries but token_ids has {}; they must match",
                ids.len(),
                tokens.len()
            )));
        }
        let items: Vec<(SeqId, u32)> = ids.iter().copied().zip(tokens.iter().copied()).collect();
        self.inner.append_tokens(&items).map_err(to_py_err)
    }

    /// Reports transfers (ids from `StepPlan.transfers`) finished: their host pins go.
    fn complete_transfers(&mut self, ids: Vec<u64>) -> PyResult<()> {
        self.inner.complete_transfers(&ids).map_err(to_py_err)
    }

    /// Seeds the persistent disk tier before the first step with the pages the store holds,
    /// least recently used first: `slots` uint32 [N], `hashes` / `parents` uint64 [N],
    /// `tokens` uint32 [N, block_size]. Pages whose tokens do not hash to their hash are
    /// skipped. `invalidated` uint64 [M]: hashes of pages the store ignored (their later
    /// misses count as invalidated). Returns how many pages were seeded.
    fn seed_disk(
        &mut self,
        slots: PyReadonlyArray1<'_, u32>,
        hashes: PyReadonlyArray1<'_, u64>,
        parents: PyReadonlyArray1<'_, u64>,
        tokens: numpy::PyReadonlyArray2<'_, u32>,
        invalidated: PyReadonlyArray1<'_, u64>,
    ) -> PyResult<usize> {
        let (slots, hashes, parents) = (slots.as_slice()?, hashes.as_slice()?, parents.as_slice()?);
        let shape = tokens.shape().to_vec();
        let tokens = tokens.as_slice()?;
        if hashes.len() != slots.len() || parents.len() != slots.len() || shape[0] != slots.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "seed_disk needs one entry per page: {} slots, {} hashes, {} parents, {} token rows",
                slots.len(),
                hashes.len(),
                parents.len(),
                shape[0]
            )));
        }
        let width = shape[1];
        let pages: Vec<DiskPage> = (0..slots.len())
            .map(|i| DiskPage {
                slot: slots[i],
                hash: hashes[i],
                parent: parents[i],
                tokens: tokens[i * width..(i + 1) * width].to_vec(),
            })
            .collect();
        self.inner.seed_disk(&pages, invalidated.as_slice()?).map_err(to_py_err)
    }

    /// What disk slots hold (the runner writes it beside each page): uint64 hashes [N],
    /// uint64 parents [N], uint32 tokens [N, block_size]. ValueError for a slot that
    /// caches no page.
    #[allow(clippy::type_complexity)]
    fn disk_pages<'py>(
        &self,
        py: Python<'py>,
        slots: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<(Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u64>>, Bound<'py, PyArray2<u32>>)> {
        let slots = slots.as_slice()?;
        let bs = self.inner.kv().block_size();
        let (mut hashes, mut parents, mut tokens) = (Vec::with_capacity(slots.len()), Vec::with_capacity(slots.len()), Vec::new());
        for &slot in slots {
            let page = self.inner.kv().disk_page(slot).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!("disk slot {slot} caches no page (or is out of range)"))
            })?;
            hashes.push(page.hash);
            parents.push(page.parent);
            tokens.extend(page.tokens);
        }
        let tokens = tokens.into_pyarray(py).reshape([slots.len(), bs])?;
        Ok((hashes.into_pyarray(py), parents.into_pyarray(py), tokens))
    }

    /// Clean shutdown: the transfers that copy every cached device and host page the disk
    /// tier lacks to it, as in `StepPlan.transfers`; report them with `complete_transfers`.
    fn flush_to_disk<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        transfers_to_list(py, &self.inner.flush_to_disk())
    }

    /// Tokens of the sequence as the scheduler records them (prompt + appended).
    fn num_tokens(&self, seq_id: SeqId) -> PyResult<usize> {
        self.inner.num_tokens(seq_id).map_err(to_py_err)
    }

    /// Child shares every page of the parent (running, waiting or swapped; it starts in the parent's state). Fork before appending the step's sampled tokens.
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

    /// Pages the sequence's table holds now (host pages while swapped out, 0 while
    /// waiting); pages released out of the sliding window are not counted.
    fn num_held_blocks(&self, seq_id: SeqId) -> PyResult<usize> {
        if !self.inner.contains(seq_id) {
            return Err(to_py_err(crate::error::CoreError::UnknownSequence(seq_id)));
        }
        Ok(self.inner.kv().num_held_blocks(seq_id).unwrap_or(0))
    }

    /// Device blocks a request needs at worst with the pool to itself (see `add_sequence`).
    #[pyo3(signature = (prompt_len, max_tokens, num_samples = 1))]
    fn worst_case_blocks(&self, prompt_len: usize, max_tokens: usize, num_samples: usize) -> usize {
        self.inner.worst_case_blocks(prompt_len, max_tokens, num_samples)
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
    /// Share of its remaining max_tokens each running sequence is expected to still
    /// generate, as the next admission uses it (see `scheduler::admission`).
    #[getter]
    fn admission_ratio(&self) -> f64 {
        self.inner.admission_ratio()
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
        d.set_item("num_deferred_forks", s.num_deferred_forks)?;
        d.set_item("num_failed_steps", s.num_failed_steps)?;
        d.set_item("disk_pages_invalidated", bm.disk_pages_invalidated)?;
        d.set_item("num_prompt_tokens_computed", s.prompt_tokens_computed)?;
        d.set_item("num_cached_prompt_tokens", s.cached_prompt_tokens)?;
        d.set_item("num_decode_tokens", s.decode_tokens)?;
        d.set_item("num_pages_swapped_out", s.pages_swapped_out)?;
        d.set_item("num_pages_swapped_in", s.pages_swapped_in)?;
        d.set_item("step_pages_swapped_out", s.last_step_pages_swapped_out)?;
        d.set_item("step_pages_swapped_in", s.last_step_pages_swapped_in)?;
        d.set_item("prefix_queries", bm.prefix_queries)?;
        d.set_item("prefix_hits", bm.prefix_hits)?;
        d.set_item("evictions", bm.evictions)?;
        d.set_item("cow_copies", bm.cow_copies)?;
        d.set_item("swap_out_blocks", bm.swap_out_blocks)?;
        d.set_item("swap_in_blocks", bm.swap_in_blocks)?;
        d.set_item("host_cache_hits", bm.host_cache_hits)?;
        let (cached_gpu, cached_cpu, cached_disk) = kv.num_cached_blocks();
        let tier_hits = bm.host_cache_hits + bm.disk_cache_hits;
        d.set_item("prefix_hits_device", bm.prefix_hits - tier_hits)?;
        d.set_item("prefix_hits_host", bm.host_cache_hits)?;
        d.set_item("prefix_hits_disk", bm.disk_cache_hits)?;
        d.set_item("prefix_misses_never_seen", bm.prefix_misses_never_seen)?;
        d.set_item("prefix_misses_evicted", bm.prefix_misses_evicted)?;
        d.set_item("prefix_misses_evicted_disk", bm.prefix_misses_evicted_disk)?;
        d.set_item("prefix_misses_invalidated", bm.prefix_misses_invalidated)?;
        d.set_item("window_released_blocks", bm.window_released_blocks)?;
        d.set_item("host_cache_saves", bm.host_cache_evictions_saved)?;
        d.set_item("disk_writes", bm.disk_writes)?;
        d.set_item("num_disk_blocks", kv.num_disk_blocks())?;
        d.set_item("num_cached_gpu_blocks", cached_gpu)?;
        d.set_item("num_cached_cpu_blocks", cached_cpu)?;
        d.set_item("num_cached_disk_blocks", cached_disk)?;
        d.set_item("num_pinned_host_blocks", kv.num_pinned_host_blocks())?;
        d.set_item("reserved_slots", usage.reserved_slots)?;
        d.set_item("live_slots", usage.live_slots)?;
        Ok(d)
    }

    /// (device pages, host pages) of the sequence's block table: a paused sequence may
    /// hold both (page-granular preemption). KeyError for an unknown id.
    fn page_tiers(&self, seq_id: SeqId) -> PyResult<(usize, usize)> {
        self.inner.page_tiers(seq_id).map_err(to_py_err)
    }

    /// Baseline for comparisons: swap preemption moves every page of the victim at once
    /// (vLLM v0) instead of pausing it and moving pages only as they are needed.
    fn set_whole_sequence_swap(&mut self, on: bool) {
        self.inner.set_whole_sequence_swap(on);
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
}
