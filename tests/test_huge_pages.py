"""CPU tensors in 2 MiB pages (pagedrs/huge_pages.py): a hint that must never change a value or fail."""

from __future__ import annotations

import pytest
import torch

from pagedrs import huge_pages
from pagedrs._core import advise_huge_pages

HUGE = 2 << 20


def test_zeros_is_torch_zeros_whatever_the_pages() -> None:
    for shape, dtype in [((0,), torch.float32), ((3, 5), torch.float32), ((30, 2, 64, 16, 3, 64), torch.float32),
                         ((4 << 20,), torch.uint8), ((2, 1 << 20), torch.bfloat16)]:
        t = huge_pages.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        assert not t.any()
        if t.numel():
            t.view(-1)[-1] = 1
            assert int(t.count_nonzero()) == 1


def test_advice_covers_whole_aligned_pages_and_never_fails() -> None:
    t = torch.empty(8 * HUGE, dtype=torch.uint8)
    got = advise_huge_pages(t.data_ptr(), t.numel())
    # all of its whole aligned 2 MiB pages (7 or 8 of them), or none where THP is off
    assert got == 0 or (got % HUGE == 0 and 7 * HUGE <= got <= 8 * HUGE)
    assert advise_huge_pages(t.data_ptr() + 1, HUGE) == 0  # no whole page inside
    assert advise_huge_pages(0, 0) == 0
    assert advise_huge_pages(2**64 - 1, 2**64 - 1) == 0  # no overflow, nothing mapped there
    assert advise_huge_pages(HUGE * 4096, HUGE) == 0  # an unmapped range: refused, reported as 0
    for ptr, nbytes in [(-1, HUGE), (t.data_ptr(), -1), (2**64, 1)]:
        with pytest.raises(OverflowError):  # not an address or a size: refused before any call
            advise_huge_pages(ptr, nbytes)


def test_a_large_one_is_its_own_tensor_on_a_fresh_mapping() -> None:
    """Its slices' base is the tensor itself (the fused CPU decode finds the cache through it), its data
    starts on a 2 MiB boundary, and its memory outlives every name but the tensor's."""
    import gc

    t = huge_pages.zeros((2, 3, 1 << 20), torch.float32)
    assert t._base is None and t[1, 2]._base is t and t.data_ptr() % HUGE == 0 and t.storage_offset() >= 0
    gc.collect()
    t[1, 2, -1] = 7.0
    assert float(t.sum()) == 7.0
