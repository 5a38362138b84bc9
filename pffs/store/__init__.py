"""Blob stores: where the bytes of every file live, named by their sha256."""

from .local import LocalBlobStore, PutBatch, PutResult

__all__ = ["LocalBlobStore", "PutBatch", "PutResult"]
