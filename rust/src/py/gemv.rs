//! `pagedrs._core.GgufMatrix`: a GGUF-quantized weight repacked for the GEMV kernels (or a fused
//! product of such weights in different formats, `GgufMatrix.fused`), and `gemv_kernels()`, the
//! kernels this CPU runs. The GIL is released while a product runs.

use std::sync::Arc;

use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::gemv::{Format, FusedMatrix, GemvError, Kernel, PackedMatrix};

fn value_err(e: GemvError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A weight `[rows, cols]` from raw GGUF block bytes; `matmul(x)` computes `x @ W.T`. One format,
/// or (`GgufMatrix.fused`) the rows of several weights, each in its own format.
#[pyclass(name = "GgufMatrix", module = "pagedrs._core", frozen)]
pub struct PyGgufMatrix {
    /// Shared with every `DecodeStack` built over this weight, and with the fused products it is a part of (no copy).
    pub(crate) inner: Arc<FusedMatrix>,
}

#[pymethods]
impl PyGgufMatrix {
    #[new]
    #[pyo3(signature = (data, rows, cols, format, name = "weight"))]
    fn new(py: Python<'_>, data: PyReadonlyArray1<'_, u8>, rows: usize, cols: usize, format: &str, name: &str) -> PyResult<Self> {
        let fmt = Format::parse(format)
            .ok_or_else(|| value_err(GemvError::UnknownFormat { tensor: name.to_string(), format: format.to_string() }))?;
        let raw = data.as_slice().map_err(|_| {
            PyValueError::new_err(format!("tensor {name:?}: data must be a contiguous 1-D uint8 array"))
        })?;
        let inner = py.detach(|| PackedMatrix::from_gguf(name, raw, rows, cols, fmt)).map_err(value_err)?;
        Ok(PyGgufMatrix { inner: Arc::new(FusedMatrix::from(inner)) })
    }

    /// One product whose rows are `parts`' rows in order, each part in its own format (fused siblings a
    /// GGUF file stores in different types: a K-quant mix's q / k beside v). The parts' blocks are shared,
    /// not copied; every part must take the same number of columns.
    #[staticmethod]
    #[pyo3(signature = (parts, name = "weight"))]
    fn fused(parts: Vec<PyRef<'_, PyGgufMatrix>>, name: &str) -> PyResult<Self> {
        let mut packed = Vec::new();
        for p in &parts {
            packed.extend(p.inner.parts().iter().cloned());
        }
        Ok(PyGgufMatrix { inner: Arc::new(FusedMatrix::new(name, packed).map_err(value_err)?) })
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }
    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    /// The block format (`"q4_k"`); a fused product's parts' formats joined by `+` (`"q4_k+q4_k+q6_k"`).
    #[getter]
    fn format(&self) -> String {
        self.inner.parts().iter().map(|p| p.format().name()).collect::<Vec<_>>().join("+")
    }
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }
    /// Bytes one product streams: the GGUF tensor's size; for Q6_K 28 bytes a row per 32 weights,
    /// more than the file's 210 per 256; for Q4_K 148 a row per 256, more than the file's 144; for
    /// Q5_K 180, more than the file's 176 (`PackedMatrix::weight_bytes`).
    #[getter]
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }

    /// `x @ W.T` as a new float32 array `[M, rows]`; `x` is a float32 `[M, cols]` NumPy array
    /// or CPU torch tensor. `kernel` None picks the fastest this CPU runs.
    #[pyo3(signature = (x, threads = 1, kernel = None))]
    fn matmul<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        threads: usize,
        kernel: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let name = self.inner.name();
        let kernel = match kernel {
            None => Kernel::best(),
            Some(k) => Kernel::parse(k).ok_or_else(|| {
                let allowed: Vec<String> = Kernel::ALL.iter().map(|k| format!("{:?}", k.name())).collect();
                PyValueError::new_err(format!("tensor {name:?}: kernel {k:?} is unknown; allowed: {}", allowed.join(", ")))
            })?,
        };
        let is_array = x.cast::<PyArray2<f32>>().is_ok();
        // A torch tensor: its NumPy view (zero-copy on the CPU).
        let arr = if is_array || !x.hasattr("numpy")? { x.clone() } else { x.call_method0("numpy")? };
        let arr = arr.cast::<PyArray2<f32>>().map_err(|_| {
            PyTypeError::new_err(format!("tensor {name:?}: x must be a 2-D float32 NumPy array or CPU torch tensor"))
        })?;
        let ro = arr.readonly();
        let m = ro.shape()[0];
        if ro.shape()[1] != self.inner.cols() {
            return Err(PyValueError::new_err(format!(
                "tensor {name:?}: x has shape [{m}, {}]; this weight needs [M, {}]",
                ro.shape()[1],
                self.inner.cols()
            )));
        }
        // Row-major memory only: `as_slice` also accepts a Fortran-ordered array (a transposed
        // view), whose memory order is not the rows the kernel reads, so it would multiply the
        // transpose. Anything else is copied in logical (row-major) order.
        let copy;
        let xs = match ro.as_slice() {
            Ok(s) if ro.is_c_contiguous() => s,
            _ => {
                copy = ro.as_array().iter().copied().collect::<Vec<f32>>();
                &copy[..]
            }
        };
        let out = PyArray2::<f32>::zeros(py, [m, self.inner.rows()], false);
        {
            let mut rw = out.readwrite();
            let os = rw.as_slice_mut().expect("a new array is contiguous");
            py.detach(|| self.inner.matmul(xs, m, os, threads, kernel)).map_err(value_err)?;
        }
        Ok(out)
    }

    /// Whether `dequantize_rows` reads this matrix: one part, in Q8_0 or Q6_K.
    #[getter]
    fn reads_rows(&self) -> bool {
        matches!(self.inner.parts(), [p] if p.reads_rows())
    }

    /// Rows `ids` (a 1-D int64 array) as a new float32 array `[len(ids), cols]`, each weight the float32
    /// gguf-py's dequantization gives (the lookup of a tied head's token table from the head's own tiles,
    /// `gemv/rows.rs`). Refused by name: a matrix `reads_rows` is False for, an id outside `0..rows`.
    fn dequantize_rows<'py>(&self, py: Python<'py>, ids: PyReadonlyArray1<'py, i64>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let name = self.inner.name();
        let [part] = self.inner.parts() else {
            return Err(PyValueError::new_err(format!(
                "tensor {name:?}: rows of a fused product ({}) cannot be read; one part in q8_0 or q6_k can",
                self.format()
            )));
        };
        let copy;
        let ids = match ids.as_slice() {
            Ok(s) => s,
            Err(_) => {
                copy = ids.as_array().iter().copied().collect::<Vec<i64>>();
                &copy[..]
            }
        };
        part.check_row_ids(ids).map_err(value_err)?; // before the output is allocated
        let out = PyArray2::<f32>::zeros(py, [ids.len(), part.cols()], false);
        {
            let mut rw = out.readwrite();
            let os = rw.as_slice_mut().expect("a new array is contiguous");
            py.detach(|| part.dequantize_rows(ids, os)).map_err(value_err)?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!("GgufMatrix(name={:?}, rows={}, cols={}, format={:?})", self.inner.name(), self.inner.rows(),
                self.inner.cols(), self.format())
    }
}

/// The GEMV kernels this CPU runs (detected at run time), slowest first; the last is the default.
#[pyfunction]
fn gemv_kernels() -> Vec<&'static str> {
    Kernel::available().into_iter().map(Kernel::name).collect()
}

/// Asks the kernel to back the whole 2 MiB pages of `nbytes` bytes at address `ptr` with huge
/// pages (`crate::huge_pages::advise`); returns the bytes advised (0 where none: a hint only).
/// For a CPU tensor streamed every step (the KV cache), called before its pages are first
/// written. Any address is safe to pass: the advice changes no byte and no mapping's access.
#[pyfunction]
fn advise_huge_pages(ptr: usize, nbytes: usize) -> usize {
    crate::huge_pages::advise(ptr as *const u8, nbytes)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGgufMatrix>()?;
    m.add_function(wrap_pyfunction!(advise_huge_pages, m)?)?;
    m.add_function(wrap_pyfunction!(gemv_kernels, m)?)
}
