"""CuPy side: compiled modules (cached), torch's stream, torch tensors as raw pointers.

CuPy is imported here and only here, on first use. Each dispatch entry compiles
its own small module (4 template instances, about 1-2 s the first time; CuPy
also keeps its on-disk kernel cache), so a process only pays for the geometry it runs.

``KernelRuntime`` is the seam between the host code (``ops``) and whatever runs
the kernels: ``CUPY`` (the module functions below, on a GPU) in production, the
CPU emulator of ``tests/cuda_emu`` in tests, which executes the same translation
unit and checks every launch's arguments against the kernels' C++ signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any, Protocol

import numpy as np
import torch

from pagedrs.kernels import sources
from pagedrs.kernels.dispatch import KernelEntry


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the CUDA attention backend needs CuPy: pip install 'pagedrs[cuda]' (cupy-cuda12x), "
            "or set PAGEDRS_ATTENTION_BACKEND=torch"
        ) from exc
    return cupy


@cache
def _module(name_expressions: tuple[str, ...], device_index: int) -> Any:
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(
            code=sources.translation_unit(),
            options=sources.BASE_OPTIONS,
            name_expressions=list(name_expressions),
        )


def kernel(entry: KernelEntry, name_expression: str, device: torch.device) -> Any:
    """The compiled function for one instance of ``entry`` on ``device`` (one module per entry)."""
    if name_expression not in entry.name_expressions:
        raise ValueError(f"{name_expression!r} is not one of {entry.name_expressions}")
    return _module(entry.name_expressions, _index(device)).get_function(name_expression)


def standalone_kernel(name_expression: str, device: torch.device) -> Any:
    """A non-template kernel (copy_blocks) in a module of its own."""
    return _module((name_expression,), _index(device)).get_function(name_expression)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@lru_cache(maxsize=64)
def _external_stream(ptr: int, device_index: int) -> Any:
    return _cupy().cuda.ExternalStream(ptr, device_index)


def launch(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], device: torch.device) -> None:
    """Launches on torch's current stream of ``device`` (so it orders with the model's own ops)."""
    cupy = _cupy()
    index = _index(device)
    stream = _external_stream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        fn(grid, block, tuple(args))


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address, zero-copy (CuPy would read a Python int as int64 data, not a pointer)."""
    return np.uint64(t.data_ptr())


def i32(x: int) -> np.int32:
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def memcpy_2d_async(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: torch.cuda.Stream
) -> None:
    """cudaMemcpy2DAsync with cudaMemcpyDefault (UVA works out the direction) on a torch stream."""
    runtime = _cupy().cuda.runtime
    runtime.memcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, runtime.memcpyDefault, stream.cuda_stream)


class KernelRuntime(Protocol):
    """What ``ops`` needs to run kernels: compiled functions, launches, copies and streams."""

    def kernel(self, entry: KernelEntry, name_expression: str, device: torch.device) -> Any: ...

    def standalone_kernel(self, name_expression: str, device: torch.device) -> Any: ...

    def launch(self, fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], device: torch.device) -> None: ...

    def memcpy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: Any) -> None: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def new_stream(self, device: torch.device) -> Any: ...

    def num_sms(self, device: torch.device) -> int: ...


class CupyRuntime:
    """The production runtime: this module's CuPy functions and torch's CUDA streams."""

    def kernel(self, entry: KernelEntry, name_expression: str, device: torch.device) -> Any:
        return kernel(entry, name_expression, device)

    def standalone_kernel(self, name_expression: str, device: torch.device) -> Any:
        return standalone_kernel(name_expression, device)

    def launch(self, fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], device: torch.device) -> None:
        launch(fn, grid, block, args, device)

    def memcpy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: Any) -> None:
        memcpy_2d_async(dst, dst_pitch, src, src_pitch, width, height, stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def num_sms(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count


CUPY = CupyRuntime()
