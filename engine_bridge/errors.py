"""Why the bridge refuses: one exception class per reason a user can cause.

Every class carries the errno a filesystem should answer with when a page-in
triggered by a write is refused (contract §5: ``ENOSPC`` for no free blocks,
``EINVAL`` for a session the engine cannot take).
"""

from __future__ import annotations

import errno as _errno
from typing import Any


class BridgeError(Exception):
    """Base class: a page-out or page-in the bridge refused, said in one line."""

    errno = _errno.EINVAL


class PageOutError(BridgeError):
    """The sequences handed to page-out do not describe valid pool contents."""


class PageInError(BridgeError):
    """A session that cannot be paged into this engine; nothing was changed."""


class InvalidSession(PageInError):
    """manifest.json is missing or not a valid manifest."""


class IncompleteSession(PageInError):
    """Page files the manifest lists are missing (normal while a copy is running)."""

    def __init__(self, missing: list[int]):
        shown = ", ".join(f"{ix:06d}" for ix in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        super().__init__(f"incomplete session: page {shown}{more} missing")
        self.missing = missing


class MismatchError(PageInError):
    """The session's bytes mean something else than this engine's pool holds."""

    def __init__(self, field: str, session: Any, engine: Any):
        super().__init__(f"{field} mismatch: session has {session!r}, engine has {engine!r}")
        self.field = field
        self.session = session
        self.engine = engine


class ModelMismatch(MismatchError):
    """The session was written by another model; ``force=True`` overrides this only."""


class Unfingerprinted(ModelMismatch):
    """The session's model has no ``weights_sha256`` and the engine's has one: it is
    loaded only when the caller trusts it (*how* says how), or with ``force``."""

    def __init__(self, engine: Any, how: str = "trust_unfingerprinted=True"):
        PageInError.__init__(self, f"model.weights_sha256 missing: the session does not say "
                                   f"which weights wrote it, engine has {engine!r}; "
                                   f"load it only if you trust it ({how})")
        self.field = "model.weights_sha256"
        self.session = None
        self.engine = engine


class PageError(PageInError):
    """One page file disagrees with the manifest (size or digest)."""

    def __init__(self, page_ix: int, reason: str):
        super().__init__(f"page {page_ix:06d}: {reason}")
        self.page_ix = page_ix
        self.reason = reason


class WrongSizePage(PageError):
    """A page file whose size is not the geometry's page size."""


class DigestMismatch(PageError):
    """A page file whose sha256 is not the digest manifest.json lists."""


class DamagedPage(PageError):
    """A page whose blob in the store is damaged (read by the direct path): never loaded."""

    errno = _errno.EIO


class SourceChanged(DigestMismatch):
    """A page changed between verification and loading (a concurrent writer)."""


class NoFreeBlocks(PageInError):
    """The engine has fewer free blocks than the session needs."""

    errno = _errno.ENOSPC

    def __init__(self, needed: int, free: int):
        super().__init__(f"no free blocks: need {needed}, {free} free")
        self.needed = needed
        self.free = free


class Refused(PageInError):
    """The engine itself refused the session (e.g. a sequence id already live)."""
