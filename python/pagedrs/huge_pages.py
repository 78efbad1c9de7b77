"""CPU tensors that are streamed every step, placed in 2 MiB pages (Linux transparent huge pages),
and zero without a byte written.

Why huge pages: a CPU decode step reads each layer's K/V pages once, from memory; in 4 KiB pages
every 4 KiB of that stream starts with a TLB miss and a restarted hardware prefetch. On an AMD EPYC
(Zen 3, 2026-12-06) attention over 1024 keys of 40 layers' pages took 281 us a layer in 4 KiB pages
and 195 us in 2 MiB ones (``rust/src/huge_pages.rs`` has the measurements, and does the same for
the GEMV's weights). torch's own switch for this (``THP_MEM_ALLOC_ENABLE``) is read once per
process, at its first large allocation, so a library cannot count on setting it; the advice here is
given per tensor, before its pages are first written. A hint only: the values are the same either way.

Why a mapping of our own: the KV pool must read as zeros where nothing was written yet (a masked
slot's value is multiplied by a zero weight, and 0 x NaN is NaN). ``torch.zeros`` writes every byte
at start, which faults in the whole pool: the default CPU pool (a tenth of the free memory, 2.3 GB on
a 24 GiB host) took 4.3 s of every engine's start, and held that memory before any request came. A
private anonymous mapping is zero by the kernel's guarantee (``MAP_ANONYMOUS``: "the contents are
initialized to zero") and its pages are faulted in, zeroed, on first touch; so the pool costs
nothing at start and its resident memory grows with the pages used.
"""

from __future__ import annotations

import math
import mmap

import torch

from pagedrs._core import advise_huge_pages

HUGE_PAGE = 2 << 20
# Below this a tensor is torch's own (a mapping per small tensor would waste its page's remainder).
MAPPED_MIN_BYTES = 4 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU. A large one is a tensor on a private anonymous
    mapping, 2 MiB-aligned and advised as huge pages before any byte is touched; the tensor keeps
    the mapping alive (the storage ``torch.frombuffer`` made holds a reference to it), and the
    mapping is unmapped when the last tensor on it goes. MemoryError naming the size where the
    mapping cannot be made (torch's allocator named it; a bare ``OSError: [Errno 12]`` did not)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    nbytes = numel * itemsize
    if nbytes < MAPPED_MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        t = torch.empty(shape, dtype=dtype, device="cpu")
        advise_huge_pages(t.data_ptr(), nbytes)
        return t.zero_()
    # one huge page more than asked, so the tensor can start on a 2 MiB boundary inside it
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, OverflowError) as exc:
        raise MemoryError(f"cannot map {nbytes} bytes for a CPU tensor of shape {tuple(shape)} ({dtype}): "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # its storage holds the mapping
    offset = -whole.data_ptr() % HUGE_PAGE  # a multiple of the 4 KiB page, so of any itemsize
    # a tensor of its own on that storage, not a view: callers slice it and take their base to be it
    strides = torch.empty(shape, dtype=dtype, device="meta").stride()  # contiguous, no memory
    t = torch.empty(0, dtype=dtype).set_(whole.untyped_storage(), offset // itemsize, shape, strides)
    advise_huge_pages(t.data_ptr(), nbytes)
    return t
