"""Distinct names for distinct things.

A digest is always ``sha256:<64 lowercase hex>`` at the edges; inode numbers,
file handles and page indices are plain ints that must not be mixed up.
"""

from __future__ import annotations

import hashlib
import re
from typing import NewType

Digest = NewType("Digest", str)
InodeNo = NewType("InodeNo", int)
FileHandle = NewType("FileHandle", int)
PageIndex = NewType("PageIndex", int)

DIGEST_PREFIX = "sha256:"
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")


def digest_of(data) -> Digest:
    """The digest of *data* (hashlib releases the GIL for large buffers)."""
    return Digest(DIGEST_PREFIX + hashlib.sha256(data).hexdigest())


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST_RE.match(value) is not None


def digest_hex(digest: Digest) -> str:
    """The 64 hex characters of *digest* (raises ValueError if malformed)."""
    if not is_digest(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return digest[len(DIGEST_PREFIX):]


def digest_bytes(digest: Digest) -> bytes:
    """The 32 bytes of *digest* (what a named frame holds: pffs.codec)."""
    return bytes.fromhex(digest_hex(digest))
