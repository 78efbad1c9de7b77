//! `pagedrs._core.BlockManager`: the Python face of [`crate::block_manager::BlockManager`].

use std::collections::HashMap;

use numpy::PyArray1;
use pyo3::exceptions::{PyAssertionError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::{core_err, with_tokens};
use crate::block_manager::{BlockManager, BlockManagerConfig, SwapInStatus};
use crate::error::{BlockId, SeqId, TokenId};

type Pairs = Vec<(BlockId, BlockId)>;

#[pyclass(name = "BlockManager", module = "pagedrs._core")]
pub struct PyBlockManager {
    inner: BlockManager,
    /// Reused buffer for token ids that need converting (lists, int64 arrays).
    scratch: Vec<TokenId>,
    /// Prompts allocated from a Python list with prefix caching off, kept unconverted
    /// (see `allocate`): the list and its length then. The core holds placeholder ids
    /// for them, never read without prefix caching; `tokens` converts on demand.
    lazy_prompts: HashMap<SeqId, (Py<PyList>, usize)>,
    /// Placeholder ids handed to the core for a lazy prompt (zeros, grown, never shrunk).
    placeholder: Vec<TokenId>,
}

impl PyBlockManager {
    /// A lazily kept prompt (prefix caching off) is read back by length: a truncation into
    /// it would make `tokens` disagree, so it is refused.
    fn lazy_prompt_guard(&self, seq_id: SeqId, num_tokens: usize) -> PyResult<()> {
        match self.lazy_prompts.get(&seq_id) {
            Some((_, n)) if num_tokens < *n => Err(PyValueError::new_err(format!(
                "truncate of sequence {seq_id} to {num_tokens} tokens would cut into its {n}-token prompt; \
                 with prefix caching off only appended tokens can be truncated"
            ))),
            _ => Ok(()),
        }
    }
}

#[pymethods]
impl PyBlockManager {
    /// The block-table entry of a page released out of the sliding window (2**32 - 1;
    /// -1 in the scheduler's int32 block tables).
    #[classattr]
    const NULL_BLOCK: BlockId = crate::block_manager::NULL_BLOCK;

    #[new]
    #[pyo3(signature = (num_gpu_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=true, cache_salt=None, host_cache_evicted=false, num_disk_blocks=0, sliding_window=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: usize,
        block_size: usize,
        num_cpu_blocks: usize,
        enable_prefix_caching: bool,
        cache_salt: Option<u64>,
        host_cache_evicted: bool,
        num_disk_blocks: usize,
        sliding_window: Option<usize>,
    ) -> PyResult<Self> {
        let cfg = BlockManagerConfig {
            num_gpu_blocks,
            block_size,
            num_cpu_blocks,
            enable_prefix_caching,
            cache_salt,
            host_cache_evicted,
            num_disk_blocks,
            sliding_window,
            eviction_policy: Default::default(),
        };
        Ok(PyBlockManager {
            inner: BlockManager::new(cfg).map_err(core_err)?,
            scratch: Vec::new(),
            lazy_prompts: HashMap::new(),
            placeholder: Vec::new(),
        })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn num_gpu_blocks(&self) -> usize {
        self.inner.num_gpu_blocks()
    }
    #[getter]
    fn num_cpu_blocks(&self) -> usize {
        self.inner.num_cpu_blocks()
    }
    #[getter]
    fn num_free_gpu_blocks(&self) -> usize {
        self.inner.num_free_gpu_blocks()
    }
    #[getter]
    fn num_free_cpu_blocks(&self) -> usize {
        self.inner.num_free_cpu_blocks()
    }

    fn __contains__(&self, seq_id: SeqId) -> bool {
        self.inner.contains(seq_id)
    }

    fn __len__(&self) -> usize {
        self.inner.seq_ids().count()
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockManager(num_gpu_blocks={}, block_size={}, num_cpu_blocks={}, free_gpu={}, seqs={})",
            self.inner.num_gpu_blocks(),
            self.inner.block_size(),
            self.inner.num_cpu_blocks(),
            self.inner.num_free_gpu_blocks(),
            self.inner.seq_ids().count()
        )
    }

    fn can_allocate(&mut self, token_ids: &Bound<'_, PyAny>) -> PyResult<bool> {
        let inner = &self.inner;
        with_tokens(token_ids, &mut self.scratch, |t| inner.can_allocate(t))
    }

    fn num_blocks_to_allocate(&mut self, token_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let inner = &self.inner;
        with_tokens(token_ids, &mut self.scratch, |t| inner.num_blocks_to_allocate(t))
    }

    /// With prefix caching off the manager needs only the prompt's length, so a list is
    /// not converted here (about 2.5 ns per token): the manager keeps the list and reads
    /// it only when `tokens` asks for it. Its ids are then checked late, and the list must
    /// not change while the sequence lives (`tokens` raises if its length did).
    fn allocate(&mut self, seq_id: SeqId, token_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        if !self.inner.config().enable_prefix_caching {
            if let Ok(list) = token_ids.cast::<PyList>() {
                let n = list.len();
                if self.placeholder.len() < n {
                    self.placeholder.resize(n, 0);
                }
                let hit = self.inner.allocate(seq_id, &self.placeholder[..n]).map_err(core_err)?;
                self.lazy_prompts.insert(seq_id, (list.clone().unbind(), n));
                return Ok(hit);
            }
        }
        let inner = &mut self.inner;
        with_tokens(token_ids, &mut self.scratch, |t| inner.allocate(seq_id, t))?.map_err(core_err)
    }

    fn num_blocks_to_append(&self, seq_id: SeqId, num_new_tokens: usize) -> PyResult<usize> {
        self.inner.num_blocks_to_append(seq_id, num_new_tokens).map_err(core_err)
    }

    fn append_tokens(&mut self, seq_id: SeqId, token_ids: &Bound<'_, PyAny>) -> PyResult<Pairs> {
        let inner = &mut self.inner;
        with_tokens(token_ids, &mut self.scratch, |t| inner.append_tokens(seq_id, t))?.map_err(core_err)
    }

    fn commit(&mut self, seq_id: SeqId, num_computed_tokens: usize) -> PyResult<()> {
        self.inner.commit(seq_id, num_computed_tokens).map_err(core_err)
    }

    /// Drops the tokens past the first `num_tokens` (rejected draft tokens); returns how many
    /// pages left the table. All or nothing; refused (ValueError) for 0, past the length, a
    /// swapped sequence, or a cut into a page the prefix cache holds.
    fn truncate(&mut self, seq_id: SeqId, num_tokens: usize) -> PyResult<usize> {
        self.lazy_prompt_guard(seq_id, num_tokens)?;
        self.inner.truncate(seq_id, num_tokens).map_err(core_err)
    }

    /// Gives the token at `pos`, appended as `PLACEHOLDER_TOKEN` (a draft or a token not
    /// sampled yet); the blocks it completes up to the committed count are hashed.
    fn set_token(&mut self, seq_id: SeqId, pos: usize, token: TokenId) -> PyResult<()> {
        self.inner.set_token(seq_id, pos, token, false).map_err(core_err)
    }

    fn fork(&mut self, py: Python<'_>, parent_id: SeqId, child_id: SeqId) -> PyResult<()> {
        self.inner.fork(parent_id, child_id).map_err(core_err)?;
        if let Some((list, n)) = self.lazy_prompts.get(&parent_id) {
            let shared = (list.clone_ref(py), *n);
            self.lazy_prompts.insert(child_id, shared);
        }
        Ok(())
    }

    fn free(&mut self, seq_id: SeqId) -> PyResult<()> {
        self.inner.free(seq_id).map_err(core_err)?;
        self.lazy_prompts.remove(&seq_id);
        Ok(())
    }

    /// Releases the pages wholly before token `first_needed_pos` (sliding window): their
    /// entries become `NULL_BLOCK`; returns how many were released.
    fn release_outside_window(&mut self, seq_id: SeqId, first_needed_pos: usize) -> PyResult<usize> {
        self.inner.release_outside_window(seq_id, first_needed_pos).map_err(core_err)
    }

    /// Device pages the sequence holds (its table less `NULL_BLOCK` placeholders).
    fn num_held_blocks(&self, seq_id: SeqId) -> PyResult<usize> {
        self.inner.num_held_blocks(seq_id).map_err(core_err)
    }

    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        self.inner.sliding_window()
    }

    fn block_table(&self, seq_id: SeqId) -> PyResult<Vec<BlockId>> {
        Ok(self.inner.block_table(seq_id).map_err(core_err)?.to_vec())
    }

    fn num_tokens(&self, seq_id: SeqId) -> PyResult<usize> {
        self.inner.num_tokens(seq_id).map_err(core_err)
    }

    fn num_committed_tokens(&self, seq_id: SeqId) -> PyResult<usize> {
        self.inner.num_committed_tokens(seq_id).map_err(core_err)
    }

    fn tokens(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<Vec<TokenId>> {
        let stored = self.inner.tokens(seq_id).map_err(core_err)?;
        let Some((list, n)) = self.lazy_prompts.get(&seq_id) else {
            return Ok(stored.to_vec());
        };
        let list = list.bind(py);
        if list.len() != *n {
            return Err(PyValueError::new_err(format!(
                "the prompt list of sequence {seq_id} had {n} tokens at allocate and has {} now; \
                 with prefix caching off the manager reads that list late, so it must not change",
                list.len()
            )));
        }
        let mut out = Vec::with_capacity(stored.len());
        with_tokens(list.as_any(), &mut out, |_| ())?;
        out.extend_from_slice(&stored[*n..]);
        Ok(out)
    }

    fn slot_mapping(&self, seq_id: SeqId, start: usize, end: usize) -> PyResult<Vec<i64>> {
        let mut out = Vec::new();
        self.inner.slot_mapping_into(seq_id, start, end, &mut out).map_err(core_err)?;
        Ok(out)
    }

    /// The slot mapping as an int64 NumPy array (no per-item Python ints).
    fn slot_mapping_array<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqId,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let mut out = Vec::new();
        self.inner.slot_mapping_into(seq_id, start, end, &mut out).map_err(core_err)?;
        Ok(PyArray1::from_vec(py, out))
    }

    fn num_blocks_to_swap_out(&self, seq_ids: Vec<SeqId>) -> PyResult<usize> {
        self.inner.num_blocks_to_swap_out(&seq_ids).map_err(core_err)
    }

    fn swap_out(&mut self, seq_ids: Vec<SeqId>) -> PyResult<Pairs> {
        self.inner.swap_out(&seq_ids).map_err(core_err)
    }

    fn can_swap_in(&self, seq_ids: Vec<SeqId>) -> PyResult<&'static str> {
        Ok(match self.inner.can_swap_in(&seq_ids).map_err(core_err)? {
            SwapInStatus::Ok => "ok",
            SwapInStatus::Later => "later",
            SwapInStatus::Never => "never",
        })
    }

    fn swap_in(&mut self, seq_ids: Vec<SeqId>) -> PyResult<Pairs> {
        self.inner.swap_in(&seq_ids).map_err(core_err)
    }

    fn is_swapped(&self, seq_id: SeqId) -> PyResult<bool> {
        self.inner.is_swapped(seq_id).map_err(core_err)
    }

    /// Device pages of the sequence that no other sequence uses: what `swap_out_pages` can free.
    fn num_swappable_pages(&self, seq_id: SeqId) -> PyResult<usize> {
        self.inner.num_swappable_pages(seq_id).map_err(core_err)
    }

    /// Page-granular swap-out: up to `n` of the sequence's exclusive device pages go to the
    /// host, last entries first; returns (gpu_block, cpu_block) copies. The sequence is
    /// swapped until `swap_in([seq_id])` brings its host pages back.
    fn swap_out_pages(&mut self, seq_id: SeqId, n: usize) -> PyResult<Pairs> {
        self.inner.swap_out_pages(seq_id, n).map_err(core_err)
    }

    /// Per block-table entry, whether it is a host block (else a device block).
    fn host_entries(&self, seq_id: SeqId) -> PyResult<Vec<bool>> {
        self.inner.host_entries(seq_id).map(|h| h.to_vec()).map_err(core_err)
    }

    /// (gpu→cpu evict-to-host copies, cpu→gpu host-hit copies) since the last call.
    fn take_pending_host_copies(&mut self) -> (Pairs, Pairs) {
        self.inner.take_pending_host_copies()
    }

    /// Every copy planned since the last call, as [(src tier, dst tier, [(src, dst)])] in
    /// the order to run them (disk tier included), handed out and completed at once.
    fn take_transfers(&mut self) -> Vec<(String, String, Pairs)> {
        self.inner.take_transfers().into_iter().map(|t| (t.src.to_string(), t.dst.to_string(), t.pairs)).collect()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("prefix_queries", s.prefix_queries)?;
        d.set_item("prefix_hits", s.prefix_hits)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("cow_copies", s.cow_copies)?;
        d.set_item("swap_out_blocks", s.swap_out_blocks)?;
        d.set_item("swap_in_blocks", s.swap_in_blocks)?;
        d.set_item("host_cache_hits", s.host_cache_hits)?;
        d.set_item("host_cache_evictions_saved", s.host_cache_evictions_saved)?;
        d.set_item("prefix_hits_device", s.prefix_hits - s.host_cache_hits - s.disk_cache_hits)?;
        d.set_item("prefix_hits_host", s.host_cache_hits)?;
        d.set_item("prefix_hits_disk", s.disk_cache_hits)?;
        d.set_item("disk_writes", s.disk_writes)?;
        d.set_item("prefix_misses_never_seen", s.prefix_misses_never_seen)?;
        d.set_item("prefix_misses_evicted", s.prefix_misses_evicted)?;
        d.set_item("prefix_misses_evicted_disk", s.prefix_misses_evicted_disk)?;
        d.set_item("prefix_misses_invalidated", s.prefix_misses_invalidated)?;
        d.set_item("window_released_blocks", s.window_released_blocks)?;
        Ok(d)
    }

    /// Raises AssertionError naming the first broken invariant.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(PyAssertionError::new_err)
    }
}
