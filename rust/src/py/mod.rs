//! The PyO3 bindings: the native module `pagedrs._core`, and nothing else of PyO3.

mod block_manager;
pub(crate) mod convert;
mod core_stats;
mod cpu_decode;
mod cuda_sources;
mod gemv;
mod kv_events;
mod prefix_hashes;
mod scheduler;
mod scheduler_config;

use pyo3::prelude::*;

pub(crate) use convert::OutOfBlocksError;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("OutOfBlocksError", m.py().get_type::<OutOfBlocksError>())?;
    m.add("PLACEHOLDER_TOKEN", crate::block_manager::PLACEHOLDER_TOKEN)?;
    m.add_class::<block_manager::PyBlockManager>()?;
    scheduler::register(m)?;
    cuda_sources::register(m)?;
    prefix_hashes::register(m)?;
    gemv::register(m)?;
    cpu_decode::register(m)?;
    Ok(())
}
