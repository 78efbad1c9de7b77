"""CPU tensors that are streamed every step, placed in 2 MiB pages (Linux transparent huge pages).

Why: a CPU decode step reads each layer's K/V pages once, from memory; in 4 KiB pages every 4 KiB
of that stream starts with a TLB miss and a restarted hardware prefetch. On an AMD EPYC (Zen 3,
2026-12-06) attention over 1024 keys of 40 layers' pages took 281 us a layer in 4 KiB pages and
195 us in 2 MiB ones (``rust/src/huge_pages.rs`` has the measurements, and does the same for the
GEMV's weights). torch's own switch for this (``THP_MEM_ALLOC_ENABLE``) is read once per process,
at its first large allocation, so a library cannot count on setting it; the advice here is given
per tensor, before its pages are first written. A hint only: the values are the same either way.
"""

from __future__ import annotations

import torch

from pagedrs._core import advise_huge_pages


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, its whole 2 MiB pages advised as huge
    pages before the zeros are written (``torch.empty`` leaves a large allocation's pages
    untouched, so each first touch then faults in a huge page)."""
    t = torch.empty(shape, dtype=dtype, device="cpu")
    advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t.zero_()
