//! `pagedrs._core.DecodeStack`: every decoder layer of a GGUF model in one call on the CPU
//! (`crate::cpu_decode`). Inputs are NumPy arrays (a CPU torch tensor's `.numpy()` is a view);
//! the KV cache is written in place. The GIL is released while the layers run.

use numpy::ndarray::Dimension;
use numpy::{
    Element, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArray3, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::gemv::PyGgufMatrix;
use crate::cpu_decode::attention::Simd;
use crate::cpu_decode::kv_cache::{Fp8Cache, KvCacheMut};
use crate::cpu_decode::kv_fp8::Fp8;
use crate::cpu_decode::{DecodeError, DecodeStack, KvGeometry, LayerWeights, StackGeometry, StepMeta};
use crate::gemv::Kernel;

/// How the cache's elements are stored (`DecodeStack.forward`'s `kv_dtype`).
enum Codes {
    F32,
    Bf16,
    Fp8(Fp8),
}

/// `kv_cache` as a writable array of `T`, or a TypeError saying what `kv_dtype` needs (`what`).
fn writable<'py, T: Element>(kv_cache: &Bound<'py, PyAny>, what: &str, kv_dtype: &str) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    kv_cache.extract::<PyReadwriteArrayDyn<'py, T>>()
        .map_err(|_| PyTypeError::new_err(format!("kv_cache: must be {what} for kv_dtype {kv_dtype:?}")))
}

/// The cache's geometry from its shape `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`, and
/// its elements; a ValueError for another shape or a cache that is not C-contiguous.
fn cache_layout<'a, T: Element>(cache: &'a mut PyReadwriteArrayDyn<'_, T>) -> PyResult<(KvGeometry, &'a mut [T])> {
    let shape = cache.shape().to_vec();
    if shape.len() != 6 || shape[1] != 2 || !cache.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "kv_cache: has shape {shape:?}; need a C-contiguous [layers, 2, num_blocks, block_size, kv_heads, head_dim]"
        )));
    }
    let kvg = KvGeometry { layers: shape[0], num_blocks: shape[2], block_size: shape[3], kv_heads: shape[4], head_dim: shape[5] };
    let elements = cache.as_slice_mut().map_err(|_| PyValueError::new_err("kv_cache: must be C-contiguous"))?;
    Ok((kvg, elements))
}

