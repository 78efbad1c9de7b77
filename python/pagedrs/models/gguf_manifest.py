"""The manifest of a converted GGUF folder: each file the conversion wrote, its size and SHA-256, checked
before a load reads the folder.

Why: the folder is keyed by the GGUF file's content hash and written atomically, but nothing kept it
whole afterwards: a file cut short or overwritten, one flipped byte (a NaN weight, or a finite wrong one
that no later check can see), a stray shard or index that ``read_safetensors_folder`` would read too.
Such a folder loaded without a word. Now ``gguf_cache`` reads a folder only when ``problems`` finds
nothing: every listed file there with its size and hash, no unlisted file a loader could read, the
manifest made for a GGUF file of this size; otherwise it converts again, saying why.

``manifest.json`` = ``{"source_bytes": <the GGUF file's size>, "files": {name: {"bytes": n, "sha256":
hex}}}``, written last into the staging folder (so a folder renamed into place has one) and replaced
atomically. The float32 weights (``model.safetensors``) are written later, on the first dense load, and
join it after they are renamed into place: until then, or when that update failed, they are not
trusted and the next dense load writes them again. They may also be gone (``pagedrs cache --prune
--drop-dense``): that is no damage, only a later write.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
DENSE = "model.safetensors"  # every tensor in float32, for the dense formats and transformers


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``, read in chunks."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of the file at ``path``."""
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def _listed(folder: Path) -> list[Path]:
    """The files a manifest lists: every regular top-level file but the manifest and hidden ones (a
    writer's temporary files); ``converted/`` keeps its own checksums."""
    return sorted(f for f in folder.iterdir() if f.is_file() and not f.is_symlink() and not f.name.startswith(".")
                  and f.name != MANIFEST)


def seal(folder: Path, source_bytes: int, write_text: Any) -> None:
    """Writes ``folder``'s manifest of every file in it now, with ``write_text(path, text)`` (atomic)."""
    files = {f.name: file_entry(f) for f in _listed(folder)}
    write_text(folder / MANIFEST, json.dumps({"source_bytes": source_bytes, "files": files}, indent=1))


def read(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None when it is missing or not one (cut short, not JSON, wrong fields)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(manifest.get("source_bytes"), int):
        return None
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            return None
        if Path(name).name != name or name in ("", ".", ".."):  # a file of this folder, never a path out of it:
            return None  # "/dev/zero" or "../x" would be hashed wherever it led (the first for ever)
    return manifest


def _mismatch(path: Path, entry: dict[str, Any]) -> str | None:
    """Why the file at ``path`` is not the one ``entry`` describes, or None when it is."""
    try:
        size = path.stat().st_size
    except OSError:
        return f"{path.name} is missing"
    if size != entry["bytes"]:
        return f"{path.name} has {size} bytes, not the {entry['bytes']} written"
    if file_entry(path)["sha256"] != entry["sha256"]:
        return f"{path.name} does not have the content written (its SHA-256 differs)"
    return None


def problems(folder: Path, source_bytes: int) -> list[str]:
    """What makes ``folder`` untrustworthy, apart from its float32 weights (``dense_problem``); [] when
    nothing does."""
    manifest = read(folder)
    if manifest is None:
        return [f"{MANIFEST} is missing or unreadable"]
    found: list[str] = []
    if manifest["source_bytes"] != source_bytes:
        found.append(f"it was made from a file of {manifest['source_bytes']} bytes, this one has {source_bytes}")
    files = manifest["files"]
    for name, entry in files.items():
        if name != DENSE and (why := _mismatch(folder / name, entry)) is not None:
            found.append(why)
    found += [f"{f.name} is not a file the conversion wrote" for f in _listed(folder) if f.name not in files
              and f.name != DENSE]
    return found


def dense_problem(folder: Path) -> str | None:
    """Why the folder's float32 weights cannot be read (absent, not recorded, not as recorded), or None."""
    manifest = read(folder)
    entry = manifest["files"].get(DENSE) if manifest is not None else None
    if entry is None:
        return f"{DENSE} is not recorded in {MANIFEST}" if (folder / DENSE).exists() else f"{DENSE} is absent"
    return _mismatch(folder / DENSE, entry)


def record(folder: Path, name: str, write_text: Any) -> None:
    """Adds (or replaces) ``name``'s entry in the folder's manifest, with ``write_text`` (atomic)."""
    manifest = read(folder)
    if manifest is None:
        raise ValueError(f"{folder / MANIFEST} is missing or unreadable")
    manifest["files"][name] = file_entry(folder / name)
    write_text(folder / MANIFEST, json.dumps(manifest, indent=1))
