"""``pagedrs cache`` (models/gguf_cache_admin.py): what the GGUF cache holds, and pruning only what this
version never reads."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from pagedrs.cli import main
from pagedrs.models import gguf_cache
from pagedrs.models.gguf_cache_admin import STALE_STAGING_S, MemoUnreadableError, entries, prune

V = gguf_cache._CONVERTED_FORMAT


def _folder(root: Path, name: str, files: dict[str, int]) -> Path:
    folder = root / "gguf" / name
    for rel, size in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(b"x" * size)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> dict[str, Path]:
    """A cache with: the current folder of a file that exists (with a float32 copy and a kept conversion),
    an older format's folder of it, a current folder whose file is gone, a stale and a young staging
    folder; the memo maps the live file, a moved one and a rewritten one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(root))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 10)
    rewritten = tmp_path / "rewritten.gguf"
    rewritten.write_bytes(b"old")
    stat, old_stat = gguf.stat(), rewritten.stat()
    memo = {gguf_cache.memo_key(gguf, stat): "aa",
            f"{tmp_path / 'moved.gguf'}|10|1|1|1:1": "bb",
            gguf_cache.memo_key(rewritten, old_stat): "cc"}
    rewritten.write_bytes(b"new content")  # its memo entry no longer describes it
    (root).mkdir(parents=True)
    (root / "hashes.json").write_text(json.dumps(memo))
    folders = {
        "live": _folder(root, f"aa-v{V}", {"config.json": 100, "gguf_index.json": 50, gguf_cache._DENSE: 4000,
                                            "converted/w.Q8_0": 300}),
        "older": _folder(root, f"aa-v{V - 1}", {"config.json": 100, gguf_cache._DENSE: 2000}),
        "orphan": _folder(root, f"bb-v{V}", {"config.json": 100, "gguf_index.json": 50}),
        "stale": _folder(root, ".convert-old", {"config.json": 10}),
        "young": _folder(root, ".convert-new", {"config.json": 10}),
        "unknown": _folder(root, "notes", {"readme.txt": 5}),  # not a name the cache writes
        "newer": _folder(root, f"aa-v{V + 1}", {"config.json": 7}),  # a newer pagedrs's: not ours to remove
    }
    day_ago = time.time() - STALE_STAGING_S - 60
    os.utime(folders["stale"], (day_ago, day_ago))
    return {**folders, "file": gguf}


def test_entries_say_what_each_folder_holds_and_whose_it_is(cache):
    got = {e.path.name: e for e in entries()}
    assert set(got) == {f"aa-v{V}", f"aa-v{V - 1}", f"aa-v{V + 1}", f"bb-v{V}", "notes"}  # no staging folders
    assert got["notes"].version is None and not got["notes"].current
    live = got[f"aa-v{V}"]
    assert (live.current, live.bytes, live.dense_bytes, live.converted_bytes) == (True, 4450, 4000, 300)
    assert live.sources == [str(cache["file"].resolve())]
    assert not got[f"aa-v{V - 1}"].current and got[f"aa-v{V - 1}"].sources == [str(cache["file"].resolve())]
    assert got[f"bb-v{V}"].sources == []  # its file moved: the memo entry no longer matches
    assert [e.path.name for e in entries()][0] == f"aa-v{V}"  # largest first


def test_prune_removes_only_what_this_version_never_reads(cache):
    pruned = prune()
    assert sorted(p.name for p in pruned.removed) == sorted([f"aa-v{V - 1}", ".convert-old"])
    assert pruned.freed_bytes == 2100 + 10
    assert cache["live"].is_dir() and (cache["live"] / gguf_cache._DENSE).is_file()  # a warm load's folder stays
    assert cache["orphan"].is_dir() and cache["young"].is_dir()  # (a conversion may be writing this one now)
    assert cache["unknown"].is_dir() and cache["newer"].is_dir()
    assert pruned.memo_entries_dropped == 2  # the moved file's and the rewritten file's
    memo = json.loads((gguf_cache.cache_root() / "hashes.json").read_text())
    assert list(memo.values()) == ["aa"]
    assert prune().removed == [] and prune().memo_entries_dropped == 0  # nothing more to do


