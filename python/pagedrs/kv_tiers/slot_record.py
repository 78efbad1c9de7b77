"""SlotRecord: the bytes of one disk slot, and the only code that packs or checks them.

    record | meta: magic, generation, hash, parent, crc, n, tokens[block_size] | pad to 64 | page |

The crc32 covers the meta (its crc field zeroed), the tokens and the page together, seeded
with the store's epoch: a torn record, a flipped byte, an old meta over a new page or a new
meta over an old page, and a record of an earlier epoch of the store all fail it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

SLOT_MAGIC = b"PGSL"
META = struct.Struct("<4sQQQII")  # magic, generation, hash, parent, crc, num_tokens


class SlotMeta(NamedTuple):
    generation: int  # the store's write counter when the record was made (newest wins)
    page_hash: int  # the page's chained prefix hash
    parent: int  # its parent page's hash
    tokens: np.ndarray  # uint32 [block_size]


@dataclass(frozen=True)
class SlotRecord:
    block_size: int
    page_bytes: int
    epoch: int  # seeds every crc: records of another epoch of the store never validate

    @property
    def meta_bytes(self) -> int:
        return (META.size + 4 * self.block_size + 63) // 64 * 64

    def _crc(self, head: bytes, tokens: bytes, page: bytes | memoryview) -> int:
        return zlib.crc32(page, zlib.crc32(tokens, zlib.crc32(head, self.epoch)))

    def pack(self, generation: int, page_hash: int, parent: int, tokens: np.ndarray, page: bytes) -> bytes:
        tok = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
        head = META.pack(SLOT_MAGIC, generation, page_hash, parent, 0, len(tokens))
        crc = self._crc(head, tok, page)
        meta = META.pack(SLOT_MAGIC, generation, page_hash, parent, crc, len(tokens)) + tok
        return meta.ljust(self.meta_bytes, b"\0") + page

    def parse(self, record: bytes) -> Optional[SlotMeta]:
        """The meta of an intact record, else None."""
        if len(record) < self.meta_bytes + self.page_bytes:
            return None
        magic, generation, page_hash, parent, crc, n = META.unpack_from(record)
        bs = self.block_size
        if magic != SLOT_MAGIC or n != bs:
            return None
        tok = record[META.size : META.size + 4 * bs]
        head = META.pack(SLOT_MAGIC, generation, page_hash, parent, 0, n)
        page = memoryview(record)[self.meta_bytes : self.meta_bytes + self.page_bytes]
        if self._crc(head, tok, page) != crc:
            return None
        return SlotMeta(generation, page_hash, parent, np.frombuffer(tok, dtype="<u4").astype(np.uint32))

    def page(self, record: bytes) -> np.ndarray:
        """The page bytes of a record (uint8 [page_bytes]), without a copy."""
        return np.frombuffer(record, dtype=np.uint8, count=self.page_bytes, offset=self.meta_bytes)
