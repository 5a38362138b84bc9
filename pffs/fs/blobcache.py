"""A bounded LRU cache of decompressed blobs, so small and repeated reads decode
once, and the reader that fetches through it."""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict

import outcome
import trio
from pyfuse3 import FUSEError

from pffs.errors import CorruptBlob, IntegrityError

log = logging.getLogger("pffs.fs")


class BlobCache:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._d: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, digest: str, count: bool = True) -> bytes | memoryview | None:
        data = self._d.get(digest)
        if data is None:
            self.misses += count
            return None
        self._d.move_to_end(digest)
        self.hits += count
        return data

    def put(self, digest: str, data: bytes | memoryview) -> None:
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


class BlobReader:
    """Decoded, verified blob bytes for reads, through the cache: one fetch
    per blob however many readers (and the prefetcher) want it at once.

    On the trio thread only.  ``loading`` marks blobs on their way (fetched
    by a read, or by the prefetcher: ``prefetched``).
    """

    def __init__(self, content, cache: BlobCache, path_of):
        self.content = content
        self.cache = cache
        self._path_of = path_of
        self.loading: dict[str, trio.Event] = {}
        self.fetched_by_reads = 0  # blobs a read had to fetch itself: neither cached nor prefetched
        self.prefetched_blobs = 0  # blobs the prefetcher fetched ahead of readers
        self.prefetch_jobs = 0     # jobs it gave its threads for them (see pffs.fs.prefetch)

    async def blob(self, digest: str, ino: int) -> bytes | memoryview:
        """The bytes of *digest*, read for inode *ino* (EIO if damaged)."""
        data = self.cache.get(digest)
        if data is not None:
            return data
        while digest in self.loading:
            await self.loading[digest].wait()
            data = self.cache.get(digest)
            if data is not None:
                return data
        ev = self.loading[digest] = trio.Event()
        self.fetched_by_reads += 1
        try:
            fetched: bytes | memoryview = await trio.to_thread.run_sync(self.content.get, digest,
                                                 limiter=self.content.limiter)
        except IntegrityError as e:
            log.error("read %s: %s", self._path_of(ino), e)
            if isinstance(e, CorruptBlob):
                # (the next write of these bytes stores them afresh: the damage heals)
                await trio.to_thread.run_sync(self.content.set_aside, digest, e.reason,
                                              limiter=self.content.limiter)
            raise FUSEError(errno.EIO) from None
        finally:
            del self.loading[digest]
            ev.set()
        self.cache.put(digest, fetched)
        return fetched

    def wanted(self, digest: str) -> bool:
        """Neither cached nor on its way: then marked as on its way."""
        if digest in self.loading or self.cache.get(digest, count=False) is not None:
            return False
        self.loading[digest] = trio.Event()
        return True

    def prefetched(self, digest: str, fetched: outcome.Outcome) -> None:
        """A blob the prefetcher fetched, or failed to (the reader's own fetch
        then reports why)."""
        if isinstance(fetched, outcome.Value):
            self.prefetched_blobs += 1
            self.cache.put(digest, fetched.value)
        ev = self.loading.pop(digest, None)
        if ev is not None:
            ev.set()
