"""The local cache of an S3 store's frames, in its cache folder (``blobs/``, LRU by bytes)."""

from __future__ import annotations

import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path

from pffs import codec as codec_mod
from pffs.store.local import TMP_PREFIX, LocalBlobStore
from pffs.types import Digest


class FrameCache:
    """Frames of recently used blobs under ``root/blobs`` (the local store's layout), LRU by bytes.

    Disposable: written without fsync, verified on every read like any blob,
    and evicted oldest first (order kept across restarts by the files' mtimes).
    """

    def __init__(self, root: Path, limit: int):
        self.store = LocalBlobStore(root)
        self.limit = limit
        self.used = 0
        self._lru: OrderedDict[str, int] | None = None
        self._lock = threading.Lock()

    def _index(self) -> OrderedDict[str, int]:
        if self._lru is None:
            found = []
            for d in self.store:
                try:
                    st = self.store.path(d).stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, d, st.st_size))
            found.sort()
            self._lru = OrderedDict((d, size) for _, d, size in found)
            self.used = sum(self._lru.values())
            self._evict()
        return self._lru

    def _evict(self) -> None:
        while self.used > self.limit and self._lru:
            d, size = self._lru.popitem(last=False)
            self.used -= size
            try:
                os.unlink(self.store.path(Digest(d)))
            except OSError:
                pass

    def get(self, digest: Digest) -> bytes | None:
        with self._lock:
            lru = self._index()
            if digest not in lru:
                return None
            lru.move_to_end(digest)
        path = self.store.path(digest)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)
        except OSError:
            self.discard(digest)
            return None
        return data

    def head(self, digest: Digest) -> bytes | None:
        with self._lock:
            if digest not in self._index():
                return None
        try:
            with open(self.store.path(digest), "rb") as f:
                return f.read(codec_mod.HEADER_SIZE)
        except OSError:
            return None

    def put(self, digest: Digest, frame: bytes) -> None:
        if len(frame) > self.limit:
            return
        with self._lock:
            if digest in self._index():
                return
        path = self.store.path(digest)
        tmp = path.parent / f"{TMP_PREFIX}{path.name[:16]}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(frame)
            os.rename(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return  # a full or missing cache folder costs speed, not data
        with self._lock:
            lru = self._index()
            if digest not in lru:
                lru[digest] = len(frame)
                self.used += len(frame)
            self._evict()

    def discard(self, digest: Digest) -> None:
        with self._lock:
            size = self._index().pop(digest, None)
            if size is not None:
                self.used -= size
        try:
            os.unlink(self.store.path(digest))
        except OSError:
            pass

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._index()


class PeekCache:
    """Another process's frame cache, read only: for a client beside a mount.

    An engine's bridge reads the frames the mount's daemon keeps in its cache
    folder (so a page the mount holds is not fetched again) but never writes
    or evicts there: only the daemon keeps that cache's accounting.  Frames
    are verified by their reader like any blob.
    """

    limit = 0

    def __init__(self, root: Path):
        self.store = LocalBlobStore(root)

    def _read(self, digest: Digest, n: int = -1) -> bytes | None:
        try:
            with open(self.store.path(digest), "rb") as f:
                return f.read(n)
        except OSError:
            return None

    def get(self, digest: Digest) -> bytes | None:
        return self._read(digest)

    def head(self, digest: Digest) -> bytes | None:
        return self._read(digest, codec_mod.HEADER_SIZE)

    def put(self, digest: Digest, frame: bytes) -> None:
        pass

    def discard(self, digest: Digest) -> None:
        pass

    def __contains__(self, digest: str) -> bool:
        return self.store.path(Digest(digest)).exists()
