"""What the GGUF cache holds, and pruning what no load of this version can read (``pagedrs cache``).

Why: the cache (``gguf_cache``: ``$PAGEDRS_CACHE_DIR/gguf/<sha256>-v<format>/``) only grows. A format
bump leaves every older folder behind, unreadable by this version; a dense load (``weight_dtype=
"float32"``, transformers as the benchmarks' referee) writes ``model.safetensors``, 4 bytes a weight
(about 32 GB for an 8B model), kept for the next dense load; a conversion killed mid-way leaves its
staging folder; the hash memo keeps entries for files long moved or rewritten. Nothing told a user
where their disk went.

Pruning removes only what this version never reads: folders of an older format (an older pagedrs
running beside this one would convert its file again; a newer version's folders are left alone), staging folders older than a day (a live
conversion's is younger), hash-memo entries whose file is gone or changed.
``drop_dense`` also removes the float32 copies (the next dense load writes its own again), ``orphans``
the folders of files no longer where the memo saw them (a load converts again: work, never a wrong
answer, since a folder is keyed by the file's content). The
current format's folders, their tokenizer and index, and kept conversions stay: they are what a
warm load reads; a folder that is a link (to another disk) is never followed (not for its size
either) or removed. The listing (``report``) says of each folder what a prune does to it, and
``prune`` does exactly that. ``orphans`` needs the hash memo: when ``hashes.json`` cannot be read,
it is refused (``MemoUnreadableError``) rather than taking every folder for an orphan.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedrs.models.gguf_cache import (
    _CONVERTED_FORMAT,
    _DENSE,
    _atomic_write_text,
    cache_root,
    memo_key,
    memo_path,
    read_memo_checked,
)

STALE_STAGING_S = 24 * 3600  # a staging folder this old belongs to no conversion still running


@dataclass
class CacheEntry:
    """One converted folder of the cache."""

    path: Path
    sha256: str
    version: int | None  # the folder's format; None: a name this version does not know
    bytes: int  # everything under the folder
    dense_bytes: int  # model.safetensors (float32 weights), 0 when absent
    converted_bytes: int  # converted/ (kept conversions)
    sources: list[str] = field(default_factory=list)  # GGUF files the hash memo maps to it, that still match
    link: str | None = None  # where the folder links to, when it is a symbolic link (never followed: sizes 0)

    @property
    def current(self) -> bool:
        return self.link is None and self.version == _CONVERTED_FORMAT


class MemoUnreadableError(Exception):
    """``prune(orphans=True)`` over a hash memo that cannot be read: which folders are in use is unknown."""


def _size(path: Path) -> int:
    if path.is_symlink():  # someone else's: never followed
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _still_matches(key: str) -> bool:
    """Whether a memo key still describes the file at its path (``gguf_cache.memo_key``)."""
    name = memo_path(key)
    try:
        return memo_key(Path(name), Path(name).stat()) == key
    except OSError:
        return False


def _live_memo() -> tuple[dict[str, str], dict[str, str], str | None]:
    """The hash memo, its entries that still describe their files, and why it could not be read (or None)."""
    memo, problem = read_memo_checked()
    return memo, {key: str(sha) for key, sha in memo.items() if _still_matches(key)}, problem


def memo_problem() -> str | None:
    """Why the hash memo cannot be read (so no folder's file is known), or None."""
    return read_memo_checked()[1]


def _name(folder: Path) -> tuple[str, int | None]:
    """A cache folder's (sha, format) from its ``<sha>-v<format>`` name; format None for any other name."""
    sha, _, tag = folder.name.rpartition("-v")
    if folder.name.startswith(".") or not sha or not tag.isdigit():
        return folder.name, None
    return sha, int(tag)


def entries() -> list[CacheEntry]:
    """Every converted folder under the cache root, largest first (staging folders left out)."""
    root = cache_root() / "gguf"
    if not root.is_dir():
        return []
    by_sha: dict[str, list[str]] = {}
    for key, sha in _live_memo()[1].items():
        by_sha.setdefault(sha, []).append(memo_path(key))
    out = []
    for folder in root.iterdir():
        if folder.name.startswith("."):
            continue
        sha, version = _name(folder)
        if folder.is_symlink():  # listed as a link, never sized through it
            out.append(CacheEntry(folder, sha, version, 0, 0, 0, link=os.readlink(folder)))
            continue
        if not folder.is_dir():
            continue
        out.append(CacheEntry(folder, sha, version, _size(folder),
                              _size(folder / _DENSE) if (folder / _DENSE).is_file() else 0,
                              _size(folder / "converted") if (folder / "converted").is_dir() else 0,
                              sorted(by_sha.get(sha, []))))
    return sorted(out, key=lambda e: e.bytes, reverse=True)


@dataclass
class Pruned:
    removed: list[Path]
    freed_bytes: int
    memo_entries_dropped: int


def prune(drop_dense: bool = False, orphans: bool = False, now: float | None = None) -> Pruned:
    """Removes what this version never reads (see the module docs); with ``drop_dense`` the float32
    copies too; with ``orphans`` the folders no GGUF file known to the hash memo maps to any more (a
    file deleted, moved or rewritten: a load of it converts again). Returns what went and the bytes freed.
    MemoUnreadableError, before anything is removed, for ``orphans`` over a memo that cannot be read."""
    root = cache_root() / "gguf"
    removed: list[Path] = []
    freed = 0
    now = time.time() if now is None else now
    memo, live, problem = _live_memo()
    if orphans and problem is not None:
        raise MemoUnreadableError(f"--orphans needs the hash memo to tell which folders are in use, but {problem}; "
                                  "nothing was removed (loading a GGUF file writes a new memo)")
    known = set(live.values())
    if root.is_dir():
        for folder in sorted(root.iterdir()):
            if not folder.is_dir() or folder.is_symlink():  # a link someone made (to another disk): theirs
                continue
            sha, version = _name(folder)  # any other name is not ours to judge: left alone
            if folder.name.startswith(".prune-"):  # a prune cut short (renamed, then stopped): finish it
                shutil.rmtree(folder, ignore_errors=True)
            elif ((folder.name.startswith(".convert-") and now - folder.stat().st_mtime > STALE_STAGING_S)
                  or (version is not None and version < _CONVERTED_FORMAT)  # (a newer version's is left to it)
                  or (orphans and version == _CONVERTED_FORMAT and sha not in known)):  # (as report says)
                size = _size(folder)
                if _remove(folder):
                    removed.append(folder)
                    freed += size
            elif drop_dense and (folder / _DENSE).is_file():
                size = _size(folder / _DENSE)
                (folder / _DENSE).unlink(missing_ok=True)
                removed.append(folder / _DENSE)
                freed += size
    if len(live) != len(memo):
        try:
            _atomic_write_text(cache_root() / "hashes.json", json.dumps(live))
        except OSError as e:  # a read-only cache: the folders above went (or not), the memo stays as it was
            raise OSError(e.errno, f"the hash memo {cache_root() / 'hashes.json'} could not be rewritten "
                                   f"({e.strerror}); {len(removed)} paths were removed before") from e
    return Pruned(removed, freed, len(memo) - len(live))


def _remove(folder: Path) -> bool:
    """Renames ``folder`` out of the loaders' sight (``.prune-<name>``, one atomic step), then deletes it: a
    prune stopped midway (a signal, a full disk) never leaves a half-deleted folder under a name a load
    trusts, and the next prune finishes it. False when the rename fails (a folder not ours to move)."""
    trash = folder.with_name(f".prune-{folder.name.lstrip('.')}")
    try:
        folder.rename(trash)
    except OSError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def report(items: list[CacheEntry]) -> str:
    """``pagedrs cache``'s table."""
    mb = 2**20
    lines = [f"GGUF cache: {cache_root() / 'gguf'} (this version reads format v{_CONVERTED_FORMAT})"]
    if not items:
        return lines[0] + "\n(empty)"
    for e in items:
        state = (f"a link to {e.link}: not followed, left alone" if e.link is not None
                 else "current, its file unknown: removed by --orphans" if e.current and not e.sources
                 else "current" if e.current else "not a cache folder: left alone" if e.version is None
                 else "an older format: removed by --prune" if e.version < _CONVERTED_FORMAT
                 else "a newer version's: left alone")
        lines.append(f"{e.bytes / mb:9.1f} MiB  {e.path.name}  [{state}]  float32 copy {e.dense_bytes / mb:.1f} MiB, "
                     f"conversions {e.converted_bytes / mb:.1f} MiB  <- {', '.join(e.sources) or '(no file known)'}")
    lines.append(f"{sum(e.bytes for e in items) / mb:9.1f} MiB in all")
    return "\n".join(lines)
