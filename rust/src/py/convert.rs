//! What crosses the boundary: core errors → Python exceptions, Python token ids → `&[u32]`.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::{CoreError, TokenId};

pyo3::create_exception!(
    _core,
    OutOfBlocksError,
    PyRuntimeError,
    "The KV-cache pool cannot serve the request now; nothing was changed."
);

/// The Python exception for a core error: OutOfBlocksError, KeyError or ValueError.
pub(crate) fn core_err(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::OutOfBlocks { .. } => OutOfBlocksError::new_err(msg),
        CoreError::UnknownSequence(_) => PyKeyError::new_err(msg),
        CoreError::InvalidArgument(_) => PyValueError::new_err(msg),
    }
}

fn out_of_range(pos: usize, value: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("token id at position {pos} is {value}; token ids must be in 0..={}", u32::MAX))
}

fn check_range<T: Copy + TryInto<u32> + std::fmt::Display>(values: &[T], out: &mut Vec<TokenId>) -> PyResult<()> {
    out.reserve(values.len());
    for (pos, &v) in values.iter().enumerate() {
        out.push(v.try_into().map_err(|_| out_of_range(pos, v))?);
    }
    Ok(())
}

/// Calls `f` with the token ids of `obj`: a list (or other sequence) of ints, or a 1-D
/// NumPy array of uint32 / int32 (read in place, zero-copy) or int64 / uint64 (read in
/// place, converted into `scratch`). Raises TypeError / ValueError for anything else.
pub(crate) fn with_tokens<R>(
    obj: &Bound<'_, PyAny>,
    scratch: &mut Vec<TokenId>,
    f: impl FnOnce(&[TokenId]) -> R,
) -> PyResult<R> {
    scratch.clear();
    if let Ok(list) = obj.cast::<PyList>() {
        list_into(list, scratch)?;
        return Ok(f(scratch));
    }
    if let Ok(arr) = obj.cast::<PyArray1<u32>>() {
        let ro = arr.readonly();
        return Ok(match ro.as_slice() {
            Ok(s) => f(s),
            Err(_) => f(&ro.as_array().to_vec()),
        });
    }
    if let Ok(arr) = obj.cast::<PyArray1<i32>>() {
        let ro = arr.readonly();
        if let Ok(s) = ro.as_slice() {
            if let Some(pos) = s.iter().position(|&v| v < 0) {
                return Err(out_of_range(pos, s[pos]));
            }
            // SAFETY: i32 and u32 have the same size and alignment, every value was just
            // checked non-negative so it reads back unchanged, and the slice borrows `ro`.
            let s = unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u32>(), s.len()) };
            return Ok(f(s));
        }
        check_range(&ro.as_array().to_vec(), scratch)?;
        return Ok(f(scratch));
    }
    if let Ok(arr) = obj.cast::<PyArray1<i64>>() {
        let ro = arr.readonly();
        match ro.as_slice() {
            Ok(s) => check_range(s, scratch)?,
            Err(_) => check_range(&ro.as_array().to_vec(), scratch)?,
        }
        return Ok(f(scratch));
    }
    if let Ok(arr) = obj.cast::<PyArray1<u64>>() {
        let ro = arr.readonly();
        check_range(&ro.as_array().to_vec(), scratch)?;
        return Ok(f(scratch));
    }
    if let Ok(arr) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(PyTypeError::new_err(format!(
            "token_ids array must be 1-D of uint32, int32, int64 or uint64, got {}-D {}",
            arr.ndim(),
            arr.dtype()
        )));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(PyTypeError::new_err("token_ids must be a list of ints or a NumPy int array, got a string"));
    }
    for (pos, item) in obj.try_iter().map_err(|_| type_error(obj))?.enumerate() {
        scratch.push(int_to_token(&item?, pos)?);
    }
    Ok(f(scratch))
}

fn type_error(obj: &Bound<'_, PyAny>) -> PyErr {
    let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    PyTypeError::new_err(format!("token_ids must be a list of ints or a NumPy int array, got {ty}"))
}

fn int_to_token(item: &Bound<'_, PyAny>, pos: usize) -> PyResult<TokenId> {
    if !item.is_instance_of::<pyo3::types::PyInt>() {
        let ty = item.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        return Err(PyTypeError::new_err(format!("token id at position {pos} must be an int, got {ty}")));
    }
    let v: i128 = item.extract()?;
    u32::try_from(v).map_err(|_| out_of_range(pos, v))
}

/// The list fast path: one C call per item, no reference counting.
fn list_into(list: &Bound<'_, PyList>, out: &mut Vec<TokenId>) -> PyResult<()> {
    use pyo3::ffi;
    let n = list.len();
    out.reserve(n);
    for pos in 0..n {
        // SAFETY: `list` is a live list and `pos < len` (nothing runs Python code in this
        // loop, so its length cannot change); PyList_GetItem returns a borrowed reference
        // that stays valid while the list holds it, and is only read within this iteration.
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), pos as ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(PyErr::fetch(list.py()));
        }
        // SAFETY: `item` is a valid, non-null object pointer (see above); reading its type
        // and the address of the static `int` type touches no Python state. Exact ints
        // skip the PyLong_Check call (one C call fewer per token under the limited API).
        let is_int = unsafe { ffi::Py_TYPE(item) == std::ptr::addr_of_mut!(ffi::PyLong_Type) || ffi::PyLong_Check(item) != 0 };
        if !is_int {
            // SAFETY: as above; the borrowed pointer becomes an owned Bound for the message.
            let bound = unsafe { Bound::from_borrowed_ptr(list.py(), item) };
            return Err(int_to_token(&bound, pos).expect_err("not an int"));
        }
        // SAFETY: `item` is an int (checked), so this runs no Python code.
        let v = unsafe { ffi::PyLong_AsLongLong(item) };
        if v == -1 && PyErr::occurred(list.py()) {
            let err = PyErr::fetch(list.py());
            return Err(if err.is_instance_of::<pyo3::exceptions::PyOverflowError>(list.py()) {
                out_of_range(pos, "beyond 64 bits")
            } else {
                err
            });
        }
        out.push(u32::try_from(v).map_err(|_| out_of_range(pos, v))?);
    }
    Ok(())
}
