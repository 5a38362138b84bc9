"""Blob stores: where the bytes of every file live, named by their sha256."""

from pffs.store.base import PutResult
from pffs.store.local import LocalBlobStore, PutBatch

__all__ = ["LocalBlobStore", "PutBatch", "PutResult"]
