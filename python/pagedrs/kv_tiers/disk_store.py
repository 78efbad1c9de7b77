"""DiskPageStore: the persistent disk tier, one preallocated file of fixed-size page slots.

    file   | header (4 KiB) | slot 0 | slot 1 | ... | slot N-1 |
    slot   | meta: magic, generation, hash, parent, crc, n, tokens[block_size] | page | pad to 4 KiB |
    page   K/V of one block across every layer: [num_layers, 2, block_size, num_kv_heads, head_dim]

The core (Rust) decides which slot holds which page; the store keeps the bytes. Each slot
is self-describing: its meta holds the page's chained prefix hash, its parent's hash and
its token ids, so that the index can be rebuilt at startup and the core can check that
the tokens hash to the hash (a hash alone is never trusted).

Crash safety: every slot carries a crc32 over its meta and page, seeded with the store's
epoch. A write that a crash tears damages its own slot only; at the next open that slot
fails its checksum and is ignored. The header is written once when a store is created. A
store whose header does not match this engine (format version, model fingerprint, dtype,
block size, KV geometry, slot count) is started afresh under a new epoch, so that none of
its old slots can validate again; one warning says why.

Writes go through one background thread, in order (slot_writer.py; slot_record.py packs
and checks a slot's bytes). A page still waiting for it is read back from memory, so a
transfer to disk is complete for the core once it is queued.

The page is lost, never wrong. The store remembers, per slot, the generation of the last
record queued for it; a read takes the slot's bytes only when they are that record, whole
(crc) and current (generation), and raises CorruptPageError naming every slot that is not.
So a write that fails (ENOSPC, EIO, a short write) cannot leave an older page of the slot
answering for the newer one: it is recorded before the page's in-memory copy is dropped,
the slot is reported by take_failed_slots (the engine drops it from the core's index), and
its magic is zeroed so that it does not validate at the next open either. A torn record
never validates: its crc covers the meta (hash, parent, tokens) and the page together.

Space is reserved at open (posix_fallocate): a file system too small for the store is a
startup error, never a disk that fills while serving. Where the file system cannot
reserve space the file stays sparse (one warning), and a full disk later is a failed write.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import struct
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from pagedrs.kv_tiers.errors import CorruptPageError, DiskTierError, StoreBusyError, os_reason
from pagedrs.kv_tiers.slot_record import META, SLOT_MAGIC, SlotMeta, SlotRecord
from pagedrs.kv_tiers.slot_writer import SlotWriter
from pagedrs.kv_tiers.store_layout import FILE_NAME, FORMAT_VERSION, HEADER_BYTES, SeedPages, StoreGeometry

__all__ = ["FILE_NAME", "FORMAT_VERSION", "HEADER_BYTES", "CorruptPageError", "DiskPageStore", "DiskTierError",
           "SeedPages", "StoreBusyError", "StoreGeometry"]

logger = logging.getLogger("pagedrs.kv_tiers")

_FILE_MAGIC = b"PAGEDRS-KVSTORE\n"
_ALIGN = 4096
MAX_SLOTS = 2**32 - 1  # slots travel as uint32 (the core's disk index, DiskTier's transfers)
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _free_bytes(where: int | os.PathLike) -> int:
    """The bytes an unprivileged writer may still use on the file system of a file descriptor or path."""
    vfs = os.statvfs(where)
    return vfs.f_bavail * vfs.f_frsize


class DiskPageStore:
    def __init__(self, directory: str | os.PathLike, *, num_slots: int, geometry: StoreGeometry) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots is {num_slots}; a disk store needs at least 1 slot")
        self.path = Path(directory) / FILE_NAME
        self.num_slots = num_slots
        self.geometry = geometry
        bs = geometry.block_size
        self._format = SlotRecord(block_size=bs, page_bytes=geometry.page_bytes, epoch=0)
        self.meta_bytes = self._format.meta_bytes
        self.page_bytes = geometry.page_bytes
        self.slot_bytes = _round_up(self.meta_bytes + self.page_bytes, _ALIGN)
        self._fd: Optional[int] = None
        self._generation = 0
        self._writer = SlotWriter(self.path, self._write_record, self._zero_magic)
        self._queue = self._writer.queue  # what waiting for the writer joins
        self.bytes_read = 0

    @property
    def _f(self) -> int:
        """The open file descriptor (the store is used only between open and close)."""
        if self._fd is None:
            raise RuntimeError(f"the KV disk store {self.path} is not open")
        return self._fd

    # ---- open and close ------------------------------------------------------------

    def _header_fields(self) -> dict:
        return dict(format=FORMAT_VERSION, num_slots=self.num_slots, slot_bytes=self.slot_bytes,
                    **self.geometry.header_fields())

    def open(self) -> SeedPages:
        """Locks and opens (or creates) the store; returns the valid pages it holds.

        Raises DiskTierError (StoreBusyError when another engine holds it) naming the path
        and the reason when the store cannot be used: nothing stays open then."""
        directory = self.path.parent
        self._check_room()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DiskTierError(directory, os_reason(exc)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise StoreBusyError(directory, f"the KV disk store {self.path} is open in another engine") from None
            raise DiskTierError(directory, f"the store {self.path} cannot be locked: {os_reason(exc)}") from exc
        self._fd = fd
        try:
            self._writer.open_index(self.num_slots)
            seed = self._open_locked()
        except BaseException as exc:
            os.close(fd)
            self._fd = None
            if isinstance(exc, OSError):
                raise DiskTierError(directory, os_reason(exc)) from exc
            raise
        self._writer.start()
        return seed

    def _open_locked(self) -> SeedPages:
        size = os.fstat(self._f).st_size
        header, problem = self._read_header(size)
        expected = self._header_fields()
        keys = [*expected, *(() if "kv_cache" in expected else ("kv_cache",))]  # an fp8 header read as auto too
        mismatch = None if header is None else [k for k in keys if header.get(k) != expected.get(k)]
        if header is not None and not mismatch:
            self._format = replace(self._format, epoch=int(header["epoch"]))
            seed = self._scan(size)
        else:
            invalidated = np.zeros(0, dtype=np.uint64)
            if header is not None:
                problem = "it was written with another " + ", ".join(mismatch or [])
                invalidated = self._old_hashes(header, size)
            if size > 0:
                logger.warning("ignoring the KV disk store %s: %s; starting it afresh", self.path, problem)
            self._create()
            seed = self._empty_seed(invalidated)
        self._preallocate()
        return seed

    def _read_header(self, size: int) -> tuple[Optional[dict], str]:
        if size < HEADER_BYTES:
            return None, f"the file is truncated ({size} bytes, header {HEADER_BYTES})"
        raw = os.pread(self._f, HEADER_BYTES, 0)
        if not raw.startswith(_FILE_MAGIC):
            return None, "it is not a pagedrs KV store (bad magic)"
        try:
            (length,) = struct.unpack_from("<I", raw, len(_FILE_MAGIC))
            start = len(_FILE_MAGIC) + 4
            body = raw[start : start + length]
            (crc,) = struct.unpack_from("<I", raw, start + length)
            if zlib.crc32(body) != crc:
                return None, "its header fails its checksum"
            return json.loads(body), ""
        except (struct.error, ValueError):
            return None, "its header is unreadable"

    def _create(self) -> None:
        self._format = replace(self._format, epoch=secrets.randbits(32))
        self._generation = 0
        body = json.dumps({**self._header_fields(), "epoch": self._format.epoch}, sort_keys=True).encode()
        header = _FILE_MAGIC + struct.pack("<I", len(body)) + body + struct.pack("<I", zlib.crc32(body))
        os.ftruncate(self._f, 0)
        os.pwrite(self._f, header.ljust(HEADER_BYTES, b"\0"), 0)
        os.fsync(self._f)

    def _preallocate(self) -> None:
        """Reserves the whole file: a disk too small for the store fails here, at startup."""
        total = HEADER_BYTES + self.num_slots * self.slot_bytes
        st = os.fstat(self._f)
        reserved = st.st_blocks * 512
        if st.st_size >= total and reserved >= total:
            return
        try:
            os.posix_fallocate(self._f, 0, total)
            return
        except OSError as exc:
            if exc.errno not in _NO_FALLOCATE:
                if st.st_size < total:
                    os.ftruncate(self._f, st.st_size)  # give back what a partial reservation took
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._too_small(total - reserved, _free_bytes(self._f), exc) from exc
                raise
        # A file system that cannot reserve space: the file stays sparse if the space is free
        # now; a disk that fills later is a failed write (the page is lost, never wrong).
        free = _free_bytes(self._f)
        if free < total - reserved:
            raise self._too_small(total - reserved, free, None)
        logger.warning("the file system of the KV disk store %s cannot reserve space (no fallocate); the store "
                       "stays sparse, and a disk that fills later drops the pages it cannot write", self.path)
        if st.st_size < total:
            os.ftruncate(self._f, total)

    def _check_room(self) -> None:
        """Before anything is made or allocated (the writer's index takes 8 bytes a slot): the slots are
        numbered in 32 bits, and the store fits the free space of the file system it goes on (a store
        already there counts the space it holds). The exact reservation is _preallocate's, at open."""
        total = HEADER_BYTES + self.num_slots * self.slot_bytes
        where, held = self.path, 0
        try:
            held = os.stat(where).st_blocks * 512 if where.is_file() else 0
            while not where.exists() and where != where.parent:
                where = where.parent
            vfs = os.statvfs(where)
            # a file system of no size (procfs, sysfs) holds no store: the open that follows says why
            free = vfs.f_bavail * vfs.f_frsize if vfs.f_blocks > 0 else None
        except OSError:
            free = None  # the open that follows names what is wrong with the path
        if free is not None and total - held > free:
            raise self._too_small(total - held, free, None)
        if self.num_slots > MAX_SLOTS:
            raise DiskTierError(self.path.parent, f"kv_disk_gb asks for {self.num_slots} page slots of {self.slot_bytes} "
                                                  f"bytes; the store numbers its slots in 32 bits: allowed at most "
                                                  f"{MAX_SLOTS} slots ({MAX_SLOTS * self.slot_bytes} bytes); lower kv_disk_gb")

    def _too_small(self, needed: int, free: int, exc: Optional[OSError]) -> DiskTierError:
        why = f" ({os_reason(exc)})" if exc is not None else ""
        return DiskTierError(self.path.parent, f"the store {self.path} needs {needed} more bytes ({self.num_slots} "
                                               f"page slots of {self.slot_bytes} bytes) and its file system has "
                                               f"{free} bytes free{why}; lower kv_disk_gb")

    def _empty_seed(self, invalidated: np.ndarray) -> SeedPages:
        bs = self.geometry.block_size
        return SeedPages(np.zeros(0, np.uint32), np.zeros(0, np.uint64), np.zeros(0, np.uint64),
                         np.zeros((0, bs), np.uint32), invalidated)

    def _scan(self, size: int) -> SeedPages:
        """Every slot whose meta and checksum are intact, oldest write first."""
        found: list[tuple[int, int, int, int, np.ndarray]] = []
        bad = 0
        batch = max(1, (64 << 20) // self.slot_bytes)
        for first in range(0, self.num_slots, batch):
            count = min(batch, self.num_slots - first)
            raw = os.pread(self._f, count * self.slot_bytes, HEADER_BYTES + first * self.slot_bytes)
            for i in range(count):
                record = raw[i * self.slot_bytes : (i + 1) * self.slot_bytes]
                if len(record) < META.size or record[:4] != SLOT_MAGIC:
                    bad += len(record) >= 4 and record[:4] != b"\0\0\0\0"
                    continue
                parsed = self._format.parse(record)
                if parsed is None:
                    bad += 1
                    continue
                generation, page_hash, parent, tokens = parsed
                found.append((generation, first + i, page_hash, parent, tokens))
                self._writer.current[first + i] = generation
        expected = HEADER_BYTES + self.num_slots * self.slot_bytes
        if size < expected or bad:
            logger.warning("the KV disk store %s: %d damaged page(s) ignored%s", self.path, bad,
                           f"; the file is truncated ({size} of {expected} bytes)" if size < expected else "")
        found.sort(key=lambda f: f[0])
        self._generation = found[-1][0] + 1 if found else 0
        bs = self.geometry.block_size
        return SeedPages(
            slots=np.asarray([f[1] for f in found], dtype=np.uint32),
            hashes=np.asarray([f[2] for f in found], dtype=np.uint64),
            parents=np.asarray([f[3] for f in found], dtype=np.uint64),
            tokens=np.asarray([f[4] for f in found], dtype=np.uint32).reshape(len(found), bs),
            invalidated=np.zeros(0, dtype=np.uint64),
        )

    def _old_hashes(self, header: dict, size: int) -> np.ndarray:
        """Page hashes a mismatched store held (for miss accounting), read from slot metas only."""
        try:
            slot_bytes, num_slots = int(header["slot_bytes"]), int(header["num_slots"])
        except (KeyError, TypeError, ValueError):
            return np.zeros(0, dtype=np.uint64)
        hashes = []
        for slot in range(min(num_slots, max(0, size - HEADER_BYTES) // max(1, slot_bytes))):
            meta = os.pread(self._f, META.size, HEADER_BYTES + slot * slot_bytes)
            if len(meta) == META.size and meta[:4] == SLOT_MAGIC:
                hashes.append(META.unpack(meta)[2])
        return np.asarray(hashes, dtype=np.uint64)

    def flush(self) -> None:
        """Waits until every queued page is written (or has failed), then makes it durable."""
        if self._fd is None:
            return
        self._writer.wait()
        os.fsync(self._f)

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        except OSError as exc:  # closing never raises: what did not reach the disk is lost, never wrong
            logger.warning("making the KV disk store %s durable failed at close: %s", self.path, exc)
        self._writer.stop()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    # ---- pages ---------------------------------------------------------------------

    def write(self, slots: np.ndarray, hashes: np.ndarray, parents: np.ndarray, tokens: np.ndarray,
              pages: np.ndarray) -> None:
        """Queues pages [N, page_bytes] (uint8) for slots; the bytes are copied now."""
        if pages.shape != (len(slots), self.page_bytes):
            raise ValueError(f"pages has shape {pages.shape}; expected ({len(slots)}, {self.page_bytes})")
        for i, slot in enumerate(slots.tolist()):
            self._check_slot(slot)
            generation = self._generation
            self._generation += 1
            record = self._format.pack(generation, int(hashes[i]), int(parents[i]), tokens[i], pages[i].tobytes())
            self._writer.put(slot, generation, record)

    def erase_pages(self) -> None:
        """Every page made invalid, durably (a reset of the prefix cache): a restart seeds none back."""
        if self._fd is not None:
            self._writer.erase_all()
            os.fsync(self._f)

    def take_failed_slots(self) -> list[int]:
        """The slots whose last write failed since the last call (ascending): the core must
        drop them from its disk index. A read of one raises CorruptPageError meanwhile."""
        return self._writer.take_failed()

    @property
    def bytes_written(self) -> int:
        return self._writer.bytes_written

    @property
    def failed_writes(self) -> int:
        """Page writes that failed since open (each one a page dropped from the disk tier)."""
        return self._writer.failed_writes

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Pages [N, page_bytes] (uint8) of the slots: queued ones from memory, the rest
        with one read per run of consecutive slots. Every slot is checked; CorruptPageError
        names all those whose bytes are not the record last written to them."""
        out = np.empty((len(slots), self.page_bytes), dtype=np.uint8)
        wanted = slots.tolist()
        for slot in wanted:
            self._check_slot(slot)
        in_memory, on_disk, bad = self._writer.resolve(wanted)
        from_disk: list[tuple[int, int, int]] = []  # slot, index in out, generation it must hold
        for i, slot in enumerate(wanted):
            if slot in in_memory:
                out[i] = self._format.page(in_memory[slot])
            elif slot in on_disk:
                from_disk.append((slot, i, on_disk[slot]))
        from_disk.sort()
        start = 0
        while start < len(from_disk):
            end = start + 1
            while end < len(from_disk) and from_disk[end][0] == from_disk[end - 1][0] + 1:
                end += 1
            first = from_disk[start][0]
            try:
                raw = os.pread(self._f, (from_disk[end - 1][0] - first + 1) * self.slot_bytes,
                               HEADER_BYTES + first * self.slot_bytes)
            except OSError as exc:
                bad.update((slot, f"cannot be read ({os_reason(exc)})") for slot, _, _ in from_disk[start:end])
                start = end
                continue
            self.bytes_read += len(raw)
            for slot, i, generation in from_disk[start:end]:
                record = raw[(slot - first) * self.slot_bytes : (slot - first + 1) * self.slot_bytes]
                parsed = self._format.parse(record)
                if parsed is None:
                    bad[slot] = "failed its checksum"
                elif parsed.generation != generation:
                    bad[slot] = "holds an older page than the one last written to it"
                else:
                    out[i] = self._format.page(record)
            start = end
        if bad:
            named = [f"slot {s} {why}" for s, why in sorted(bad.items())]
            more = f"; and {len(named) - 8} more" if len(named) > 8 else ""
            raise CorruptPageError(f"{len(bad)} page(s) read from {self.path} cannot be used: "
                                   + "; ".join(named[:8]) + more, slots=sorted(bad))
        return out

    def slot_meta(self, slot: int) -> Optional[SlotMeta]:
        """The meta (generation, hash, parent, tokens) of the page a read of the slot returns; None where it raises."""
        self._check_slot(slot)
        in_memory, on_disk, _ = self._writer.resolve([slot])
        if slot in in_memory:
            return self._format.parse(in_memory[slot])
        if slot not in on_disk:
            return None
        meta = self._format.parse(os.pread(self._f, self.slot_bytes, HEADER_BYTES + slot * self.slot_bytes))
        return meta if meta is not None and meta.generation == on_disk[slot] else None

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is out of range; the store has {self.num_slots} slots")

    # ---- what the writer thread calls -----------------------------------------------

    def _write_record(self, slot: int, record: bytes) -> None:
        """The whole record into its slot; a short write is retried, one that writes nothing fails."""
        view, offset = memoryview(record), HEADER_BYTES + slot * self.slot_bytes
        while view:
            n = os.pwrite(self._f, view, offset)
            if n <= 0:
                raise OSError(errno.EIO, f"a write to {self.path} wrote {n} of {len(view)} bytes")
            view, offset = view[n:], offset + n

    def _zero_magic(self, slot: int) -> None:
        """After a failed write: the slot must not validate at the next open."""
        os.pwrite(self._f, bytes(len(SLOT_MAGIC)), HEADER_BYTES + slot * self.slot_bytes)
