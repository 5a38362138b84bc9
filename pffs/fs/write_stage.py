"""Bytes of files open for writing, held until the commit at flush/fsync/release.

A staging buffer starts in memory and spills to a sparse file in the store's
``staging/`` folder once the process-wide memory budget or one block is
exceeded, so files larger than RAM can be written.  Holes read as zeros.

An ``fsync()`` makes the staged bytes durable without committing them
(:meth:`Staging.journal`): they go to the spill file, which is flushed to disk
and renamed ``fsynced-<inode>-…``.  The mount after a crash commits such files
(``Files.replay_journals``); a spill file of any other name was never
fsynced and is deleted.  The name goes with the staging (:meth:`close`), once
its bytes are committed and that commit is durable.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from typing import TYPE_CHECKING, Callable

from pffs.namespace import BLOCK_SIZE
from pffs.types import Digest

if TYPE_CHECKING:
    from pffs.namespace import BlobRow
    from pffs.store.storedir import PinFile

SPILL_PREFIX = "open-"
JOURNAL_PREFIX = "fsynced-"


def journal_inode(name: str) -> int | None:
    """The inode a journal file of ``staging/`` holds the fsynced bytes of (else None)."""
    if not name.startswith(JOURNAL_PREFIX):
        return None
    head = name[len(JOURNAL_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


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
    def __init__(self, budget: MemoryBudget, spill_dir: str, initial: bytes | memoryview = b"", *,
                 fetch: Callable[[Digest], bytes | memoryview] | None = None):
        self.budget = budget
        self.spill_dir = spill_dir
        self.buf: bytearray | None = bytearray(initial)
        self.fd: int | None = None
        self.path: str | None = None    # the spill file's name while it has one
        self.journaled = False          # the path is a journal file (fsynced bytes)
        self.size = len(initial)
        budget.add(len(initial))
        self.dirty = False
        self.version = 0          # bumped by every change; a commit clears dirty only if unchanged
        self.mtime_ns: int | None = None
        # Blocks whose bytes are still those of a committed blob (block number ->
        # digest), set when a file of several blocks is staged: a commit reuses
        # them without reading, hashing or storing them again.
        self.clean: dict[int, str] = {}
        # Of those, the blocks not read in yet: the spill file has a hole there
        # and their bytes are the blob's (``fetch(digest)``, in a worker thread).
        # A block is read in (:meth:`fill`) before anything changes it, so an
        # edit of a large file costs the blocks it touches.
        self.unloaded: set[int] = set()
        self.fetch = fetch
        # Write-behind (Files._write_behind): full blocks stored while the
        # file is still being written.  Blocks whose job is running; of those,
        # the ones written to since it began (its result is then dropped); the
        # rows of the blobs stored so (their blocks are in ``clean``), which the
        # commit adds to the namespace; the pin file that keeps those blobs from
        # gc until then (closed with the staging).
        self.unsynced = 0               # bytes written since the last fsync or commit
        # Where the current run of sequential writes began, and where it ends
        # now (write-behind stores only blocks such a run wrote whole).
        self.run_start = 0
        self.run_end = -1
        self.inflight: set[int] = set()
        self.spoiled: set[int] = set()
        self.early_rows: dict[str, BlobRow] = {}
        self.pins: PinFile | None = None

    @classmethod
    def adopt(cls, budget: MemoryBudget, path: str) -> "Staging":
        """A staging over an existing spill file (a journal file, at mount)."""
        stg = cls(budget, os.path.dirname(path))
        stg.buf = None
        stg.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        stg.path = path
        stg.journaled = os.path.basename(path).startswith(JOURNAL_PREFIX)
        st = os.fstat(stg.fd)
        stg.size = st.st_size
        stg.mtime_ns = st.st_mtime_ns
        stg.dirty = True
        return stg

    def _spill(self) -> None:
        path = os.path.join(self.spill_dir, SPILL_PREFIX + secrets.token_hex(8))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
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
            os.unlink(path)
            raise
        view.release()
        self.budget.add(-len(self.buf))
        self.buf = None
        self.fd = fd
        self.path = path

    def journal(self, ino: int) -> None:
        """Make the staged bytes durable as they are now (fsync), uncommitted.

        Blocking (a worker thread): the bytes go to the spill file, flushed to
        disk; the first time, the file is renamed to a journal file of *ino*
        and the folder flushed too.
        """
        if self.buf is not None:
            self._spill()
        assert self.fd is not None and self.path is not None
        self.load(0, self.size)     # (the journal holds every byte: none left in a blob only)
        os.fdatasync(self.fd)
        self.unsynced = 0
        if not self.journaled:
            path = os.path.join(self.spill_dir, f"{JOURNAL_PREFIX}{ino}-{secrets.token_hex(8)}")
            os.rename(self.path, path)
            self.path = path
            self.journaled = True
            dfd = os.open(self.spill_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _changed(self) -> None:
        self.dirty = True
        self.version += 1

    def _touch(self, off: int, end: int) -> None:
        """Bytes [off, end) change: their blocks are no longer clean."""
        if end <= off:
            return
        lo, hi = off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        for bn in self.inflight:
            if lo <= bn <= hi:
                self.spoiled.add(bn)
        if not self.clean:
            return
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

    def to_read_in(self, off: int, end: int, whole: tuple[int, int] = (0, 0)) -> list[int]:
        """The blocks to read in before bytes [off, end) change: those not read
        in yet, but those that bytes *whole* (a write's range) cover entirely."""
        out = []
        for bn in self.unloaded_in(off, end):
            base = bn * BLOCK_SIZE
            if not (whole[0] <= base and min(base + BLOCK_SIZE, self.size) <= whole[1]):
                out.append(bn)
        return out

    def _spill_fd(self) -> int:
        """The spill file (its callers run once the bytes are on disk)."""
        if self.fd is None:
            raise ValueError("staged bytes not on disk")
        return self.fd

    def _fetch(self, digest: str) -> bytes | memoryview:
        """A committed block's bytes (set wherever ``unloaded`` is)."""
        if self.fetch is None:
            raise ValueError("no blob reader for blocks not read in")
        return self.fetch(Digest(digest))

    def load(self, off: int, end: int, whole: tuple[int, int] = (0, 0)) -> None:
        """Read in the blocks of :meth:`to_read_in` (Files reads them in
        beforehand, from its cache; this is the rule's backstop), and drop the
        others of the range from ``unloaded``: all their bytes are written."""
        for bn in self.to_read_in(off, end, whole):
            self.fill(bn, self._fetch(self.clean[bn]))
        for bn in self.unloaded_in(off, end):
            self.unloaded.discard(bn)

    def write(self, off: int, data) -> int:
        n = len(data)
        end = off + n
        if self.unloaded:
            self.load(min(off, self.size), end, (off, end))
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
                done += os.pwrite(self._spill_fd(), view[done:], off + done)
        self.size = max(self.size, end)
        self.unsynced += n
        if off != self.run_end:
            self.run_start = off
        self.run_end = end
        self._changed()
        return n

    def truncate(self, size: int) -> None:
        if self.unloaded:
            self.unloaded = {bn for bn in self.unloaded if bn * BLOCK_SIZE < size}
            self.load(min(size, self.size), max(size, self.size))
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
            os.ftruncate(self._spill_fd(), size)
        self.size = size
        self._changed()

    def unloaded_in(self, off: int, end: int) -> list[int]:
        """The blocks not read in yet among those holding bytes [off, end)."""
        if not self.unloaded or end <= off:
            return []
        lo, hi = off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        if hi - lo + 1 > len(self.unloaded):
            return sorted(bn for bn in self.unloaded if lo <= bn <= hi)
        return [bn for bn in range(lo, hi + 1) if bn in self.unloaded]

    def fill(self, bn: int, data) -> None:
        """Read block *bn* in (its committed bytes *data*): a worker thread's
        work, done before the block changes. Changes nothing the file holds."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._spill_fd(), view[done:], bn * BLOCK_SIZE + done)
        self.unloaded.discard(bn)

    def read(self, off: int, size: int) -> bytes:
        end = min(off + size, self.size)
        if off >= end:
            return b""
        if self.buf is not None:
            return bytes(self.buf[off:end])
        if self.unloaded_in(off, end):
            parts = []
            for bn in range(off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
                base = bn * BLOCK_SIZE
                a, b = max(off, base), min(end, base + BLOCK_SIZE)
                if bn in self.unloaded:
                    parts.append(self._fetch(self.clean[bn])[a - base:b - base])
                else:
                    parts.append(self._pread(a, b))
            return b"".join(parts)
        return self._pread(off, end)

    def _pread(self, off: int, end: int) -> bytes:
        out = os.pread(self._spill_fd(), end - off, off)
        # A sparse file reads back its holes as zeros; pad a short read the same way.
        return out + bytes(end - off - len(out))

    def view(self, blockno: int):
        """Bytes of block *blockno* (a zero-copy view while in memory; no writes meanwhile)."""
        off = blockno * BLOCK_SIZE
        n = min(BLOCK_SIZE, self.size - off)
        if self.buf is not None:
            return memoryview(self.buf)[off:off + n]
        return self.read(off, n)

    def journal_pays(self) -> bool:
        """Whether an fsync should journal rather than commit: when what changed
        since the last fsync is small beside what a commit would hash and store
        again (a database's pages in a large file).  A sequential writer's fsync
        commits: its blocks are mostly stored already (write-behind), and a
        journal would write every byte to disk once more."""
        uncommitted = self.size - len(self.clean) * BLOCK_SIZE
        last = (self.size - 1) // BLOCK_SIZE
        if self.size and last in self.clean:
            uncommitted += (last + 1) * BLOCK_SIZE - self.size   # (a short last block)
        uncommitted = max(0, uncommitted)
        return self.unsynced * 4 < uncommitted

    @property
    def in_memory(self) -> bool:
        return self.buf is not None

    def forget_early(self) -> None:
        """Let go of the blobs write-behind stored (unpinned; their blocks are
        stored again by the next commit)."""
        for bn in [bn for bn, d in self.clean.items() if d in self.early_rows]:
            del self.clean[bn]
        self.early_rows.clear()
        if self.pins is not None:
            self.pins.close()
            self.pins = None

    def close(self) -> None:
        if self.pins is not None:
            self.pins.close()
            self.pins = None
        if self.buf is not None:
            self.budget.add(-len(self.buf))
            self.buf = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None
            self.journaled = False
