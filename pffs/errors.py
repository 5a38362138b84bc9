"""Exceptions shared by the store, codec and namespace layers."""

from __future__ import annotations


class PffsError(Exception):
    """Base class for errors that pffs reports to a user as one line."""


class IntegrityError(PffsError):
    """A blob is missing, truncated or does not hold the bytes its name promises."""

    def __init__(self, digest: str, reason: str):
        super().__init__(f"blob {digest}: {reason}")
        self.digest = digest
        self.reason = reason


class MissingBlob(IntegrityError):
    pass


class CorruptBlob(IntegrityError):
    pass


class CodecError(PffsError):
    """A frame cannot be decoded (bad header, bomb, wrong length, bad checksum)."""


class StoreFull(PffsError):
    """The store's size limit or the disk is reached."""


class StoreUnavailable(PffsError):
    """The blob store cannot be reached or refuses us (network, server, credentials).

    Not damage: nothing was changed, and the same call may work later.
    """
