"""SlotWriter: the disk store's background writer, and what makes a read safe while its
writes are in flight or have failed.

    DiskPageStore.write ── put(slot, generation, record) ──► queue ──► writer thread ── pwrite ──► file
                              pending[slot] = record                      ok:     pending dropped
                              current[slot] = generation                  failed: current[slot] = WRITE_FAILED,
                                                                                  failed += slot, then pending dropped
    DiskPageStore.read ── resolve(slots) ──► per slot: the record in memory
                                                     | the generation the file must hold there
                                                     | why there is no page to read

Invariant (under the one lock): for every slot, either its newest record is in ``pending``,
or ``current`` says what the file holds for it: the generation of that record when its write
succeeded, WRITE_FAILED when it failed. A failure is recorded before the copy in memory is
dropped, so no read ever finds neither and falls back to an older record the file still has.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np

from pagedrs.kv_tiers.errors import os_reason

logger = logging.getLogger("pagedrs.kv_tiers")

NO_PAGE, WRITE_FAILED = -1, -2  # values of SlotWriter.current when a slot holds no record to read


class SlotWriter:
    def __init__(self, path: Path, write: Callable[[int, bytes], None], invalidate: Callable[[int], None]) -> None:
        """write(slot, record) writes a whole record or raises; invalidate(slot) makes the
        slot's record fail validation at the next open (best effort, after a failed write)."""
        self.path = path
        self._write, self._invalidate = write, invalidate
        self._lock = threading.Lock()
        self._pending: dict[int, bytes] = {}  # slot -> its newest record, until the writer is done with it
        # one entry a slot, allocated by open_index once the store knows it has room; set by its scan at open
        self.current = np.full(0, NO_PAGE, dtype=np.int64)
        self._failed: set[int] = set()  # slots whose newest write failed, until take_failed
        self.queue: queue.Queue[Optional[tuple[int, int, bytes]]] = queue.Queue()  # slot, generation, record
        self._thread: Optional[threading.Thread] = None
        self._burst = 0  # failures since the last write that succeeded (the writer thread's own)
        self.bytes_written = 0
        self.failed_writes = 0

    def open_index(self, num_slots: int) -> None:
        """Every slot holds no page (until the store's scan says what it holds)."""
        self.current = np.full(num_slots, NO_PAGE, dtype=np.int64)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pagedrs-kv-disk-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until every queued record is written or has failed."""
        self.queue.join()

    def stop(self) -> None:
        if self._thread is not None:
            self.queue.put(None)
            self._thread.join()
            self._thread = None

    def put(self, slot: int, generation: int, record: bytes) -> None:
        with self._lock:
            self._pending[slot] = record
            self.current[slot] = generation
            # The core gave the slot a new page: one whose write failed is no longer in its index.
            self._failed.discard(slot)
        self.queue.put((slot, generation, record))

    def erase_all(self) -> None:
        """Once the queued records are written, invalidates every slot that holds one (a reset of
        the prefix cache: the next open must seed nothing); the slots then hold no page."""
        self.wait()
        with self._lock:
            held = np.flatnonzero(self.current != NO_PAGE).tolist()
            self.current[:] = NO_PAGE
            self._failed.clear()
        for slot in held:
            self._invalidate(slot)

    def take_failed(self) -> list[int]:
        with self._lock:
            failed, self._failed = sorted(self._failed), set()
        return failed

    def resolve(self, slots: list[int]) -> tuple[dict[int, bytes], dict[int, int], dict[int, str]]:
        """(records in memory, generation the file must hold, why there is no page), by slot."""
        in_memory: dict[int, bytes] = {}
        on_disk: dict[int, int] = {}
        missing: dict[int, str] = {}
        with self._lock:
            for slot in slots:
                record = self._pending.get(slot)
                current = int(self.current[slot])
                if record is not None:
                    in_memory[slot] = record
                elif current >= 0:
                    on_disk[slot] = current
                else:
                    missing[slot] = "was not written (its write failed)" if current == WRITE_FAILED else "holds no page"
        return in_memory, on_disk, missing

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                self.queue.task_done()
                return
            slot, generation, record = item
            try:
                self._write(slot, record)
            except Exception as exc:  # noqa: BLE001 - a full or failing disk: the page is lost, never wrong
                self._failed_write(slot, generation, record, exc)
            else:
                self.bytes_written += len(record)
                if self._burst:
                    logger.info("the KV disk store %s writes again, after %d failed page write(s)", self.path,
                                self._burst)
                    self._burst = 0
                with self._lock:
                    if self._pending.get(slot) is record:
                        del self._pending[slot]
            finally:
                self.queue.task_done()

    def _failed_write(self, slot: int, generation: int, record: bytes, exc: Exception) -> None:
        """Records the failure, and only then drops the page's copy in memory."""
        self.failed_writes += 1
        if self._burst == 0:
            why = os_reason(exc) if isinstance(exc, OSError) else repr(exc)
            logger.warning("writing pages to the KV disk store %s fails (%s, slot %d first); each page that "
                           "cannot be written is dropped from the disk tier (logged once until a write succeeds)",
                           self.path, why, slot)
        self._burst += 1
        try:
            self._invalidate(slot)
        except OSError:
            pass  # then its old record may validate at the next open, as the page it really holds
        with self._lock:
            if int(self.current[slot]) == generation:  # else a newer write to the slot is queued
                self.current[slot] = WRITE_FAILED
                self._failed.add(slot)
            if self._pending.get(slot) is record:
                del self._pending[slot]
