//! The CUDA kernel sources, compiled into the extension so an installed wheel
//! carries them: `cuda/` stays the one place they are written, and
//! `pagedrs.kernels.sources` falls back to these when no `cuda/` folder is found.

use pyo3::prelude::*;

const CUDA_SOURCES: &[(&str, &str)] = &[
    ("paged_attention.cu", include_str!("../../../cuda/paged_attention.cu")),
    ("cache_ops.cu", include_str!("../../../cuda/cache_ops.cu")),
    ("dtype.cuh", include_str!("../../../cuda/dtype.cuh")),
];

/// File name -> text of every file in `cuda/`, as built into this extension.
#[pyfunction]
fn cuda_sources() -> Vec<(&'static str, &'static str)> {
    CUDA_SOURCES.to_vec()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_sources, m)?)
}
