"""A bounded LRU cache of decompressed blobs, so small and repeated reads decode
once, and the threads that fill it ahead of sequential readers."""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from typing import Callable

import trio


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


class Prefetcher:
    """Threads that fetch and decode blobs ahead of readers.

    A cheaper hop than a trio task and ``trio.to_thread`` per blob: a digest
    goes on a queue, and ``done(digest, data or None)`` runs on the trio
    thread when a thread has it (None: fetching failed; the reader's own
    fetch will report why).
    """

    def __init__(self, get: Callable[[str], bytes], done: Callable[[str, bytes | None], None],
                 threads: int):
        self._get = get
        self._done = done
        self._n = threads
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._token: trio.lowlevel.TrioToken | None = None

    def submit(self, digest: str) -> None:
        """From the trio thread."""
        if self._token is None:
            self._token = trio.lowlevel.current_trio_token()
            for i in range(self._n):
                threading.Thread(target=self._loop, name=f"pffs-prefetch-{i}", daemon=True).start()
        self._q.put(digest)

    def _loop(self) -> None:
        while True:
            digest = self._q.get()
            try:
                data = self._get(digest)
            except Exception:
                data = None
            try:
                self._token.run_sync_soon(self._done, digest, data)
            except trio.RunFinishedError:
                return