fn value_err(e: DecodeError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The array's memory as a slice; `field` names it when it is not C-contiguous.
fn contiguous<'a, T: Element, D: Dimension>(a: &'a PyReadonlyArray<'_, T, D>, field: &str) -> PyResult<&'a [T]> {
    match a.as_slice() {
        Ok(s) if a.is_c_contiguous() => Ok(s),
        _ => Err(PyValueError::new_err(format!("{field}: must be a C-contiguous array"))),
    }
}

fn vector(a: &PyReadonlyArray1<'_, f32>, field: &str) -> PyResult<Vec<f32>> {
    Ok(contiguous(a, field)?.to_vec())
}

#[pyclass(name = "DecodeStack", module = "pagedrs._core", frozen)]
pub struct PyDecodeStack {
    inner: DecodeStack,
}

#[pymethods]
impl PyDecodeStack {
    /// One entry per layer in each list; the matrices are shared, not copied.
    #[new]
    #[pyo3(signature = (*, input_norms, post_norms, qkv, qkv_bias, o, gate_up, down, sliding_windows, hidden, heads,
                        kv_heads, head_dim, intermediate, eps, scale, final_norm = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norms: Vec<PyReadonlyArray1<'_, f32>>,
        post_norms: Vec<PyReadonlyArray1<'_, f32>>,
        qkv: Vec<PyRef<'_, PyGgufMatrix>>,
        qkv_bias: Vec<Option<PyReadonlyArray1<'_, f32>>>,
        o: Vec<PyRef<'_, PyGgufMatrix>>,
        gate_up: Vec<PyRef<'_, PyGgufMatrix>>,
        down: Vec<PyRef<'_, PyGgufMatrix>>,
        sliding_windows: Vec<Option<usize>>,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        intermediate: usize,
        eps: f32,
        scale: f32,
        final_norm: Option<PyReadonlyArray1<'_, f32>>,
    ) -> PyResult<Self> {
        let n = qkv.len();
        let lens = [("input_norms", input_norms.len()), ("post_norms", post_norms.len()), ("qkv_bias", qkv_bias.len()),
                    ("o", o.len()), ("gate_up", gate_up.len()), ("down", down.len()),
                    ("sliding_windows", sliding_windows.len())];
        for (name, len) in lens {
            if len != n {
                return Err(PyValueError::new_err(format!("{name}: has {len} entries; qkv has {n} (one per layer)")));
            }
        }
        let mut layers = Vec::with_capacity(n);
        for l in 0..n {
            layers.push(LayerWeights {
                input_norm: vector(&input_norms[l], &format!("input_norms[{l}]"))?,
                post_norm: vector(&post_norms[l], &format!("post_norms[{l}]"))?,
                qkv: qkv[l].inner.clone(),
                qkv_bias: qkv_bias[l].as_ref().map(|b| vector(b, &format!("qkv_bias[{l}]"))).transpose()?,
                o: o[l].inner.clone(),
                gate_up: gate_up[l].inner.clone(),
                down: down[l].inner.clone(),
                sliding_window: sliding_windows[l],
            });
        }
        let geo = StackGeometry { hidden, heads, kv_heads, head_dim, intermediate, eps, scale };
        let mut inner = DecodeStack::new(geo, layers).map_err(value_err)?;
        if let Some(norm) = &final_norm {
            inner = inner.with_final_norm(vector(norm, "final_norm")?).map_err(value_err)?;
        }
        Ok(PyDecodeStack { inner })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    /// Whether `forward` returns the rows after the model's final norm.
    #[getter]
    fn has_final_norm(&self) -> bool {
        self.inner.has_final_norm()
    }

    /// Seconds spent since the last `reset_timings` in the GEMV products, attention and the
    /// elementwise ops, and the steps run.
    fn timings(&self) -> (f64, f64, f64, u64) {
        let (p, a, e, n) = self.inner.timings.read();
        (p as f64 * 1e-9, a as f64 * 1e-9, e as f64 * 1e-9, n)
    }

    fn reset_timings(&self) {
        self.inner.timings.reset();
    }

    /// `residual + h` after the last layer (normed by the final norm when the stack has it), float32
    /// `[T, hidden]`; writes the step's K/V into `kv_cache` (`[layers, 2, num_blocks, block_size,
    /// kv_heads, head_dim]`): float32 values (`kv_dtype="float32"`), bfloat16 codes as uint16
    /// (`"bfloat16"`, rounded to nearest even), or fp8 codes as uint8 (`"fp8_e4m3"` / `"fp8_e5m2"`,
    /// a value stored as `x / scale`); each the torch backend's rule.
    /// `kernel` None picks the fastest GEMV this CPU runs.
    #[pyo3(signature = (hidden, cos_sin, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, threads = 1,
                        kernel = None, kv_dtype = "float32", k_scale = 1.0, v_scale = 1.0))]
    #[allow(clippy::too_many_arguments)]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        hidden: PyReadonlyArray2<'py, f32>,
        cos_sin: PyReadonlyArray3<'py, f32>,
        kv_cache: &Bound<'py, PyAny>,
        slot_mapping: PyReadonlyArray1<'py, i64>,
        query_start_loc: PyReadonlyArray1<'py, i32>,
        seq_lens: PyReadonlyArray1<'py, i32>,
        block_tables: PyReadonlyArray2<'py, i32>,
        threads: usize,
        kernel: Option<&str>,
        kv_dtype: &str,
        k_scale: f32,
        v_scale: f32,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let kernel = match kernel {
            None => Kernel::best(),
            Some(k) => Kernel::parse(k).filter(|k| k.supported()).ok_or_else(|| {
                PyValueError::new_err(format!("kernel: {k:?} is unknown or not run by this CPU; allowed: {:?}",
                                              Kernel::available().into_iter().map(Kernel::name).collect::<Vec<_>>()))
            })?,
        };
        let codes_of = match kv_dtype {
            "float32" => Codes::F32,
            "bfloat16" => Codes::Bf16,
            name => Codes::Fp8(Fp8::parse(name).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "kv_dtype: {name:?} is unknown; allowed: \"float32\", \"bfloat16\", \"fp8_e4m3\", \"fp8_e5m2\""
                ))
            })?),
        };
        let (mut values, mut codes, mut halves);
        let (kvg, cache) = match codes_of {
            Codes::F32 => {
                values = writable::<f32>(&kv_cache, "a float32 NumPy array", kv_dtype)?;
                let (kvg, v) = cache_layout(&mut values)?;
                (kvg, KvCacheMut::F32(v))
            }
            Codes::Bf16 => {
                halves = writable::<u16>(&kv_cache, "a uint16 NumPy array (the bfloat16 codes)", kv_dtype)?;
                let (kvg, c) = cache_layout(&mut halves)?;
                (kvg, KvCacheMut::Bf16(c))
            }
            Codes::Fp8(format) => {
                codes = writable::<u8>(&kv_cache, "a uint8 NumPy array (the fp8 codes)", kv_dtype)?;
                let (kvg, c) = cache_layout(&mut codes)?;
                (kvg, KvCacheMut::Fp8(c, Fp8Cache { format, k_scale, v_scale }))
            }
        };
        let rows = hidden.shape()[0];
        let width = block_tables.shape()[1];
        let h = contiguous(&hidden, "hidden")?;
        let cs = contiguous(&cos_sin, "cos_sin")?;
        let meta = StepMeta {
            slot_mapping: contiguous(&slot_mapping, "slot_mapping")?,
            query_start_loc: contiguous(&query_start_loc, "query_start_loc")?,
            seq_lens: contiguous(&seq_lens, "seq_lens")?,
            block_tables: contiguous(&block_tables, "block_tables")?,
            table_width: width,
        };
        let out = py.detach(|| self.inner.forward_cache(h, cs, cache, kvg, meta, threads, kernel)).map_err(value_err)?;
        let hidden_size = self.inner.geometry().hidden;
        PyArray1::from_vec(py, out).reshape([rows, hidden_size])
    }
}

