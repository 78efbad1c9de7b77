"""Where the CUDA sources live and how they become one translation unit.

Search order: ``$PAGEDRS_CUDA_DIR``, then ``cuda/`` of the source checkout this
package runs from (editable installs), then ``./cuda``; an installed wheel with none
of those uses the copy compiled into the extension (``pagedrs._core.cuda_sources``).
Headers are inlined into the translation unit (they carry include guards), so
neither NVRTC nor CuPy needs an include path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

KERNEL_FILES: tuple[str, ...] = ("paged_attention.cu", "cache_ops.cu")
HEADER_FILES: tuple[str, ...] = ("dtype.cuh",)
# C++17 for constexpr helpers; no -use_fast_math: softmax exponentials stay accurate.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)


def cuda_dir() -> Path:
    """The folder holding the ``.cu``/``.cuh`` files; FileNotFoundError naming every place looked."""
    candidates = []
    env = os.environ.get("PAGEDRS_CUDA_DIR")
    if env:
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[3] / "cuda")
    candidates.append(Path.cwd() / "cuda")
    for candidate in candidates:
        if all((candidate / name).is_file() for name in KERNEL_FILES):
            return candidate
    raise FileNotFoundError(
        f"CUDA kernel sources {list(KERNEL_FILES)} not found in {[str(c) for c in candidates]}; "
        "set PAGEDRS_CUDA_DIR to the repository's cuda/ folder"
    )


@lru_cache(maxsize=1)
def _files() -> dict[str, str]:
    """File name -> text of every kernel and header file, from disk or from the extension."""
    names = (*KERNEL_FILES, *HEADER_FILES)
    try:
        root = cuda_dir()
    except FileNotFoundError:
        from pagedrs._core import cuda_sources

        embedded = dict(cuda_sources())
        return {name: embedded[name] for name in names}
    return {name: (root / name).read_text() for name in names}


def source_files() -> dict[str, str]:
    """File name -> text of every kernel and header file (a copy; edit it freely)."""
    return dict(_files())


def headers() -> dict[str, str]:
    """Include name -> text (for NVRTC's in-memory headers)."""
    files = _files()
    return {name: files[name] for name in HEADER_FILES}


_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def translation_unit(files: Mapping[str, str] | None = None) -> str:
    """All kernel files as one source, with their headers inlined.

    ``files`` (file name -> text) replaces the sources on disk; tests use it to
    compile deliberately changed kernels without touching ``cuda/``.

    ``#line`` directives keep every diagnostic (compiler, ptxas, debugger) pointing at
    the real file and line: one before each file and header, and one after each
    inlined header that switches back to the line following the ``#include``.
    """
    files = _files() if files is None else files

    def inline_headers(name: str) -> str:
        text = files[name]

        def inline(match: re.Match) -> str:
            header = match.group(1)
            if header not in HEADER_FILES:
                raise ValueError(f"cuda source {name} includes {header!r}; known headers: {list(HEADER_FILES)}")
            next_line = text.count("\n", 0, match.start()) + 2  # the line after the #include
            # the match stops before the include line's newline, which ends the last directive
            return f'#line 1 "{header}"\n{files[header]}\n#line {next_line} "{name}"'

        return _INCLUDE.sub(inline, text)

    return "\n".join(f'#line 1 "{name}"\n' + inline_headers(name) for name in KERNEL_FILES)


def arch_option(arch: str) -> str:
    """``"sm_80"`` -> the NVRTC option that targets it (PTX for compute_80)."""
    if not arch.startswith("sm_") or not arch[3:].isdigit():
        raise ValueError(f"arch must look like 'sm_80', got {arch!r}")
    return f"--gpu-architecture=compute_{arch[3:]}"
