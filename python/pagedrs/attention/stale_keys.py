"""Zeroing the gathered keys past a sequence's end, before a masked attention reads them.

The torch backend gathers pages whole and masks the slots past each sequence's length: a page's
unwritten tail, a bucket's padding pages. Those slots hold whatever the page's last owner left,
and a masked key's weight is 0, but 0 times a NaN is NaN: one request whose K/V went NaN (a
NaN weight, an overflow) failed the next requests that were given its pages, none of them NaN
of its own. So the gathered copies' rows there are zeroed, as the CUDA kernel loads zeros
there ("zeros, never garbage", cuda/paged_attention.cu). The rows are planned once per step.
"""

from __future__ import annotations

import numpy as np
import torch


def stale_rows(readable: torch.Tensor) -> torch.Tensor | None:
    """int64 flat indices (s * keys + j) of ``readable``'s False entries (bool [S, keys]: key j may be read by a
    row of sequence s); None when there are none. On the CPU through NumPy (a decode step plans this cold: the
    torch ops took ~50 us of a batch-32 plan's ~130)."""
    if readable.device.type == "cpu":
        found = np.flatnonzero(~readable.numpy())
        return torch.from_numpy(found) if found.size else None
    rows = torch.nonzero(~readable.reshape(-1)).view(-1)
    return rows if rows.numel() else None


def zero_stale(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Zeroes ``rows`` (``stale_rows``) of the gathered ``k`` and ``v`` ([S, keys, kv_heads, d], copies the
    caller owns), in place."""
    if rows is not None:
        k.view(-1, *k.shape[2:]).index_fill_(0, rows, 0.0)
        v.view(-1, *v.shape[2:]).index_fill_(0, rows, 0.0)