/// The logits' values, their row width and each row's statistics (`crate::cpu_decode::logits`),
/// computed with the GIL released: what both logits functions below start from.
fn row_stats<'a>(
    py: Python<'_>,
    logits: &'a PyReadonlyArray2<'_, f32>,
    threads: usize,
) -> PyResult<(&'a [f32], usize, Vec<crate::cpu_decode::logits::RowStats>)> {
    let cols = logits.shape()[1];
    let x = contiguous(logits, "logits")?;
    let stats = py
        .detach(|| crate::cpu_decode::logits::row_stats_all(x, cols, threads, Simd::best()))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((x, cols, stats))
}

/// `logits_row_stats`' answer: each row's argmax and log-sum-exp.
type RowStatsArrays<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<f32>>);

/// Each row's argmax (int64) and log-sum-exp (float32) of float32 logits `[rows, vocab]`
/// (`crate::cpu_decode::logits`: the first maximal index, NaN maximal; `torch.logsumexp`'s
/// special values), rows shared over `threads` threads. The GIL is released while it runs.
#[pyfunction]
#[pyo3(signature = (logits, threads = 1))]
fn logits_row_stats<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
    threads: usize,
) -> PyResult<RowStatsArrays<'py>> {
    let (_, _, stats) = row_stats(py, &logits, threads)?;
    let argmax: Vec<i64> = stats.iter().map(|s| s.argmax as i64).collect();
    let lse: Vec<f32> = stats.iter().map(|s| s.logsumexp).collect();
    Ok((PyArray1::from_vec(py, argmax), PyArray1::from_vec(py, lse)))
}

/// The greedy draw of each row of float32 logits `[rows, vocab]`: its token (`logits_row_stats`'
/// argmax) and that token's log-probability `x[t] - logsumexp(x)` (float32, the same subtraction as
/// `torch`'s), as Python lists: what the core's all-greedy rows read (`core/fast_rows.py`), with no
/// NumPy indexing or `tolist` around it (~30 us a batch-1 step, cold, before).
#[pyfunction]
fn logits_greedy(py: Python<'_>, logits: PyReadonlyArray2<'_, f32>) -> PyResult<(Vec<i64>, Vec<f32>)> {
    let (x, cols, stats) = row_stats(py, &logits, 1)?;
    let tokens = stats.iter().map(|s| s.argmax as i64).collect();
    let logprobs = stats.iter().enumerate().map(|(r, s)| x[r * cols + s.argmax] - s.logsumexp).collect();
    Ok((tokens, logprobs))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDecodeStack>()?;
    m.add_function(wrap_pyfunction!(logits_row_stats, m)?)?;
    m.add_function(wrap_pyfunction!(logits_greedy, m)?)
}
