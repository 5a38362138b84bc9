"""A bounded LRU cache of decompressed blobs, so small and repeated reads decode once."""

from __future__ import annotations

from collections import OrderedDict


class BlobCache:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._d: OrderedDict[str, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, digest: str, count: bool = True) -> bytes | None:
        data = self._d.get(digest)
        if data is None:
            self.misses += count
            return None
        self._d.move_to_end(digest)
        self.hits += count
        return data

    def put(self, digest: str, data: bytes) -> None:
        if len(data) > self.limit or digest in self._d:
            return
        self._d[digest] = data
        self.used += len(data)
        while self.used > self.limit:
            _, old = self._d.popitem(last=False)
            self.used -= len(old)

    def discard(self, digest: str) -> None:
        data = self._d.pop(digest, None)
        if data is not None:
            self.used -= len(data)
