"""What can go wrong with the disk tier, as types.

Two kinds, on two sides of startup:

- ``DiskTierError`` (a ``ValueError``): the tier the operator asked for (``kv_disk_path``)
  cannot be used, so the engine does not start. The CLIs turn it into exit 2; the message
  names the path and the reason. There is no "warn and run without it".
- ``CorruptPageError``: a page read back while serving is not the page the core wrote
  (it failed its checksum, its write failed, or it cannot be read). The page is lost,
  never wrong: the engine drops ``exc.slots`` from the core's disk index and recomputes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable


class DiskTierError(ValueError):
    """``kv_disk_path`` was given, and the disk tier cannot be used there."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"kv_disk_path={str(path)!r} cannot be used: {reason} "
                         "(fix it, or leave kv_disk_path unset to run without the disk tier)")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self):  # noqa: ANN204 - picklable with its two fields
        return (type(self), (self.path, self.reason))


class StoreBusyError(DiskTierError):
    """Another engine holds the store open (an exclusive lock on its file)."""


class CorruptPageError(RuntimeError):
    """Pages read back from disk are not the pages written; ``slots`` lists every one of the read."""

    def __init__(self, message: str, slots: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.slots = [int(s) for s in slots]

    def __reduce__(self):  # noqa: ANN204
        return (type(self), (str(self), self.slots))


_REASONS = {
    errno.EEXIST: "it is not a directory",
    errno.ENOTDIR: "a part of it is not a directory",
    errno.EISDIR: "the store file is a directory",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
}


def os_reason(exc: OSError) -> str:
    """An OSError as the reason a store cannot be used: what, and on which file."""
    what = _REASONS.get(exc.errno or 0, exc.strerror or str(exc))
    return f"{what} ({exc.filename})" if exc.filename else what
