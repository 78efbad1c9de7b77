//! KV events as Python values for `Scheduler.take_kv_events`: the tuples the publisher
//! (`pagedrs.kv_events`) packs into vLLM's msgpack structs, in field order.

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::block_manager::KvEvent;
use crate::error::Tier;

/// vLLM's `medium` names.
pub(super) fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Disk => "DISK",
    }
}

/// `medium` back to a tier; the error names the value and what is allowed.
pub(super) fn tier_of(medium: &str) -> PyResult<Tier> {
    match medium {
        "GPU" => Ok(Tier::Gpu),
        "CPU" => Ok(Tier::Cpu),
        "DISK" => Ok(Tier::Disk),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!("medium must be 'GPU', 'CPU' or 'DISK', got {other:?}"))),
    }
}

/// `("BlockStored", hashes, parent or None, token_ids, medium)`,
/// `("BlockRemoved", hashes, medium)` and `("AllBlocksCleared",)`.
pub(super) fn to_list(py: Python<'_>, events: Vec<KvEvent>) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for e in events {
        match e {
            KvEvent::Stored { tier, hashes, parent, tokens } => list.append(("BlockStored", hashes, parent, tokens, medium(tier)))?,
            KvEvent::Removed { tier, hashes } => list.append(("BlockRemoved", hashes, medium(tier)))?,
            KvEvent::AllCleared => list.append(("AllBlocksCleared",))?,
        }
    }
    Ok(list)
}
