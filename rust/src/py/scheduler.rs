//! Python bindings of the scheduler: `pagedrs._core.Scheduler` and `StepPlan`.
//!
//! Files: this one (`Scheduler`: one `#[pymethods]` block, as PyO3 without its
//! `multiple-pymethods` feature requires), `step_plan` (`StepPlan`), `arrays` (NumPy conversions).

mod arrays;
mod step_plan;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::core_err as to_py_err;
use crate::block_manager::{DiskPage, SeqId};
use super::core_stats::PyCoreStats;
use super::scheduler_config::PySchedulerConfig;
use crate::scheduler::Scheduler;

use arrays::{token_pairs, transfers_to_list};
pub use step_plan::PyStepPlan;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PySchedulerConfig>()?;
    m.add_class::<PyCoreStats>()?;
    Ok(())
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

    /// `num_cached_tokens_of` split by tier: (device, host, disk) tokens; None before the
    /// admission, or when its pages were dropped since.
    fn num_cached_tokens_by_tier_of(&self, seq_id: SeqId) -> PyResult<Option<(usize, usize, usize)>> {
        Ok(self.inner.num_cached_tokens_by_tier_of(seq_id).map_err(to_py_err)?.map(|[d, h, k]| (d, h, k)))
    }

    /// Forgets every cached page on every tier; returns the pages each dropped as
    /// (device, host, disk). ValueError, nothing changed, while a sequence holds pages.
    fn reset_prefix_cache(&mut self) -> PyResult<(usize, usize, usize)> {
        let r = self.inner.reset_prefix_cache().map_err(to_py_err)?;
        Ok((r.device, r.host, r.disk))
    }

    /// Pins the leading committed, device-cached full blocks of `token_ids` (prefill the
    /// prompt first) as a hidden sequence: its pages are never evicted until `unpin`.
    /// Returns (pin id, tokens pinned, pages pinned); ValueError, nothing changed, when
    /// not one block is cached or the layout has no prefix cache.
    #[pyo3(signature = (token_ids, *, cache_salt = None))]
    fn pin_prefix(&mut self, token_ids: PyReadonlyArray1<'_, u32>, cache_salt: Option<Vec<u8>>) -> PyResult<(u64, usize, usize)> {
        let pin = self.inner.pin_prefix(token_ids.as_slice()?, cache_salt.as_deref()).map_err(to_py_err)?;
        Ok((pin.id, pin.num_tokens, pin.num_pages))
    }

    /// Releases a pin's pages (ValueError for an unknown id).
    fn unpin(&mut self, pin_id: u64) -> PyResult<()> {
        self.inner.unpin(pin_id).map_err(to_py_err)
    }

    /// Every live pin as (pin id, tokens pinned, pages pinned), by id.
    fn pins(&self) -> Vec<(u64, usize, usize)> {
        self.inner.pins().iter().map(|p| (p.id, p.num_tokens, p.num_pages)).collect()
    }

    /// Pages a pin of `token_ids` would add to the distinct pinned pages (for the cap).
    #[pyo3(signature = (token_ids, *, cache_salt = None))]
    fn num_new_pinned_blocks(&self, token_ids: PyReadonlyArray1<'_, u32>, cache_salt: Option<Vec<u8>>) -> PyResult<usize> {
        Ok(self.inner.num_new_pinned_blocks(token_ids.as_slice()?, cache_salt.as_deref()))
    }

    /// Distinct device pages held by pins.
    fn num_pinned_blocks(&self) -> usize {
        self.inner.num_pinned_blocks()
    }

    /// Turns KV events on (off by default); the first take announces what is cached now.
    fn enable_kv_events(&mut self) {
        self.inner.enable_kv_events()
    }

    /// The tiers' cache changes since the last take, in order, as vLLM's KV events (see
    /// `py/kv_events.rs` for the tuples); medium "GPU", "CPU" or "DISK". Empty while off.
    fn take_kv_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        super::kv_events::to_list(py, self.inner.take_kv_events())
    }

    /// Sorted hashes of the pages the tier `medium` ("GPU", "CPU", "DISK") caches now.
    fn cached_hashes(&self, medium: &str) -> PyResult<Vec<u64>> {
        Ok(self.inner.cached_hashes(super::kv_events::tier_of(medium)?))
    }

    /// Records one sampled token per sequence (batched: equal-length arrays), all or
    /// nothing: an unknown, repeated or full sequence anywhere in the list changes none.
    fn append_tokens(&mut self, seq_ids: PyReadonlyArray1<'_, u64>, token_ids: PyReadonlyArray1<'_, u32>) -> PyResult<()> {
        let items = token_pairs(&seq_ids, &token_ids)?;
        self.inner.append_tokens(&items).map_err(to_py_err)
    }

    /// Asynchronous scheduling: each sequence's next token is a placeholder until
    /// `resolve_placeholders` gives it (see `Scheduler::append_placeholders`).
    fn append_placeholders(&mut self, seq_ids: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        self.inner.append_placeholders(seq_ids.as_slice()?).map_err(to_py_err)
    }

    /// The sampled tokens of the oldest placeholders; sequences no longer here are skipped.
    /// Returns how many were resolved.
    fn resolve_placeholders(&mut self, seq_ids: PyReadonlyArray1<'_, u64>, token_ids: PyReadonlyArray1<'_, u32>) -> PyResult<usize> {
        let items = token_pairs(&seq_ids, &token_ids)?;
        self.inner.resolve_placeholders(&items).map_err(to_py_err)
    }

    /// Takes back the placeholders whose tokens will never come (their step failed).
    fn drop_placeholders(&mut self, seq_ids: PyReadonlyArray1<'_, u64>) -> PyResult<usize> {
        self.inner.drop_placeholders(seq_ids.as_slice()?).map_err(to_py_err)
    }

    /// Speculative decoding: draft tokens for the sequence's next decode (uint32 array;
    /// empty clears it). Used by the next `schedule` where budget and pages allow.
    fn set_proposal(&mut self, seq_id: SeqId, token_ids: PyReadonlyArray1<'_, u32>) -> PyResult<()> {
        self.inner.set_proposal(seq_id, token_ids.as_slice()?).map_err(to_py_err)
    }

    /// Replaces the drafts the last `schedule` gave the sequence (uint32 array, exactly as many
    /// as it holds): a proposer that guesses after the plan (the draft model).
    fn set_draft_tokens(&mut self, seq_id: SeqId, token_ids: PyReadonlyArray1<'_, u32>) -> PyResult<()> {
        self.inner.set_draft_tokens(seq_id, token_ids.as_slice()?).map_err(to_py_err)
    }

    /// After the step that computed the sequence's drafts: keeps the first `num_accepted`,
    /// cuts the rest from its tokens and pages; returns how many were cut. Call it before
    /// appending the correction token; a sequence no longer here is skipped.
    fn accept_drafts(&mut self, seq_id: SeqId, num_accepted: usize) -> PyResult<usize> {
        self.inner.accept_drafts(seq_id, num_accepted).map_err(to_py_err)
    }

    /// A verify step cut short after it was reported done: the engine's record of the sequence
    /// holds its first `num_tokens` tokens; the scheduler agrees and computes the last one again
    /// (rust/src/scheduler/speculation.rs). Returns whether anything changed.
    fn rewind(&mut self, seq_id: SeqId, num_tokens: usize) -> PyResult<bool> {
        self.inner.rewind(seq_id, num_tokens).map_err(to_py_err)
    }

    /// Sets how many steps may be in flight (1: synchronous, the default; 2: asynchronous scheduling).
    fn set_max_steps_in_flight(&mut self, n: usize) -> PyResult<()> {
        self.inner.set_max_steps_in_flight(n).map_err(to_py_err)
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

    /// Scheduler and KV counters plus utilization, as one typed value.
    fn core_stats(&self) -> PyCoreStats {
        PyCoreStats::from(&self.inner.core_stats())
    }

    /// The same as `core_stats()`, as one dict with a key per field.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        PyCoreStats::from(&self.inner.core_stats()).to_dict(py)
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
