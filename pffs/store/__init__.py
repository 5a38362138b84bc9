"""Blob stores: where the bytes of every file live, named by their sha256."""

from pffs.store.local import LocalBlobStore, PutBatch, PutResult

__all__ = ["LocalBlobStore", "PutBatch", "PutResult"]
