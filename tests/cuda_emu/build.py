"""Compiles kernel instances of the CUDA translation unit into a CPU shared library with g++.

The source g++ sees is cuda_emu.h, then ``pagedrs.kernels.sources.translation_unit``
unchanged (the text NVRTC compiles), then cuda_emu_launch.h and a table of the
requested instances. Libraries are cached under ``$PAGEDRS_EMU_CACHE`` (default
``/tmp/pagedrs-cuda-emu-<uid>``) by a hash of everything that goes into them, so a
test session compiles each geometry once and later sessions not at all.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pagedrs.kernels import sources

HERE = Path(__file__).resolve().parent
HEADERS = ("cuda_emu.h", "cuda_emu_sched.h", "cuda_emu_launch.h")
# -fno-strict-aliasing: the kernels read T rows as uint4 (fine in CUDA, undefined in ISO C++).
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
         "-Wno-unused-variable", "-Wno-unused-function")  # fmt: skip
# ASan: also checks the fibers' stacks (cuda_emu.h annotates every switch).
ASAN_FLAGS = ("-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-fno-strict-aliasing", "-fsanitize=address",
              "-fno-omit-frame-pointer", "-Wno-unknown-pragmas")  # fmt: skip


# cuda_emu_sched.h switches fiber stacks with x86-64 assembly.
SUPPORTED_MACHINE = platform.machine() in ("x86_64", "AMD64")


class EmuCompileError(RuntimeError):
    """g++ rejected the emulated translation unit; the message carries its diagnostics."""


def sanitize() -> bool:
    """True when ``PAGEDRS_EMU_ASAN=1`` (``make test-kernels-asan``): build with AddressSanitizer."""
    return os.environ.get("PAGEDRS_EMU_ASAN", "") == "1"


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDRS_EMU_CACHE") or Path(tempfile.gettempdir()) / f"pagedrs-cuda-emu-{os.getuid()}")


def generate(name_expressions: Sequence[str], unit: str) -> str:
    """The C++ source of one library: the kernel translation unit plus a table of ``name_expressions``."""
    table = ",\n".join(f'  emu::kernel("{e}", &{e})' for e in name_expressions)
    return (
        '#include "cuda_emu.h"\n'
        f"{unit}\n"
        '#include "cuda_emu_launch.h"\n'
        f"const emu::KernelInfo kKernels[] = {{\n{table}\n}};\n"
        f"const int kNumKernels = {len(name_expressions)};\n"
    )


def compile_check(text: str, name: str = "check.cpp") -> subprocess.CompletedProcess:
    """``g++ -fsyntax-only`` of ``text`` with the emulation headers (for diagnostics tests)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / name
        src.write_text(text)
        return subprocess.run(["g++", "-fsyntax-only", *FLAGS[:1], "-I", str(HERE), str(src)], capture_output=True, text=True)


def build(
    name_expressions: Sequence[str],
    files: Mapping[str, str] | None = None,
    asan: bool | None = None,
    unit: str | None = None,
) -> Path:
    """The shared library holding ``name_expressions``, compiled now or taken from the cache.

    The kernels come from ``unit`` when given (a test's own CUDA source), else from
    ``sources.translation_unit(files)``: cuda/ itself, or ``files`` in its place.
    """
    if shutil.which("g++") is None:
        raise EmuCompileError("the CUDA emulator compiles kernels with g++, which is not on PATH (apt-get install g++)")
    asan = sanitize() if asan is None else asan
    flags = ASAN_FLAGS if asan else FLAGS
    source = generate(name_expressions, sources.translation_unit(files) if unit is None else unit)
    digest = hashlib.sha256()
    for part in (source, *((HERE / h).read_text() for h in HEADERS), " ".join(flags), _compiler_version()):
        digest.update(part.encode())
        digest.update(b"\0")
    out = cache_dir() / f"emu-{digest.hexdigest()[:24]}{'-asan' if asan else ''}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernels_emu.cpp"
        src.write_text(source)
        lib = Path(tmp) / out.name
        result = subprocess.run(["g++", *flags, "-I", str(HERE), "-o", str(lib), str(src)], capture_output=True, text=True)
        if result.returncode != 0:
            raise EmuCompileError(f"g++ could not compile {list(name_expressions)}:\n{result.stderr[-8000:]}")
        shutil.move(str(lib), out)  # atomic within one folder: a concurrent build finds a whole file or none
    return out


_VERSION: list[str] = []


def _compiler_version() -> str:
    if not _VERSION:
        _VERSION.append(subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout)
    return _VERSION[0]
