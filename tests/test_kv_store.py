"""The disk page store alone: pages round-trip, a page waiting for the writer reads back
from memory, and a SIGKILL in the middle of writes damages no page it was not writing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from pagedrs.kv_tiers.disk_store import DiskPageStore, StoreGeometry

GEOMETRY = StoreGeometry(fingerprint="test", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2,
                         head_dim=8, itemsize=4)


def page(slot: int, round_: int) -> np.ndarray:
    """A page whose every byte says which slot and which round wrote it."""
    return np.full(GEOMETRY.page_bytes, (slot * 7 + round_ * 13) % 251, dtype=np.uint8)


def write(store: DiskPageStore, slots: list[int], round_: int) -> None:
    arr = np.asarray(slots, dtype=np.uint32)
    tokens = np.asarray([[s, round_, 0, 0] for s in slots], dtype=np.uint32)
    store.write(arr, arr.astype(np.uint64) + 1000 * round_, np.zeros(len(slots), np.uint64), tokens,
                np.stack([page(s, round_) for s in slots]))


def test_pages_round_trip_and_reopen_in_write_order(tmp_path):
    store = DiskPageStore(tmp_path, num_slots=8, geometry=GEOMETRY)
    assert len(store.open()) == 0
    write(store, [5, 2, 3], 0)
    got = store.read(np.asarray([3, 5], dtype=np.uint32))  # from memory or disk, the same bytes
    assert (got[0] == page(3, 0)).all() and (got[1] == page(5, 0)).all()
    write(store, [2], 1)  # overwrite: the newer page wins
    store.close()
    again = DiskPageStore(tmp_path, num_slots=8, geometry=GEOMETRY)
    seed = again.open()
    assert seed.slots.tolist() == [5, 3, 2], "oldest write first"
    assert seed.hashes.tolist() == [5, 3, 1002]
    assert seed.tokens[2].tolist() == [2, 1, 0, 0]
    assert (again.read(np.asarray([2], dtype=np.uint32))[0] == page(2, 1)).all()
    with pytest.raises(ValueError, match="slot 8 is out of range; the store has 8 slots"):
        again.read(np.asarray([8], dtype=np.uint32))
    again.close()


CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from test_kv_store import DiskPageStore, GEOMETRY, write
store = DiskPageStore(sys.argv[1], num_slots=64, geometry=GEOMETRY)
store.open()
write(store, list(range(16)), 0)
store.flush()
print("ready", flush=True)
round_ = 1
while True:
    write(store, list(range(16, 64)), round_)
    if round_ == 3:
        print("writing", flush=True)
    round_ += 1
    store._queue.join()
"""


def test_sigkill_during_writes_damages_no_other_page(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), os.path.dirname(__file__)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    store = DiskPageStore(tmp_path, num_slots=64, geometry=GEOMETRY)
    seed = store.open()
    slots = seed.slots.tolist()
    assert set(range(16)) <= set(slots), "pages written before the kill are all intact"
    pages = store.read(seed.slots)
    for i, slot in enumerate(slots):
        round_ = int(seed.tokens[i][1])
        assert int(seed.tokens[i][0]) == slot and (pages[i] == page(slot, round_)).all(), f"slot {slot}"
    store.close()
