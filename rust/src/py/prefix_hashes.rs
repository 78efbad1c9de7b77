//! `prompt_block_hashes`: a prompt's block-hash chain, for routers outside the engine.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::block_manager::{prompt_block_hashes, TokenId};

/// The hashes of the full blocks of `token_ids` as a scheduler's prefix cache names them
/// for a request with `cache_salt` (the engine's salt bytes, as `Scheduler.add_sequence`
/// takes them): the keys of `cached_hashes` and of the KV events' `BlockStored`.
#[pyfunction]
#[pyo3(name = "prompt_block_hashes", signature = (token_ids, block_size, cache_salt = None))]
fn py_prompt_block_hashes(token_ids: Vec<TokenId>, block_size: usize, cache_salt: Option<Vec<u8>>) -> PyResult<Vec<u64>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be >= 1, got 0"));
    }
    Ok(prompt_block_hashes(&token_ids, block_size, cache_salt.as_deref()))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_prompt_block_hashes, m)?)
}
