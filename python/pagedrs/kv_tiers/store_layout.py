"""What a disk page store holds and how it is laid out: the file's name and header size, a page's
geometry (what its bytes mean), and the pages a store hands the core when it opens."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

FORMAT_VERSION = 1
FILE_NAME = "pages.kvstore"
HEADER_BYTES = 4096


@dataclass(frozen=True)
class StoreGeometry:
    """What a page's bytes mean; any difference makes a store unreadable."""

    fingerprint: str  # the model's (see fingerprint.py)
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    # "auto": pages in ``dtype``; else the 8-bit storage and its scale rule ("float8_e4m3fn/scales:unit",
    # attention/kv_quant.py): a store of e4m3 pages is never read as e5m2, nor with other scales
    kv_cache: str = "auto"

    def header_fields(self) -> dict:
        """The fields a store's header records; ``kv_cache`` only when not "auto", so that stores written
        before it existed still open (their pages are in ``dtype``, which ``auto`` means)."""
        fields = asdict(self)
        if self.kv_cache == "auto":
            del fields["kv_cache"]
        return fields

    @property
    def page_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class SeedPages:
    """The valid pages found at open, oldest write first: what the core's seed_disk takes."""

    slots: np.ndarray  # uint32 [N]
    hashes: np.ndarray  # uint64 [N]
    parents: np.ndarray  # uint64 [N]
    tokens: np.ndarray  # uint32 [N, block_size]
    invalidated: np.ndarray  # uint64 [M] hashes of pages a mismatched store held

    def __len__(self) -> int:
        return int(self.slots.shape[0])