def test_drop_dense_and_orphans_go_further_when_asked(cache):
    pruned = prune(drop_dense=True, orphans=True)
    names = {str(p.relative_to(gguf_cache.cache_root() / "gguf")) for p in pruned.removed}
    assert names == {f"aa-v{V - 1}", ".convert-old", f"aa-v{V}/{gguf_cache._DENSE}", f"bb-v{V}"}
    assert (cache["live"] / "converted" / "w.Q8_0").is_file() and (cache["live"] / "gguf_index.json").is_file()


def test_the_cli_prints_the_cache_and_prunes(cache, capsys):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert f"aa-v{V - 1}" in out and "an older format: removed by --prune" in out and str(cache["file"].resolve()) in out
    assert "a newer version's: left alone" in out and "not a cache folder: left alone" in out
    assert main(["cache", "--prune"]) == 0
    out = capsys.readouterr().out
    assert "freed 0.0 MiB" in out and f"removed {cache['older']}" in out and f"aa-v{V - 1}" not in out.split("freed")[1]


def test_an_empty_or_missing_cache_is_reported_as_such(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "nothing"))
    assert entries() == [] and prune().removed == []
    assert main(["cache"]) == 0
    assert "(empty)" in capsys.readouterr().out
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(a_file))  # a typo listed as "(empty)" before
    assert main(["cache", "--prune"]) == 2
    assert "is not a directory" in capsys.readouterr().err and a_file.read_text() == "x"


def test_a_memo_that_cannot_be_rewritten_is_an_error_naming_it(cache, monkeypatch, capsys):
    from pagedrs.models import gguf_cache_admin

    def refuse(path, text):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_cache_admin, "_atomic_write_text", refuse)
    assert main(["cache", "--prune"]) == 1
    err = capsys.readouterr().err
    assert "hashes.json could not be rewritten (Permission denied); 2 paths were removed before" in err


def test_a_prune_cut_short_is_finished_by_the_next_and_leaves_no_half_folder(cache, monkeypatch):
    """A folder is renamed out of the loaders' sight before it is deleted: a prune stopped inside the delete
    leaves a ``.prune-*`` folder (never a half-deleted ``<sha>-v<N>`` a load would trust), which the next
    prune removes."""
    from pagedrs.models import gguf_cache_admin

    real_shutil_rmtree = gguf_cache_admin.shutil.rmtree

    root = str(gguf_cache.cache_root())

    def stopped(path, *args, **kwargs):
        if str(path).startswith(root):
            raise KeyboardInterrupt  # a signal in the middle of the delete
        return real_shutil_rmtree(path, *args, **kwargs)  # (anyone else's: pytest's own clean-up)

    monkeypatch.setattr(gguf_cache_admin.shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        prune()
    left = sorted(p.name for p in (gguf_cache.cache_root() / "gguf").iterdir())
    assert ".convert-old" not in left and ".prune-convert-old" in left  # the first folder it took, moved whole
    monkeypatch.setattr(gguf_cache_admin.shutil, "rmtree", real_shutil_rmtree)
    prune()
    left = sorted(p.name for p in (gguf_cache.cache_root() / "gguf").iterdir())
    assert not [n for n in left if n.startswith(".prune-")] and f"aa-v{V - 1}" not in left and f"aa-v{V}" in left


def test_a_hash_memo_that_is_not_utf8_json_is_rebuilt_not_fatal(cache, capsys):
    """``hashes.json`` spoiled (bytes that are not UTF-8): hashing a file (every GGUF load) starts a new memo
    instead of raising, and ``pagedrs cache`` lists the folders with no file known."""
    memo = gguf_cache.cache_root() / "hashes.json"
    memo.write_bytes(b"\xff\xfe{not json")
    assert main(["cache"]) == 0 and "(no file known)" in capsys.readouterr().out
    sha = gguf_cache.file_sha256(cache["file"])
    assert json.loads(memo.read_text()) == {gguf_cache.memo_key(cache["file"], cache["file"].stat()): sha}


def test_a_linked_folder_is_never_followed_or_removed(cache, tmp_path):
    """An older format's folder that is a link to another disk: prune leaves the link and what it points to."""
    elsewhere = tmp_path / "other_disk" / "kept"
    elsewhere.mkdir(parents=True)
    (elsewhere / "config.json").write_text("{}")
    link = gguf_cache.cache_root() / "gguf" / f"cc-v{V - 1}"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert link not in prune(orphans=True).removed
    assert link.is_symlink() and (elsewhere / "config.json").is_file()


def test_a_file_rewritten_in_place_with_its_size_and_mtime_kept_is_hashed_again(tmp_path, monkeypatch):
    """``cp -p other.gguf model.gguf`` (or a sync tool keeping times): same path, same size (Q4_0 and IQ4_NL
    of one model both store 4.5 bits a weight), the same mtime put back. The memo keyed by path, size and
    mtime alone sent the load to the old file's conversion: another model, served without a word. The
    ctime (no user call sets it) and the inode are in the key now."""
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + b"a" * 60)
    first = gguf_cache.file_sha256(f)
    before = f.stat()
    time.sleep(0.01)
    f.write_bytes(b"GGUF" + b"b" * 60)  # the same size
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the old mtime back
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = gguf_cache.file_sha256(f)
    assert second != first and second == hashlib.sha256(f.read_bytes()).hexdigest()


