"""CUDA paged-attention kernels (sources in ``cuda/``), compiled at run time through CuPy.

Importing this package needs neither CuPy nor a GPU: the dispatch table, the
split-K planner and the NVRTC check are pure Python. Launching kernels
(``pagedrs.kernels.ops``) imports CuPy on first use.
"""

from __future__ import annotations

from pagedrs.kernels.dispatch import BLOCK_SIZES, CUDA_TYPES, HEAD_SIZES, SUPPORTED, KernelEntry, lookup
from pagedrs.kernels.planning import SplitPlan, plan_split, work_items

__all__ = [
    "BLOCK_SIZES",
    "CUDA_TYPES",
    "HEAD_SIZES",
    "SUPPORTED",
    "KernelEntry",
    "SplitPlan",
    "lookup",
    "plan_split",
    "work_items",
]
