"""The converted folder of a GGUF file in the cache: config, tokenizer and tensor index (always), float32
weights (for dense loads), converted blocks (``ConvertedBlocks``).

Parsing a GGUF (gguf-py reads a tokenizer's strings one by one) and building its tokenizer take
seconds, so the result is written once under ``$PAGEDRS_CACHE_DIR`` (default ``~/.cache/pagedrs``) in
``gguf/<sha256 of the file's content>-v<format>/``, and every later load reads that folder. The hash
of a file is remembered by (path, size, mtime) so a warm load does not re-read the whole file. Every
file is written under a temporary name and renamed into place, so no reader sees half of one; a cache
that cannot be written is refused naming the folder and ``PAGEDRS_CACHE_DIR``. A folder is read only
when its manifest (``gguf_manifest``: each file's size and SHA-256) holds; a damaged one is set aside
and converted again, with a warning naming what was wrong. Reading the GGUF itself is ``gguf_loader``'s.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pagedrs.models.gguf_loader import (
    _INDEX,
    _tensor_index,
    gguf_checkpoint_shapes,
    gguf_config,
    gguf_tensors,
    open_gguf,
    tensor_index,
)
from pagedrs.models.gguf_manifest import DENSE, dense_problem, problems, record, seal, sha256_of

logger = logging.getLogger("pagedrs.engine")

# bump when the cached folder's contents change meaning, or gguf_convert's conversions change their bytes (2:
# gguf_index.json; 3: float32 weights written only for a dense load, converted blocks kept; 4: manifest.json,
# and folders converted with the finiteness and structure checks: a v3 folder may hold a NaN weight or an
# index those checks refuse, written before they existed)
_CONVERTED_FORMAT = 4
_DENSE = DENSE
_UNWRITABLE = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)  # a cache that cannot be written


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDRS_CACHE_DIR", Path.home() / ".cache" / "pagedrs"))


def memo_key(path: Path, stat: os.stat_result) -> str:
    """The hash memo's key of a file: ``resolved path|size|mtime_ns|ctime_ns|device:inode``. A file rewritten
    gets a new key: its contents' hash is read again. Why ctime and the inode too: ``cp -p other.gguf
    model.gguf`` (or a sync tool that keeps times) rewrites a file in place with the other's mtime, and two
    quantizations of one model can have the same size (Q4_0 and IQ4_NL both store 4.5 bits a weight), so
    path, size and mtime alone could send a load to the old file's conversion: another model, served
    without a word. No user call sets ctime; a replaced file has another inode."""
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_dev}:{stat.st_ino}"


def memo_path(key: str) -> str:
    """The file path a memo key names (``memo_key``'s first field)."""
    return key.rsplit("|", 4)[0]


def read_memo() -> dict[str, str]:
    """The cache's hash memo (``hashes.json``: memo key -> content hash); empty when missing or unreadable
    (cut short, not JSON, not UTF-8, not an object): it is only a saving, rebuilt as files are hashed."""
    return read_memo_checked()[0]


def read_memo_checked() -> tuple[dict[str, str], str | None]:
    """``read_memo``, and why the memo could not be read (None when it was, or is missing): ``pagedrs cache
    --orphans`` must not take an unreadable memo for one that knows no file."""
    path = cache_root() / "hashes.json"
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return {}, f"{path} cannot be read ({e})"
    if not isinstance(memo, dict):
        return {}, f"{path} holds a JSON {type(memo).__name__}, not an object of file -> hash"
    return memo, None


def file_sha256(path: Path) -> str:
    """Content hash, memoized by ``memo_key`` (path, size, times, inode) in the cache's hashes.json."""
    memo_file = cache_root() / "hashes.json"
    key = memo_key(path, path.stat())
    memo = read_memo()
    if key in memo:
        return str(memo[key])
    memo[key] = sha256_of(path)
    try:
        _atomic_write_text(memo_file, json.dumps(memo))
    except OSError as e:  # only the saving is lost: the next load hashes the file again
        logger.warning("the hash of %s was not remembered in %s (%s)", path, memo_file, e)
    return memo[key]


def convert_gguf_cached(path: Path, *, dense_weights: bool = False) -> Path:
    """The cached converted folder for this GGUF file (config.json, tokenizer files, gguf_index.json),
    converting it on the first call; with ``dense_weights`` it also holds ``model.safetensors``, every
    tensor dequantized to float32 (written on the first call that asks).

    Why the weights are optional: a load in the file's own blocks (``weight_dtype="gguf"``, what ``auto``
    picks for a quantized GGUF on a CPU) reads the blocks from the file itself and never needs a float32
    copy, which takes 4 bytes a weight on disk (about 32 GB for an 8B model). The dense formats, and
    transformers reading the same weights (the benchmarks' referee), do."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    target = cache_root() / "gguf" / f"{file_sha256(path)}-v{_CONVERTED_FORMAT}"
    source_bytes = path.stat().st_size
    try:
        if target.is_dir() and (damage := problems(target, source_bytes)):
            _set_aside(target, damage)
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
            try:
                convert_gguf(path, staging)
                seal(staging, source_bytes, _atomic_write_text)  # last: a folder without it is never read
                try:
                    staging.rename(target)  # atomic: a concurrent converter may have won, which is fine
                except OSError:
                    if not target.is_dir() or problems(target, source_bytes):
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if dense_weights and (why := dense_problem(target)) is not None:
            if (target / _DENSE).exists():
                logger.warning("%s: %s; writing the float32 weights again", target, why)
            _write_dense_weights(path, target)
            try:
                record(target, _DENSE, _atomic_write_text)
            except OSError as e:  # the weights are whole (renamed into place): this load reads them
                if e.errno not in _UNWRITABLE:
                    raise
                logger.warning("%s could not be recorded in the manifest of %s (%s); the next dense load writes "
                               "it again", _DENSE, target, e.strerror)
    except _Damaged:
        raise
    except OSError as e:
        if e.errno not in _UNWRITABLE:
            raise
        raise OSError(e.errno, f"cannot write the converted GGUF folder under {str(cache_root())!r} ({e.strerror}); "
                      "set PAGEDRS_CACHE_DIR to a writable folder with room for the tokenizer and index (a few MB; "
                      "about the file's size more for converted K-quants, 4 bytes a weight for a dense load)") from e
    return target


class _Damaged(OSError):
    """A damaged converted folder that could not be set aside (a read-only cache): its message says which
    folder, what was wrong and how to clear it, and it is not reworded as a cache that cannot be written."""


def _set_aside(folder: Path, damage: list[str]) -> None:
    """Moves a damaged converted folder out of the loaders' sight (renamed ``.prune-...``, then deleted; a
    prune finishes one left behind), so that it is converted again; says what was wrong."""
    logger.warning("the cached conversion %s is damaged (%s); converting the GGUF file again", folder, "; ".join(damage))
    trash = folder.with_name(f".prune-{folder.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        folder.rename(trash)
    except OSError as e:
        if not folder.exists():  # a concurrent load set it aside first
            return
        raise _Damaged(e.errno, f"the cached conversion {str(folder)!r} is damaged ({'; '.join(damage)}) and could "
                                f"not be moved aside ({e.strerror}); delete that folder (rm -r '{folder}') or point "
                                "PAGEDRS_CACHE_DIR elsewhere, then load again") from e
    shutil.rmtree(trash, ignore_errors=True)


def convert_gguf(path: Path, out: Path) -> None:
    """Write config.json, the tokenizer and gguf_index.json (the tensors' places) of a GGUF file into ``out``."""
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    index = _tensor_index(reader)
    gguf_checkpoint_shapes(path, index)  # a tensor with no place in the architecture is refused now, not at a later load
    (out / "config.json").write_text(json.dumps(config, indent=1))
    from pagedrs.tokenizer import Tokenizer

    Tokenizer.from_gguf(path).hf.save_pretrained(str(out))
    (out / _INDEX).write_text(json.dumps(index))  # (the manifest, written after it, makes the folder whole)


def _write_dense_weights(path: Path, folder: Path) -> None:
    """``model.safetensors`` (float32, transformers names) in ``folder``, written to a temporary file and
    renamed into place, so a reader never sees half of it and concurrent writers do not clash."""
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    state = dict(gguf_tensors(path, tensor_index(path, folder), config))
    with _replacing(folder / _DENSE) as tmp:
        save_file(state, str(tmp))


def _atomic_write_text(path: Path, text: str) -> None:
    with _replacing(path) as tmp:
        tmp.write_text(text)


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` to write, renamed onto ``path`` when the block ends and removed if it
    raises: a reader never sees half a file, and concurrent writers of the same content do not clash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class ConvertedBlocks:
    """``gguf_convert.to_kernel`` with its results kept in the converted folder (``converted/<name>.<TARGET>``:
    the raw block bytes, then their CRC-32), so only the first load of a file converts.

    Why: converting runs at 80-110 M weights a second here (requantizing to Q8_0; until the kernel read
    Q4_K, Q5_K and Q6_K as they are, those too: about 100 s for an 8B Q4_K_M file on every load), where
    reading the converted blocks back and checking them takes seconds (CRC-32 at ~2.4 GB/s). Never wrong: a kept file is used only when it has exactly the
    bytes its shape takes and its checksum holds (a file cut short, or spoiled on disk, is converted
    again and rewritten); it is written to a temporary name and renamed into place (never seen
    half-written). A failed write (a full disk, a read-only cache) loses only the saving: the load
    goes on with the blocks it converted, and says so. The folder is keyed by the GGUF file's content
    hash and the conversion is a pure function of the blocks, so a kept result is the one the file gives."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "converted"

    def __call__(self, blocks: np.ndarray, cols: int, type_name: str, target: str, name: str) -> np.ndarray:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        from pagedrs.models.gguf_convert import to_kernel

        if type_name == target:
            return to_kernel(blocks, cols, type_name, target, name)
        kept_file = self.folder / f"{name}.{target}"
        weights_per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[target]]
        shape = (blocks.shape[0], cols // weights_per_block * block_bytes)
        kept = _read_checked(kept_file, shape)
        if kept is not None:
            return kept
        out = to_kernel(blocks, cols, type_name, target, name)
        try:
            with _replacing(kept_file) as tmp, tmp.open("wb") as f:
                data = np.ascontiguousarray(out).data.cast("B")
                f.write(data)
                f.write(zlib.crc32(data).to_bytes(4, "little"))
        except OSError as e:
            logger.warning("GGUF tensor %r: its %s blocks were not kept in %s (%s); the next load converts it again",
                           name, target, self.folder, e)
        return out


def _read_checked(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """The uint8 ``shape`` blocks ``ConvertedBlocks`` kept at ``path`` (a read-only map), or None when the file is
    absent, not that size, or fails its CRC-32."""
    nbytes = shape[0] * shape[1]
    try:
        if path.stat().st_size != nbytes + 4 or nbytes == 0:
            return None
    except OSError:
        return None
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if zlib.crc32(data[:nbytes].data) != int.from_bytes(data[nbytes:].tobytes(), "little"):
        logger.warning("%s fails its checksum; converting that tensor again", path)
        return None
    return data[:nbytes].reshape(shape)
