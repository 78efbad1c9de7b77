"""Where the CUDA sources live and how they become one translation unit.

Search order: ``$PAGEDRS_CUDA_DIR``, then ``cuda/`` of the source checkout this
package runs from (editable installs), then ``./cuda`` (a wheel installed next to
a checkout, as on the GPU check machine).
"""

from __future__ import annotations

import os
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


def headers() -> dict[str, str]:
    """Include name -> text, served to NVRTC in memory (no -I needed)."""
    root = cuda_dir()
    return {name: (root / name).read_text() for name in HEADER_FILES}


def translation_unit() -> str:
    """All kernel files as one source; each includes its headers by name."""
    root = cuda_dir()
    return "\n".join(f'#line 1 "{name}"\n' + (root / name).read_text() for name in KERNEL_FILES)


def arch_option(arch: str) -> str:
    """``"sm_80"`` -> the NVRTC option that targets it (PTX for compute_80)."""
    if not arch.startswith("sm_") or not arch[3:].isdigit():
        raise ValueError(f"arch must look like 'sm_80', got {arch!r}")
    return f"--gpu-architecture=compute_{arch[3:]}"
