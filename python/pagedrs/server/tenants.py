"""Who is calling, and which cached prefix pages their requests may share.

The prefix cache is a timing side channel (CVE-2025-46570): a request that reuses cached
pages answers faster, so a client can probe whether someone else sent a prefix. vLLM's
answer is ``cache_salt``: a per-request salt at the root of the sequence's hash chain, so
requests under different salts never share a page, on any tier, across restarts too.

The salt the engine gets is a digest, never the client's text as it is:

    shared      no client salt  -> None (one cache for everyone)
                client salt s   -> sha256(["client", s])
    per-tenant  tenant t, s     -> sha256(["tenant", t, s or null])

so tenant A's salt "x" and tenant B's salt "x" differ, a tenant without a salt still
gets its own cache, and no client salt can name another tenant's pages, not even after
the server is restarted in the other mode over the same disk tier. The digest's 64 hex
characters are within the engine's 256-byte bound whatever the tenant and client sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_KEY_CHARS = 512


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the path and the line."""


def load_api_key_file(path: str) -> dict[str, str]:
    """``--api-key-file``: one ``<key> <tenant>`` per line; blank lines and ``#`` comments are skipped.

    Keys are any non-blank text without spaces (at most 512 characters), each used once;
    tenant names are 1-64 letters, digits and ``. _ -``. Several keys may share a tenant.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"--api-key-file {path!r} cannot be read: {exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"--api-key-file {path!r} line {number}"
        fields = line.split()
        if len(fields) != 2:
            raise KeyFileError(f"{where}: expected '<key> <tenant>' (2 fields separated by spaces), got {len(fields)}")
        key, tenant = fields
        if len(key) > MAX_KEY_CHARS:
            raise KeyFileError(f"{where}: the key has {len(key)} characters; at most {MAX_KEY_CHARS} allowed")
        if not TENANT_NAME.fullmatch(tenant):
            raise KeyFileError(f"{where}: tenant {tenant[:80]!r} must be 1-64 letters, digits and . _ -")
        if key in keys:
            raise KeyFileError(f"{where}: this key is already given to tenant {keys[key]!r}; each key names one tenant")
        keys[key] = tenant
    if not keys:
        raise KeyFileError(f"--api-key-file {path!r} has no keys: write one '<key> <tenant>' per line")
    return keys


def tenant_of(token: str, keys: dict[str, str]) -> str | None:
    """The tenant whose key ``token`` is, or None. Every key is compared, in constant time each,
    so the time taken does not tell which key (or how much of one) matched."""
    given = token.encode("utf-8", "surrogateescape")
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(given, key.encode("utf-8", "surrogateescape")):
            found = tenant
    return found


def engine_salt(isolation: str, tenant: str | None, client_salt: str | None) -> str | None:
    """The cache salt the engine gets for a request (see the module docstring)."""
    if isolation == "per-tenant":
        if tenant is None:
            raise ValueError("per-tenant prefix cache isolation needs the request's tenant (no API key matched)")
        parts: list[str | None] = ["tenant", tenant, client_salt]
    elif client_salt is None:
        return None
    else:
        parts = ["client", client_salt]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()
