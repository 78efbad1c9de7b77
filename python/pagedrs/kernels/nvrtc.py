"""NVRTC through ctypes: compile the kernels with no GPU, no driver and no CuPy.

Used by ``python -m pagedrs.kernels --check`` (and the CPU tests) so that a
syntax or template error in ``cuda/`` fails CI on a machine without a device.
The library comes from the ``nvidia-cuda-nvrtc-cu12`` pip package (or the CUDA
13 one torch ships, or the system) -- whichever is found first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_CANDIDATE_LIBS = ("libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so")


def _candidate_paths() -> list[str]:
    paths: list[str] = []
    env = os.environ.get("PAGEDRS_NVRTC")
    if env:
        paths.append(env)
    for package, sub in (("nvidia.cuda_nvrtc", "lib"), ("nvidia.cu13", "lib")):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            for name in _CANDIDATE_LIBS:
                candidate = Path(root) / sub / name
                if candidate.exists():
                    paths.append(str(candidate))
    system = ctypes.util.find_library("nvrtc")
    if system:
        paths.append(system)
    return paths


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL:
    """The first NVRTC shared library that loads; raises OSError naming every path tried."""
    tried = _candidate_paths()
    for path in tried:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise OSError(f"no loadable NVRTC library; tried {tried or 'nothing'} (pip install nvidia-cuda-nvrtc-cu12)")


def _declare(lib: ctypes.CDLL) -> None:
    p, c, i, s = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t
    lib.nvrtcGetErrorString.restype = c
    lib.nvrtcGetErrorString.argtypes = [i]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), c, c, i, ctypes.POINTER(c), ctypes.POINTER(c)]
    lib.nvrtcAddNameExpression.argtypes = [p, c]
    lib.nvrtcCompileProgram.argtypes = [p, i, ctypes.POINTER(c)]
    lib.nvrtcGetProgramLogSize.argtypes = [p, ctypes.POINTER(s)]
    lib.nvrtcGetProgramLog.argtypes = [p, c]
    lib.nvrtcGetPTXSize.argtypes = [p, ctypes.POINTER(s)]
    lib.nvrtcGetPTX.argtypes = [p, c]
    lib.nvrtcGetLoweredName.argtypes = [p, c, ctypes.POINTER(c)]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(i), ctypes.POINTER(i)]


def version() -> tuple[int, int]:
    lib = load_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: {lib.nvrtcGetErrorString(result).decode()}")


@dataclass(frozen=True)
class CompileResult:
    """What one NVRTC compilation produced."""

    ok: bool
    log: str  # compiler diagnostics; empty when clean
    ptx: str  # empty when compilation failed
    lowered_names: dict[str, str]  # name expression -> mangled symbol in the PTX


def compile_source(
    source: str,
    name: str,
    headers: dict[str, str],
    name_expressions: list[str],
    options: list[str],
) -> CompileResult:
    """Compiles one translation unit to PTX; ``headers`` are served in memory by include name."""
    lib = load_library()
    prog = ctypes.c_void_p()
    header_srcs = (ctypes.c_char_p * len(headers))(*[h.encode() for h in headers.values()])
    header_names = (ctypes.c_char_p * len(headers))(*[h.encode() for h in headers])
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(headers), header_srcs, header_names),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        result = lib.nvrtcCompileProgram(prog, len(options), opts)
        log_size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size)), "nvrtcGetProgramLogSize")
        log_buf = ctypes.create_string_buffer(log_size.value)
        _check(lib, lib.nvrtcGetProgramLog(prog, log_buf), "nvrtcGetProgramLog")
        log = log_buf.value.decode(errors="replace").strip()
        if result != 0:
            return CompileResult(ok=False, log=log or lib.nvrtcGetErrorString(result).decode(), ptx="", lowered_names={})
        ptx_size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)), "nvrtcGetPTXSize")
        ptx_buf = ctypes.create_string_buffer(ptx_size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx_buf), "nvrtcGetPTX")
        lowered: dict[str, str] = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), f"nvrtcGetLoweredName({expr})")
            lowered[expr] = (out.value or b"").decode()
        return CompileResult(ok=True, log=log, ptx=ptx_buf.value.decode(), lowered_names=lowered)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
