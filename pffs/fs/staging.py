"""Bytes of files open for writing, held until the commit at flush/fsync/release.

A staging buffer starts in memory and spills to a sparse temp file in the
store's ``staging/`` folder once the process-wide memory budget or one block
is exceeded, so files larger than RAM can be written.  Holes read as zeros.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading

from ..namespace import BLOCK_SIZE


class MemoryBudget:
    """Bytes of staging held in memory by all open files together.

    Changed from the event loop and from worker threads (writes and
    truncates past a block run there): only through :meth:`add`.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """*n* more bytes held (negative: given back)."""
        with self._lock:
            self.used += n


class Staging:
    def __init__(self, budget: MemoryBudget, spill_dir: str, initial: bytes = b""):
        self.budget = budget
        self.spill_dir = spill_dir
        self.buf: bytearray | None = bytearray(initial)
        self.fd: int | None = None
        self.size = len(initial)
        budget.add(len(initial))
        self.dirty = False
        self.version = 0          # bumped by every change; a commit clears dirty only if unchanged
        self.mtime_ns: int | None = None
        # Blocks whose bytes are still those of a committed blob (block number ->
        # digest), set when a file of several blocks is staged: a commit reuses
        # them without reading, hashing or storing them again.
        self.clean: dict[int, str] = {}

    def _spill(self) -> None:
        fd, path = tempfile.mkstemp(prefix="open-", dir=self.spill_dir)
        os.unlink(path)
        assert self.buf is not None
        view = memoryview(self.buf)[:self.size]
        try:
            off = 0
            while off < len(view):
                off += os.pwrite(fd, view[off:], off)
            os.ftruncate(fd, self.size)
        except BaseException:
            # (A full disk, say: the bytes stay in memory, and the file's room goes back now.)
            view.release()
            os.close(fd)
            raise
        view.release()
        self.budget.add(-len(self.buf))
        self.buf = None
        self.fd = fd

    def _changed(self) -> None:
        self.dirty = True
        self.version += 1

    def _touch(self, off: int, end: int) -> None:
        """Bytes [off, end) change: their blocks are no longer clean."""
        if not self.clean or end <= off:
            return
        lo, hi = off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        if hi - lo > len(self.clean):
            for bn in [b for b in self.clean if lo <= b <= hi]:
                del self.clean[bn]
        else:
            for bn in range(lo, hi + 1):
                self.clean.pop(bn, None)

    def is_hole(self, blockno: int) -> bool:
        """Whether block *blockno* holds no data in the spill file (so reads as zeros),
        known without reading it (SEEK_DATA)."""
        if self.fd is None:
            return False
        off = blockno * BLOCK_SIZE
        end = min(off + BLOCK_SIZE, self.size)
        try:
            pos = os.lseek(self.fd, off, os.SEEK_DATA)
        except OSError as e:
            return e.errno == errno.ENXIO   # (no data past off; EINVAL: not known here)
        return pos >= end

    def spills(self, off: int, n: int) -> bool:
        """Whether writing *n* bytes at *off* moves the buffer to disk (work for a worker thread)."""
        if self.buf is None:
            return False
        end = off + n
        grow = max(0, end - len(self.buf))
        return end > BLOCK_SIZE or bool(grow and self.budget.used + grow > self.budget.limit)

    def write(self, off: int, data) -> int:
        n = len(data)
        end = off + n
        # (Past the end, the old last block's tail turns from nothing to zeros: touched too.)
        self._touch(min(off, self.size), end)
        if self.buf is not None:
            grow = max(0, end - len(self.buf))
            if end > BLOCK_SIZE or (grow and self.budget.used + grow > self.budget.limit):
                self._spill()
        if self.buf is not None:
            if off == len(self.buf):        # appending: one copy, no zero fill first
                self.budget.add(n)
                self.buf += data
            else:
                if end > len(self.buf):
                    self.budget.add(end - len(self.buf))
                    self.buf.extend(bytes(end - len(self.buf)))
                self.buf[off:end] = data
        else:
            view = memoryview(data)
            done = 0
            while done < n:
                done += os.pwrite(self.fd, view[done:], off + done)
        self.size = max(self.size, end)
        self._changed()
        return n

    def truncate(self, size: int) -> None:
        self._touch(min(size, self.size), max(size, self.size))
        if self.buf is not None:
            if size > BLOCK_SIZE or size - len(self.buf) + self.budget.used > self.budget.limit:
                self._spill()
        if self.buf is not None:
            if size < len(self.buf):
                self.budget.add(size - len(self.buf))
                del self.buf[size:]
            else:
                self.budget.add(size - len(self.buf))
                self.buf.extend(bytes(size - len(self.buf)))
        else:
            os.ftruncate(self.fd, size)
        self.size = size
        self._changed()

    def read(self, off: int, size: int) -> bytes:
        end = min(off + size, self.size)
        if off >= end:
            return b""
        if self.buf is not None:
            return bytes(self.buf[off:end])
        out = os.pread(self.fd, end - off, off)
        # A sparse file reads back its holes as zeros; pad a short read the same way.
        return out + bytes(end - off - len(out))

    def view(self, blockno: int):
        """Bytes of block *blockno* (a zero-copy view while in memory; no writes meanwhile)."""
        off = blockno * BLOCK_SIZE
        n = min(BLOCK_SIZE, self.size - off)
        if self.buf is not None:
            return memoryview(self.buf)[off:off + n]
        return self.read(off, n)

    @property
    def in_memory(self) -> bool:
        return self.buf is not None

    def close(self) -> None:
        if self.buf is not None:
            self.budget.add(-len(self.buf))
            self.buf = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
