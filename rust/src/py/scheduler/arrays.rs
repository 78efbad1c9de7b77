//! Conversions between the scheduler's values and NumPy arrays / Python lists: copy pairs and
//! transfers out, `(sequence, token)` pairs in.
//!
//! Why separate: the same conversions serve `StepPlan` and several `Scheduler` methods, and they
//! hold no state of either.

use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::block_manager::{SeqId, Transfer};

pub(super) fn pairs_to_array<'py>(py: Python<'py>, pairs: &[(u32, u32)]) -> Bound<'py, PyArray2<i64>> {
    let flat: Vec<i64> = pairs.iter().flat_map(|&(a, b)| [a as i64, b as i64]).collect();
    let rows = pairs.len();
    flat.into_pyarray(py).reshape([rows, 2]).expect("a [rows * 2] vector reshapes to [rows, 2]")
}

/// Transfers as `[(id, src tier, dst tier, int64 [N, 2] pairs)]`.
pub(super) fn transfers_to_list<'py>(py: Python<'py>, transfers: &[Transfer]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for t in transfers {
        list.append((t.id, t.src.to_string(), t.dst.to_string(), pairs_to_array(py, &t.pairs)))?;
    }
    Ok(list)
}

/// `(sequence, token)` pairs from two equal-length arrays; a length mismatch names both lengths.
pub(super) fn token_pairs(seq_ids: &PyReadonlyArray1<'_, u64>, token_ids: &PyReadonlyArray1<'_, u32>) -> PyResult<Vec<(SeqId, u32)>> {
    let (ids, tokens) = (seq_ids.as_slice()?, token_ids.as_slice()?);
    if ids.len() != tokens.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "seq_ids has {} entries but token_ids has {}; they must match",
            ids.len(),
            tokens.len()
        )));
    }
    Ok(ids.iter().copied().zip(tokens.iter().copied()).collect())
}
