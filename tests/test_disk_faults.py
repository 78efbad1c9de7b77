"""The disk tier under faults: the page is lost, never wrong (issue 23, items 2 and 3).

Store level (DiskPageStore alone, always run): a write that fails (ENOSPC with nothing
written, half a record, a short write, a page without its meta) is reported once by
take_failed_slots, its slot never reads back, and no older page of the slot validates
for the newer one, now or at the next open; a read names every slot that fails.
Startup: a disk tier asked for (kv_disk_path) that cannot be used is an error naming the
path and the reason, at Engine construction and as exit 2 from the CLIs.
Engine level: greedy output with the disk tier under each fault equals the no-disk run,
no request ends with an error, and the core never reads a slot it was told is lost
(these need the engine's part: Scheduler.invalidate_disk_slots and the recompute of a
step whose swap-in fails its checksum).
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import subprocess
import threading
import types
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, Optional

import numpy as np
import pytest

from pagedrs import Engine, EngineArgs
from pagedrs.executor.async_execution import AsyncExecution
from pagedrs.kv_tiers.disk_store import FILE_NAME, HEADER_BYTES, DiskPageStore
from pagedrs.kv_tiers.errors import CorruptPageError, DiskTierError, StoreBusyError
from test_engine import greedy
from test_kv_store import GEOMETRY, page, write
from test_kv_tiers import BLOCK, conversations, engine, gib


def slots(*s: int) -> np.ndarray:
    return np.asarray(s, dtype=np.uint32)


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---- fault injection: os.pwrite of the store's file only ---------------------------

# (slot, offset inside the slot, bytes) -> None (write it) or a fault:
#   "nothing"  raise ENOSPC, nothing written       "half"    write half, then raise
#   "short"    write half and return the count     "page"    write the page but not the meta, then raise
#   "meta"     write the meta but not the page, then raise
Rule = Callable[[int, int, int], Optional[str]]


def inject(monkeypatch, store: DiskPageStore, rule: Rule) -> list[tuple[int, int, int, str]]:
    """Routes the store's pwrites through rule; returns the log of the faults it applied."""
    real = os.pwrite
    faults: list[tuple[int, int, int, str]] = []

    def pwrite(fd, data, offset):
        if fd != store._fd or offset < HEADER_BYTES:
            return real(fd, data, offset)
        slot, inside = divmod(offset - HEADER_BYTES, store.slot_bytes)
        data = bytes(data)
        fault = rule(slot, inside, len(data))
        if fault is None:
            return real(fd, data, offset)
        faults.append((slot, inside, len(data), fault))
        if fault == "short":
            return real(fd, data[: len(data) // 2], offset)
        if fault == "half":
            real(fd, data[: len(data) // 2], offset)
        elif fault == "page":
            real(fd, data[store.meta_bytes :], offset + store.meta_bytes)
        elif fault == "meta":
            real(fd, data[: store.meta_bytes], offset)
        raise enospc()

    monkeypatch.setattr(os, "pwrite", pwrite)
    return faults


def new_store(path, num_slots: int = 8) -> DiskPageStore:
    store = DiskPageStore(path, num_slots=num_slots, geometry=GEOMETRY)
    store.open()
    return store


def reopen(path, num_slots: int = 8):
    store = DiskPageStore(path, num_slots=num_slots, geometry=GEOMETRY)
    return store, store.open()


def warnings_of(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# ---- store level: failed writes ----------------------------------------------------


def test_failed_writes_are_reported_once_and_their_slots_never_read_back(tmp_path, monkeypatch, caplog):
    store = new_store(tmp_path)
    write(store, [0, 1, 2, 3], 0)
    store.flush()
    failing = {1, 2}
    inject(monkeypatch, store, lambda slot, inside, n: "nothing" if slot in failing and n > 4 else None)
    with caplog.at_level(logging.INFO, logger="pagedrs.kv_tiers"):
        write(store, [1, 2, 3], 1)
        store.flush()
        assert store.take_failed_slots() == [1, 2]
        assert store.take_failed_slots() == [], "taken once"
        assert store.failed_writes == 2
        assert len(warnings_of(caplog, "fails")) == 1, "one warning per burst of failures"
        assert (store.read(slots(3))[0] == page(3, 1)).all() and (store.read(slots(0))[0] == page(0, 0)).all()
        with pytest.raises(CorruptPageError) as err:
            store.read(slots(0, 1, 2, 3))
        assert err.value.slots == [1, 2], "every slot of the read is checked before raising"
        assert "slot 1" in str(err.value) and "slot 2" in str(err.value) and str(store.path) in str(err.value)
        assert pickle.loads(pickle.dumps(err.value)).slots == [1, 2]
        assert store.slot_meta(1) is None and store.slot_meta(3).page_hash == 1003
        write(store, [1], 2)  # slot 3's write ended the burst: a new failure warns again
        store.flush()
        assert len(warnings_of(caplog, "fails")) == 2 and store.take_failed_slots() == [1]
    failing.clear()
    write(store, [1], 3)  # the slot holds a new page, written: readable again
    store.flush()
    assert (store.read(slots(1))[0] == page(1, 3)).all() and store.take_failed_slots() == []
    store.close()
    again, seed = reopen(tmp_path)
    got = dict(zip(seed.slots.tolist(), seed.hashes.tolist()))
    assert got == {0: 0, 3: 1003, 1: 3001}, "slot 2 does not validate at the next open: not as its old page either"
    again.close()


def test_a_failed_write_of_a_page_the_slot_no_longer_holds_is_not_reported(tmp_path, monkeypatch):
    """The core gave the slot a newer page before the old one's write failed (or before it
    took the failure): the slot holds the newer page, so there is nothing to drop."""
    store = new_store(tmp_path)
    both_queued = threading.Event()
    records: list[int] = []
    fail_next = {"on": False}

    def rule(slot, inside, n):
        if n == len(b"PGSL"):
            return None
        records.append(slot)
        if len(records) == 1:  # round 0 fails once round 1 is queued behind it
            assert both_queued.wait(30)
            return "nothing"
        return "nothing" if fail_next["on"] else None

    inject(monkeypatch, store, rule)
    write(store, [4], 0)
    write(store, [4], 1)
    both_queued.set()
    store.flush()
    assert store.take_failed_slots() == [] and (store.read(slots(4))[0] == page(4, 1)).all()
    fail_next["on"] = True
    write(store, [4], 2)
    store.flush()
    fail_next["on"] = False
    write(store, [4], 3)  # the core reassigned the slot before it took the failure
    store.flush()
    assert store.take_failed_slots() == [] and (store.read(slots(4))[0] == page(4, 3)).all()
    assert store.failed_writes == 2
    store.close()


@pytest.mark.parametrize("tombstone", ["ok", "fails"])
@pytest.mark.parametrize("fault", ["nothing", "half", "short", "page", "meta"])
def test_a_failed_write_never_lets_the_old_page_answer_for_the_new(tmp_path, monkeypatch, caplog, fault, tombstone):
    """Slot 5 holds a valid page (round 0); its overwrite (round 1) fails in each way. Neither
    then nor at the next open may the slot read back as round 1, nor round 0's bytes stand
    for round 1's meta or round 1's bytes for round 0's meta."""
    store = new_store(tmp_path)
    write(store, [5, 6], 0)
    store.flush()

    def rule(slot, inside, n):
        if slot != 5:
            return None
        if n == len(b"PGSL"):  # zeroing the magic after the failure
            return "nothing" if tombstone == "fails" else None
        if fault == "short":
            return "short" if inside == 0 else "nothing"  # the retry of the rest fails
        return fault

    faults = inject(monkeypatch, store, rule)
    write(store, [5, 6], 1)
    store.flush()
    assert faults and faults[0][3] == fault
    assert store.take_failed_slots() == [5]
    with pytest.raises(CorruptPageError, match="slot 5") as err:
        store.read(slots(6, 5))
    assert err.value.slots == [5]
    assert (store.read(slots(6))[0] == page(6, 1)).all()
    store.close()
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        again, seed = reopen(tmp_path)
    found = dict(zip(seed.slots.tolist(), range(len(seed))))
    assert 6 in found and int(seed.hashes[found[6]]) == 1006
    if 5 in found:  # only when nothing of the new record reached the disk and its magic could not be zeroed
        assert (fault, tombstone) == ("nothing", "fails")
        i = found[5]
        assert int(seed.hashes[i]) == 5 and seed.tokens[i].tolist() == [5, 0, 0, 0], "the old meta, never the new"
        assert (again.read(slots(5))[0] == page(5, 0)).all(), "and the old page under it"
    again.close()


def test_a_short_write_is_finished_by_a_retry(tmp_path, monkeypatch):
    store = new_store(tmp_path)
    faults = inject(monkeypatch, store, lambda slot, inside, n: "short" if slot == 3 and inside == 0 else None)
    write(store, [3], 0)
    store.flush()
    assert faults and store.take_failed_slots() == []
    assert (store.read(slots(3))[0] == page(3, 0)).all()
    store.close()
    monkeypatch.undo()
    again, seed = reopen(tmp_path)
    assert seed.slots.tolist() == [3]
    again.close()


# ---- store level: reads ------------------------------------------------------------


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_pages_corrupted_between_write_and_read_are_all_named(tmp_path):
    store = new_store(tmp_path)
    write(store, [0, 1, 2, 3, 4, 5], 0)
    store.flush()
    file = tmp_path / FILE_NAME
    flip(file, HEADER_BYTES + 2 * store.slot_bytes + store.meta_bytes + 10)  # slot 2's page
    flip(file, HEADER_BYTES + 4 * store.slot_bytes + 40)  # slot 4's tokens, in its meta
    with pytest.raises(CorruptPageError) as err:
        store.read(slots(5, 4, 3, 2, 1, 0))
    assert err.value.slots == [2, 4]
    message = str(err.value)
    assert "slot 2" in message and "slot 4" in message and "checksum" in message and str(store.path) in message
    got = store.read(slots(0, 1, 3, 5))
    assert all((got[i] == page(s, 0)).all() for i, s in enumerate([0, 1, 3, 5]))
    store.close()


def test_an_older_record_put_back_in_a_slot_is_not_read_as_the_newer(tmp_path):
    """A slot whose bytes validate but are not the record last written to it (an old copy
    restored, a write the disk acknowledged and dropped) is refused too."""
    store = new_store(tmp_path)
    file = tmp_path / FILE_NAME
    at = HEADER_BYTES + 1 * store.slot_bytes
    write(store, [1], 0)
    store.flush()
    old = file.read_bytes()[at : at + store.slot_bytes]
    write(store, [1], 1)
    store.flush()
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(old)
    with pytest.raises(CorruptPageError, match="older page") as err:
        store.read(slots(1))
    assert err.value.slots == [1]
    store.close()


def test_a_read_that_fails_names_every_slot_of_it(tmp_path, monkeypatch):
    store = new_store(tmp_path)
    write(store, [2, 3, 6], 0)
    store.flush()
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
                        if fd == store._fd else real(fd, n, off))
    with pytest.raises(CorruptPageError, match="cannot be read") as err:
        store.read(slots(6, 2, 3))
    assert err.value.slots == [2, 3, 6]
    monkeypatch.undo()
    store.close()


# ---- startup: a tier asked for and not given is an error ---------------------------


def test_no_space_for_the_store_is_a_startup_error_and_leaves_it_unlocked(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise enospc()

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    store = DiskPageStore(tmp_path, num_slots=8, geometry=GEOMETRY)
    with pytest.raises(DiskTierError) as err:
        store.open()
    message = str(err.value)
    assert isinstance(err.value, ValueError) and f"kv_disk_path={str(tmp_path)!r}" in message
    assert re.search(r"needs \d+ more bytes \(8 page slots of \d+ bytes\) and its file system has \d+ bytes free",
                     message), message
    assert "no space left" in message and "lower kv_disk_gb" in message
    assert store._fd is None
    monkeypatch.undo()
    again = new_store(tmp_path)  # the failed open holds no lock
    again.close()


def test_a_store_past_the_free_space_is_refused_before_anything_is_allocated(tiny_llama_dir, tmp_path, monkeypatch):
    """kv_disk_gb=1e6 raised MemoryError (the writer's index, 8 bytes a slot, was allocated first)."""
    with pytest.raises(DiskTierError) as err:
        engine(tiny_llama_dir, kv_disk_path=str(tmp_path / "kv"), kv_disk_gb=1e6)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    found = re.search(r"needs (\d+) more bytes \((\d+) page slots of 4096 bytes\) and its file system has (\d+) bytes "
                      r"free; lower kv_disk_gb", str(err.value))
    assert found, str(err.value)
    needed, free_said = int(found[1]), int(found[3])
    assert needed == HEADER_BYTES + int(found[2]) * 4096 and needed > 1e6 * 2**30 * 0.99
    assert abs(free_said - free) < 2**30
    assert not (tmp_path / "kv").exists(), "refused before the store was made"
    huge = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda where: types.SimpleNamespace(f_bavail=2**40, f_frsize=huge.f_frsize,
                                                                           f_blocks=2**41))
    with pytest.raises(DiskTierError, match=f"asks for {2**32} page slots of 4096 bytes; the store numbers its slots "
                       f"in 32 bits: allowed at most {2**32 - 1} slots"):
        DiskPageStore(tmp_path / "huge", num_slots=2**32, geometry=GEOMETRY).open()


def test_a_file_system_without_fallocate_stays_sparse_if_it_has_the_space(tmp_path, monkeypatch, caplog):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        store = new_store(tmp_path)
    assert len(warnings_of(caplog, "cannot reserve space")) == 1
    assert os.stat(store.path).st_size == HEADER_BYTES + 8 * store.slot_bytes
    store.close()
    monkeypatch.setattr(os, "statvfs", lambda fd: types.SimpleNamespace(f_bavail=1, f_frsize=4096, f_blocks=2**20))
    with pytest.raises(DiskTierError, match="bytes free"):
        DiskPageStore(tmp_path / "other", num_slots=8, geometry=GEOMETRY).open()


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(name, options) -> a fresh tmpfs directory; skips where the test cannot mount."""
    mounted: list[str] = []

    def mount(name: str, options: str):
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or done.returncode}")
        mounted.append(str(where))
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", where], check=False)


def test_a_store_larger_than_a_small_tmpfs_is_a_startup_error(tmp_path, mount_tmpfs):
    disk = mount_tmpfs("small", "size=8m")
    store = DiskPageStore(disk / "kv", num_slots=int(0.05 * 2**30) // 8192, geometry=GEOMETRY)
    with pytest.raises(DiskTierError, match="bytes free") as err:
        store.open()
    assert str(disk / "kv") in str(err.value)
    vfs = os.statvfs(disk)
    assert vfs.f_bavail * vfs.f_frsize > 7 * 2**20, "the failed reservation gave its space back"


def path_problems(tmp_path, monkeypatch, problem: str):
    """(kv_disk_path, the reason expected) for each way a directory can be unusable."""
    if problem == "a file in the way":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file", "not a directory"
    if problem == "a file above it":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file" / "kv", "not a directory"
    if problem == "the store file is a directory":
        (tmp_path / "kv" / FILE_NAME).mkdir(parents=True)
        return tmp_path / "kv", "is a directory"
    error = {"read-only": errno.EROFS, "permission": errno.EACCES}[problem]
    real = os.open

    def refuse(path, flags, *args, **kw):
        if str(path).endswith(FILE_NAME):
            raise OSError(error, os.strerror(error), str(path))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)
    return tmp_path / "kv", {"read-only": "read-only", "permission": "permission denied"}[problem]


PROBLEMS = ["a file in the way", "a file above it", "the store file is a directory", "read-only", "permission"]


@pytest.mark.parametrize("problem", PROBLEMS)
def test_an_unusable_directory_is_a_startup_error_naming_path_and_reason(tmp_path, monkeypatch, problem):
    path, reason = path_problems(tmp_path, monkeypatch, problem)
    with pytest.raises(DiskTierError, match=reason) as err:
        DiskPageStore(path, num_slots=4, geometry=GEOMETRY).open()
    assert f"kv_disk_path={str(path)!r}" in str(err.value)


def test_a_read_only_file_system_is_a_startup_error(tmp_path, mount_tmpfs):
    ro = mount_tmpfs("ro", "ro,size=1m")
    with pytest.raises(DiskTierError, match="read-only"):
        DiskPageStore(ro / "kv", num_slots=4, geometry=GEOMETRY).open()
    with pytest.raises(DiskTierError, match="read-only"):
        DiskPageStore(ro, num_slots=4, geometry=GEOMETRY).open()


def test_the_engine_refuses_every_unusable_disk_tier(tiny_llama_dir, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="not a directory"):
        engine(tiny_llama_dir, kv_disk_path=str(tmp_path / "file"), kv_disk_gb=gib(8))
    with pytest.raises(DiskTierError, match="holds no page slot; one slot needs 4096 bytes"):
        engine(tiny_llama_dir, kv_disk_path=str(tmp_path / "small"), kv_disk_gb=gib(1) / 4)
    with pytest.raises(DiskTierError, match="kv_layout is 'contiguous'"):
        engine(tiny_llama_dir, kv_disk_path=str(tmp_path / "c"), kv_disk_gb=gib(8), kv_layout="contiguous")
    with pytest.raises(DiskTierError, match="enable_prefix_caching is False; the disk tier holds evicted prefix-cache "
                       "pages, so it needs enable_prefix_caching=True"):
        engine(tiny_llama_dir, kv_disk_path=str(tmp_path / "np"), kv_disk_gb=gib(8), enable_prefix_caching=False)
    assert not (tmp_path / "np").exists(), "refused before the store was made"
    from pagedrs.distributed import tp_executor

    def no_workers(*args, **kw):
        raise AssertionError("the refusal comes before any tensor-parallel worker starts")

    monkeypatch.setattr(tp_executor.TPExecutor, "__init__", no_workers)
    with pytest.raises(DiskTierError, match="tensor_parallel_size is 2; the disk tier needs tensor_parallel_size=1"):
        Engine(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, kv_disk_path=str(tmp_path / "tp")))
    store = DiskPageStore(tmp_path / "busy", num_slots=4, geometry=GEOMETRY)
    store.open()
    try:
        with pytest.raises(StoreBusyError, match="open in another engine"):
            engine(tiny_llama_dir, kv_disk_path=str(tmp_path / "busy"), kv_disk_gb=gib(8))
    finally:
        store.close()


@pytest.mark.parametrize("command", ["generate", "serve --engine-in-process", "serve"])
def test_the_clis_exit_2_naming_the_path_and_the_reason(tiny_llama_dir, tmp_path, capsys, command):
    """serve's default engine core runs in its own process: its startup error comes back too."""
    (tmp_path / "file").write_text("x")
    flags = ["--model", str(tiny_llama_dir), "--kv-disk-path", str(tmp_path / "file"), "--kv-disk-gb", "0.01"]
    if command == "generate":
        from pagedrs.cli import main

        code = main(["generate", "hello", "--max-tokens", "1", *flags])
    else:
        from pagedrs.server.cli import main

        code = main([*command.split()[1:], *flags])
    err = capsys.readouterr().err
    assert code == 2 and str(tmp_path / "file") in err and "not a directory" in err, err


@pytest.mark.parametrize("command", ["generate", "serve --engine-in-process", "serve"])
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_the_clis_refuse_a_tier_without_prefix_caching(tiny_llama_dir, tmp_path, capsys, command, tier):
    """--no-prefix-caching with --kv-disk-path or --kv-host-cache-gb: exit 2 naming the field (the tiers were
    accepted and never written)."""
    flags = ["--model", str(tiny_llama_dir), "--no-prefix-caching"]
    flags += ["--kv-disk-path", str(tmp_path / "d"), "--kv-disk-gb", "0.01"] if tier == "disk" else ["--kv-host-cache-gb", "0.01"]
    if command == "generate":
        from pagedrs.cli import main

        try:
            code = main(["generate", "hello", "--max-tokens", "1", *flags])
        except SystemExit as exc:  # a bad flag value: exit 2 before anything loads
            code = exc.code
    else:
        from pagedrs.server.cli import main

        code = main([*command.split()[1:], *flags])
    err = capsys.readouterr().err
    field = "kv_disk_path" if tier == "disk" else "kv_host_cache_gb"
    assert code == 2 and field in err and "enable_prefix_caching" in err, err


# ---- engine level: greedy output under each fault equals the no-disk run ---------------


class Watch:
    """Records what the engine does with the store (writes, reads, failures it was told of,
    reads that failed) and makes each step's writes land before the next step plans."""

    def __init__(self, eng: Engine) -> None:
        self.store: DiskPageStore = eng.executor._disk_store
        self.events: list[tuple[str, list[int]]] = []
        store, events = self.store, self.events
        write, read, take = store.write, store.read, store.take_failed_slots

        def watched_write(s, *rest):
            events.append(("write", s.tolist()))
            write(s, *rest)

        def watched_read(s):
            events.append(("read", s.tolist()))
            try:
                return read(s)
            except CorruptPageError as exc:
                events.append(("lost", exc.slots))
                raise

        def watched_take():
            failed = take()
            events.append(("lost", failed))
            return failed

        store.write, store.read, store.take_failed_slots = watched_write, watched_read, watched_take
        # the executor that runs the steps: with asynchronous scheduling the one the worker thread calls
        runs = eng.executor.inner if isinstance(eng.executor, AsyncExecution) else eng.executor
        execute = runs.execute

        def synced_execute(*args, **kw):
            try:
                return execute(*args, **kw)
            finally:
                store._writer.wait()

        runs.execute = synced_execute

    def lost(self) -> set[int]:
        return {s for kind, ss in self.events if kind == "lost" for s in ss}

    def check_lost_slots_are_never_read_again(self) -> None:
        """After the engine learns a slot is lost, it reads it only once it wrote a new page there."""
        lost: set[int] = set()
        for kind, ss in self.events:
            if kind == "lost":
                lost |= set(ss)
            elif kind == "write":
                lost -= set(ss)
            else:
                assert not lost & set(ss), f"slots {sorted(lost & set(ss))} were read after being reported lost"


def run_turn(eng: Engine, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, tuple[list[int], str]]:
    return {rid: (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            for rid, out in finished_outputs(eng, prompts, max_tokens).items()}


def finished_outputs(eng: Engine, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, Any]:
    """Each prompt as request r<i>, greedy, stepped to its end: its final RequestOutput by request id."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(max_tokens))
    done: dict[str, Any] = {}
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.scheduler.check_invariants()
    assert not eng.has_unfinished()
    return done


@pytest.fixture(scope="module")
def no_disk(tiny_llama_dir):
    """The prompts and the greedy tokens of three turns of them without a disk tier."""
    eng = engine(tiny_llama_dir)
    prompts = conversations(eng.loaded.config.vocab_size)
    turns = [{rid: tokens for rid, (tokens, _) in run_turn(eng, prompts).items()} for _ in range(3)]
    eng.shutdown()
    return prompts, turns


def core_disk_slots(eng: Engine) -> dict[int, int]:
    """slot -> page hash, of every slot in the core's disk index."""
    index = {}
    for s in range(eng.scheduler_config.num_disk_blocks):
        try:
            hashes, _, _ = eng.scheduler.disk_pages(slots(s))
        except ValueError:
            continue
        index[s] = int(hashes[0])
    return index


def check_never_wrong(eng: Engine, watch: Watch, prompts, reference, turns: int = 2, between=None,
                      damaged: AbstractSet[int] = frozenset()) -> dict:
    """Greedy outputs equal the no-disk run's, no request errs, no slot is read once reported lost,
    and every slot the core still indexes holds its page (but those in damaged, which the test
    corrupted behind the store's back and which no read has come to yet)."""
    for t in range(turns):
        if between is not None:
            between(t)
        done = run_turn(eng, prompts)
        errors = {rid: reason for rid, (_, reason) in done.items() if reason == "error"}
        assert not errors, f"turn {t}: requests ended with an error: {errors}"
        for rid, (tokens, _) in done.items():
            assert tokens == reference[t][rid], f"turn {t}, {rid}: the disk tier changed a greedy output"
    watch.store.flush()
    watch.check_lost_slots_are_never_read_again()
    for slot, page_hash in core_disk_slots(eng).items():  # every page the core counts on is there, and is its page
        meta = watch.store.slot_meta(slot)
        assert slot in damaged or meta is not None and meta.page_hash == page_hash, (
            f"slot {slot} does not hold the core's page")
    stats = eng.stats()
    dropped = {k: v for k, v in stats.items() if "disk" in k and any(w in k for w in ("invalid", "drop", "lost", "fail"))}
    assert sum(dropped.values()) > 0, f"engine.stats() shows no disk page dropped: {dropped}"
    return stats


def disk_engine(model_dir, path, **kw) -> Engine:
    return engine(model_dir, kv_disk_path=str(path), kv_disk_gb=gib(400), **kw)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_disk_that_fills_while_serving_loses_pages_never_outputs(tiny_llama_dir, tmp_path, monkeypatch, no_disk, async_scheduling):
    """Injected: after 24 pages the disk is full, for every write that follows (always runs)."""
    prompts, reference = no_disk
    eng = disk_engine(tiny_llama_dir, tmp_path, async_scheduling=async_scheduling)
    watch = Watch(eng)
    written = {"records": 0}

    def rule(slot, inside, n):
        if n == len(b"PGSL"):
            return "nothing"
        written["records"] += 1
        return None if written["records"] <= 24 else "nothing"

    inject(monkeypatch, watch.store, rule)
    stats = check_never_wrong(eng, watch, prompts, reference)
    assert watch.lost() and stats["prefix_hits_disk"] > 0, "some pages were lost, the written ones still hit"
    eng.shutdown()


def test_a_small_tmpfs_that_fills_while_serving_loses_pages_never_outputs(tiny_llama_dir, mount_tmpfs, monkeypatch,
                                                                          no_disk):
    """A real full disk: a sparse store (fallocate unsupported) on an 8 MiB tmpfs that a
    file fills up to room for 20 pages after the engine started."""
    prompts, reference = no_disk
    disk = mount_tmpfs("fills", "size=8m")

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    eng = disk_engine(tiny_llama_dir, disk / "kv")
    monkeypatch.undo()
    watch = Watch(eng)
    vfs = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(bytes(vfs.f_bavail * vfs.f_frsize - 20 * watch.store.slot_bytes))
    check_never_wrong(eng, watch, prompts, reference)
    assert watch.lost() and watch.store.failed_writes > 0
    eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pages_corrupted_on_disk_are_recomputed_and_never_hit_again(tiny_llama_dir, tmp_path, no_disk, async_scheduling):
    prompts, reference = no_disk
    eng = disk_engine(tiny_llama_dir, tmp_path, async_scheduling=async_scheduling)
    watch = Watch(eng)
    store = watch.store

    damaged: set[int] = set()

    def corrupt_every_other_page(turn: int) -> None:
        if turn != 1:
            return
        store.flush()
        damaged.update([s for s in range(store.num_slots) if store.slot_meta(s) is not None][::2])
        assert damaged, "the first turn wrote pages to disk"
        for s in damaged:
            flip(store.path, HEADER_BYTES + s * store.slot_bytes + store.meta_bytes + 5)

    check_never_wrong(eng, watch, prompts, reference, turns=3, between=corrupt_every_other_page, damaged=damaged)
    assert watch.lost() and watch.lost() <= damaged, "corrupted pages were read (and recomputed), no other was lost"
    eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_disk_pages_that_fail_their_check_are_not_counted_as_cached(tiny_llama_dir, tmp_path, no_disk, async_scheduling):
    """Every page on disk corrupted: each request whose admission found disk pages fails its step and is
    recomputed; its cached_tokens said the disk served them (issue: cached_tokens_by_tier {'disk': 96})."""
    prompts, reference = no_disk
    eng = disk_engine(tiny_llama_dir, tmp_path, async_scheduling=async_scheduling)
    store = eng.executor._disk_store
    run_turn(eng, prompts)
    store.flush()
    written = [s for s in range(store.num_slots) if store.slot_meta(s) is not None]
    assert written, "the first turn pushed pages to disk"
    for s in written:
        flip(store.path, HEADER_BYTES + s * store.slot_bytes + store.meta_bytes + 5)
    before = eng.stats()
    done = finished_outputs(eng, prompts)
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == reference[1]
    after = eng.stats()
    failed, lost = (after[k] - before[k] for k in ("num_failed_steps", "disk_pages_invalidated"))
    assert failed > 0 and lost > 0
    served = after["prefix_hits_disk"] - before["prefix_hits_disk"] - lost  # hits counted at lookup, lost ones too
    for rid, out in done.items():
        by_tier = out.cached_tokens_by_tier
        assert by_tier is None or sum(by_tier.values()) == out.num_cached_tokens, (rid, by_tier)
    said = sum(out.cached_tokens_by_tier["disk"] for out in done.values() if out.cached_tokens_by_tier is not None)
    # a re-admission whose total differs from the first's has no split (None): its disk hits go unsaid
    assert said <= served * BLOCK, {rid: (out.num_cached_tokens, out.cached_tokens_by_tier) for rid, out in done.items()}
    eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_writes_that_fail_mid_page_lose_pages_never_outputs(tiny_llama_dir, tmp_path, monkeypatch, no_disk, async_scheduling):
    """Every third page write stops half way with ENOSPC, and zeroing its magic fails too."""
    prompts, reference = no_disk
    eng = disk_engine(tiny_llama_dir, tmp_path, async_scheduling=async_scheduling)
    watch = Watch(eng)
    count = {"records": 0}

    def rule(slot, inside, n):
        if n == len(b"PGSL"):
            return "nothing"
        count["records"] += 1
        return "half" if count["records"] % 3 == 0 else None

    inject(monkeypatch, watch.store, rule)
    stats = check_never_wrong(eng, watch, prompts, reference, turns=3)
    assert watch.lost() and stats["prefix_hits_disk"] > 0
    eng.shutdown()
