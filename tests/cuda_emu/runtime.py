"""``EmulatedRuntime``: a ``pagedrs.kernels.loader.KernelRuntime`` that runs the kernels on the CPU.

``ops`` and ``CudaAttentionBackend`` take it in place of CuPy and run unchanged on
CPU tensors: the same planning, the same argument tuples (``loader.ptr``,
``loader.i32``, ...), the same grids. Every launch checks each argument against
the instance's C++ parameter list (a pointer must be a ``np.uint64`` address, an
``int`` a ``np.int32``, a ``long long`` a ``np.int64``, a ``float`` a
``np.float32``) and the launch shape against CUDA's limits, then runs the whole
grid in cuda_emu.h's scheduler. Launches are synchronous, so streams are stubs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cuda_emu.build import build
from pagedrs.kernels.dispatch import KernelEntry

SCHEDULES = {"forward": 0, "reverse": 1, "warp-random": 2}
_SCALAR = {  # (kind, size) in the C++ signature -> the numpy type ops must pass
    ("p", 8): np.uint64,
    ("i", 4): np.int32,
    ("i", 8): np.int64,
    ("u", 4): np.uint32,
    ("u", 8): np.uint64,
    ("f", 4): np.float32,
    ("f", 8): np.float64,
}
_CTYPE = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.int64: ctypes.c_int64,
          np.uint32: ctypes.c_uint32, np.float32: ctypes.c_float, np.float64: ctypes.c_double}  # fmt: skip


class EmulationError(RuntimeError):
    """A kernel broke a CUDA rule the emulator checks (divergent barrier or shuffle, deadlock, ...)."""


@dataclass(frozen=True)
class EmulatedKernel:
    name: str
    library: ctypes.CDLL
    index: int
    params: tuple[tuple[str, int], ...]  # (kind, size) of each C++ parameter


class HostStream:
    """Launches are synchronous on the CPU: there is nothing to order."""

    cuda_stream = 0

    def wait_stream(self, other: object) -> None:
        pass


@dataclass
class EmulatedRuntime:
    """Runs kernels with g++-compiled sources on CPU tensors (see tests/cuda_emu/cuda_emu.h)."""

    schedule: str = "forward"
    seed: int = 0
    sms: int = 132  # what ``num_sms`` reports to the split-K planner
    files: Mapping[str, str] | None = None  # kernel sources replacing cuda/ (the mutation check)
    launches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    _modules: dict[tuple[str, ...], dict[str, EmulatedKernel]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; expected one of {list(SCHEDULES)}")

    # ---- KernelRuntime
    def kernel(self, entry: KernelEntry, name_expression: str, device: torch.device) -> EmulatedKernel:
        if name_expression not in entry.name_expressions:
            raise ValueError(f"{name_expression!r} is not one of {entry.name_expressions}")
        return self._module(entry.name_expressions)[name_expression]

    def standalone_kernel(self, name_expression: str, device: torch.device) -> EmulatedKernel:
        return self._module((name_expression,))[name_expression]

    def launch(self, fn: EmulatedKernel, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], device: torch.device) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the emulator runs kernels on CPU tensors, got device {device}")
        grid3, block3 = _dims(grid, "grid"), _dims(block, "block")
        if block3[0] * block3[1] * block3[2] > 1024 or max(grid3[1:]) > 65535 or grid3[0] >= 2**31:
            raise ValueError(f"{fn.name}: launch grid {grid} block {block} exceeds CUDA's limits")
        holders = _arguments(fn, args)
        self.launches.append((fn.name, grid3, block3))
        if 0 in grid3:
            return
        pointers = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        error = ctypes.create_string_buffer(4096)
        status = fn.library.emu_launch(
            fn.index, (ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), pointers,
            SCHEDULES[self.schedule], self.seed, error, len(error),
        )  # fmt: skip
        if status:
            raise EmulationError(error.value.decode())

    def memcpy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: Any) -> None:
        if width > min(dst_pitch, src_pitch) and height > 1:
            raise ValueError(f"memcpy2D: width {width} exceeds pitch (dst {dst_pitch}, src {src_pitch})")
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)

    def current_stream(self, device: torch.device) -> HostStream:
        return HostStream()

    def new_stream(self, device: torch.device) -> HostStream:
        return HostStream()

    def num_sms(self, device: torch.device) -> int:
        return self.sms

    # ---- modules
    def _module(self, name_expressions: tuple[str, ...]) -> dict[str, EmulatedKernel]:
        module = self._modules.get(name_expressions)
        if module is None:
            module = self._modules[name_expressions] = load(name_expressions, self.files)
        return module


def load(
    name_expressions: tuple[str, ...], files: Mapping[str, str] | None = None, unit: str | None = None
) -> dict[str, EmulatedKernel]:
    """Name expression -> kernel of a library built (or cached) for ``name_expressions`` (see build.build)."""
    lib = ctypes.CDLL(str(build(name_expressions, files, unit=unit)))
    lib.emu_kernel_name.restype = ctypes.c_char_p
    lib.emu_shared_bytes.restype = ctypes.c_long
    lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]  # fmt: skip
    kernels = {}
    for i in range(lib.emu_num_kernels()):
        sizes, kinds = (ctypes.c_int * 32)(), ctypes.create_string_buffer(32)
        n = lib.emu_kernel_signature(i, sizes, kinds)
        name = lib.emu_kernel_name(i).decode()
        kernels[name] = EmulatedKernel(name, lib, i, tuple((kinds.raw[a : a + 1].decode(), sizes[a]) for a in range(n)))
    return kernels


def _dims(dims: tuple[int, ...], what: str) -> tuple[int, int, int]:
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 non-negative ints, got {dims}")
    full = (*[int(d) for d in dims], 1, 1)[:3]
    if what == "block" and 0 in full:
        raise ValueError(f"block must have at least one thread, got {dims}")
    return full  # type: ignore[return-value]


def _arguments(fn: EmulatedKernel, args: Sequence[Any]) -> list[ctypes._SimpleCData]:
    """ctypes holders for ``args`` after checking each against the C++ parameter list."""
    if len(args) != len(fn.params):
        raise TypeError(f"{fn.name} takes {len(fn.params)} arguments, got {len(args)}")
    holders = []
    for i, (arg, (kind, size)) in enumerate(zip(args, fn.params)):
        want = _SCALAR.get((kind, size))
        if want is None:
            raise TypeError(f"{fn.name}: parameter {i} has unsupported kind {kind!r} of {size} bytes")
        if type(arg) is not want:
            cpp = {"p": "pointer", "i": "signed int", "u": "unsigned int", "f": "float"}[kind]
            raise TypeError(
                f"{fn.name}: argument {i} is {type(arg).__name__} {arg}; the C++ parameter is a {size}-byte {cpp}, "
                f"which takes np.{want.__name__}"
            )
        if kind == "p" and int(arg) == 0:
            raise ValueError(f"{fn.name}: argument {i} is a null pointer")
        holders.append(_CTYPE[want](arg.item()))
    return holders
