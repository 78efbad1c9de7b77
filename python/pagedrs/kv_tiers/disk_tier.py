"""DiskTier: the runner's side of the disk tier, moving pages between a KV tensor and the
DiskPageStore.

A KV tensor is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; a page
on disk is one block's slice across every layer and both K and V, made contiguous:
``[num_layers, 2, block_size, num_kv_heads, head_dim]``. Writes gather their pages in one
indexed copy and store beside each the slot metadata (hash, parent, tokens) the core gave
the transfer when it handed it out (``step_input.Transfer.meta``: never asked for here, on
what may be the executor's worker thread); reads scatter them back in one indexed copy.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedrs.kv_tiers.disk_store import DiskPageStore
from pagedrs.step_input import DiskPageMeta


class DiskTier:
    def __init__(self, store: DiskPageStore) -> None:
        self.store = store

    def write(self, cache: torch.Tensor, pairs: np.ndarray, meta: DiskPageMeta) -> None:
        """Copies blocks ``pairs[:, 0]`` of ``cache`` to disk slots ``pairs[:, 1]`` (queued),
        each beside its ``meta`` row (hash, parent, tokens)."""
        if len(pairs) == 0:
            return
        hashes, parents, tokens = meta
        if not len(hashes) == len(parents) == len(tokens) == len(pairs):
            raise ValueError(f"disk write of {len(pairs)} pages with meta for {len(hashes)} / {len(parents)} / "
                             f"{len(tokens)} (hashes / parents / tokens): one row a page")
        src = torch.from_numpy(pairs[:, 0].astype(np.int64)).to(cache.device)
        pages = cache.index_select(2, src).permute(2, 0, 1, 3, 4, 5).contiguous().to("cpu")
        raw = pages.view(torch.uint8).reshape(len(pairs), -1).numpy()
        self.store.write(pairs[:, 1].astype(np.uint32), hashes, parents, tokens, raw)

    def read(self, pairs: np.ndarray, cache: torch.Tensor) -> None:
        """Copies disk slots ``pairs[:, 0]`` into blocks ``pairs[:, 1]`` of ``cache``."""
        if len(pairs) == 0:
            return
        raw = self.store.read(pairs[:, 0].astype(np.uint32))
        layers, two, _, bs, heads, dim = cache.shape
        pages = torch.from_numpy(raw).reshape(len(pairs), layers, two, bs, heads, dim * cache.element_size())
        dst = torch.from_numpy(pairs[:, 1].astype(np.int64)).to(cache.device)
        # as bytes: the page's bits go back unchanged whatever the dtype (CPU torch has no fp8 index_copy_)
        cache.view(torch.uint8).index_copy_(2, dst, pages.permute(1, 2, 0, 3, 4, 5).to(cache.device))