def test_the_listing_says_what_prune_does_to_each_folder(cache, tmp_path, capsys):
    """A newer version's folder of a file no longer known was listed "left alone" but went with --orphans;
    a link (to another disk) was listed as an older format "removed by --prune" and sized through the link,
    but kept. Now each line's state is what the prune does, and a link is never sized or entered."""
    elsewhere = tmp_path / "other_disk"
    elsewhere.mkdir()
    (elsewhere / "weights").write_bytes(b"w" * 5000)
    gguf = gguf_cache.cache_root() / "gguf"
    (gguf / "cccc-v1").symlink_to(elsewhere, target_is_directory=True)
    (gguf / f"dd-v{V}").symlink_to(elsewhere, target_is_directory=True)
    _folder(gguf_cache.cache_root(), "bbbb-v999", {"f": 2})
    got = {e.path.name: e for e in entries()}
    assert (got["cccc-v1"].bytes, got["cccc-v1"].link, got["cccc-v1"].current) == (0, str(elsewhere), False)
    assert main(["cache"]) == 0
    lines = {line.split()[2]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert f"[a link to {elsewhere}: not followed, left alone]" in lines["cccc-v1"] and "0.0 MiB" in lines["cccc-v1"]
    assert "[a newer version's: left alone]" in lines["bbbb-v999"]
    assert "[current, its file unknown: removed by --orphans]" in lines[f"bb-v{V}"]
    will_go = sorted(name for name, line in lines.items() if "removed by" in line)
    assert will_go == sorted([f"aa-v{V - 1}", f"bb-v{V}"])
    pruned = prune(orphans=True)
    assert sorted(p.name for p in pruned.removed if p.name != ".convert-old") == will_go
    assert (gguf / "bbbb-v999" / "f").is_file() and (gguf / "cccc-v1").is_symlink() and (gguf / f"dd-v{V}").is_symlink()
    assert (elsewhere / "weights").read_bytes() == b"w" * 5000


@pytest.mark.parametrize("spoiled", [b"\xff\xfe{not json", b"[1, 2]", b'{"cut short'])
def test_orphans_are_refused_when_the_memo_cannot_be_read(cache, capsys, spoiled):
    """An unreadable hashes.json knows no file: --orphans took every folder for an orphan, silently."""
    memo = gguf_cache.cache_root() / "hashes.json"
    memo.write_bytes(spoiled)
    assert main(["cache"]) == 0
    assert f"warning: {memo}" in capsys.readouterr().err
    before = sorted(p.name for p in (gguf_cache.cache_root() / "gguf").iterdir())
    assert main(["cache", "--prune", "--orphans"]) == 2
    err = capsys.readouterr().err
    assert f"error: --orphans needs the hash memo to tell which folders are in use, but {memo}" in err
    assert "nothing was removed" in err
    assert sorted(p.name for p in (gguf_cache.cache_root() / "gguf").iterdir()) == before
    with pytest.raises(MemoUnreadableError):
        prune(orphans=True)
    assert sorted(p.name for p in prune().removed) == sorted([f"aa-v{V - 1}", ".convert-old"])  # no memo needed
