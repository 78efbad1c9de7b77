//! `pagedrs._core.StepPlan`: one step's plan as NumPy arrays, built from a `SchedulerOutput`.
//!
//! Why separate: the plan is a frozen value the runner reads; it has no behaviour of the
//! scheduler's, only the shape of its arrays.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::arrays::{pairs_to_array, transfers_to_list};
use crate::scheduler::SchedulerOutput;

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
    /// int32 [S] draft tokens (speculative decoding) among each sequence's last new tokens.
    #[pyo3(get)]
    num_draft_tokens: Py<PyArray1<i32>>,
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
    pub(super) fn from_output(py: Python<'_>, out: SchedulerOutput) -> PyResult<Self> {
        let rows = out.seq_ids.len();
        let block_tables = out.block_tables.into_pyarray(py).reshape([rows, out.max_blocks])?;
        let transfers = transfers_to_list(py, &out.transfers)?;
        Ok(Self {
            step_id: out.step_id,
            transfers: transfers.unbind(),
            copies: pairs_to_array(py, &out.copies).unbind(),
            seq_ids: out.seq_ids.into_pyarray(py).unbind(),
            do_sample: out.do_sample.into_pyarray(py).unbind(),
            num_draft_tokens: out.num_draft_tokens.into_pyarray(py).unbind(),
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
