"""Room kept in reserve on the store's disk, so deleting files always works.

A mounted daemon keeps a preallocated file (``DIR/reserve``, 16 MiB by
default).  When the disk fills up, blob puts fail with ENOSPC; the first
namespace commit that then fails for want of room (SQLite needs a few pages
of WAL even to delete) gives the reserve up and is retried, so ``rm`` and
``pffs gc`` go through.  While the reserve is given up, puts refuse to take
the last ``size`` bytes of free space (writers get ENOSPC), and the reserve
is taken back as soon as there is room again (gc, deletions elsewhere).

Whether the reserve is held is read from the disk each time, so another
process (``pffs gc`` on a full disk) may give it up too.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from pffs.errors import StoreFull

log = logging.getLogger("pffs.daemon.reserve")  # the name these messages always had

DEFAULT_SIZE = 16 << 20


def free_bytes(path: str | os.PathLike) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


class SpaceReserve:
    def __init__(self, path: str | os.PathLike, size: int = DEFAULT_SIZE):
        self.path = Path(path)
        self.size = size
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        try:
            return self.path.stat().st_size >= self.size
        except FileNotFoundError:
            return False

    def ensure(self) -> bool:
        """Take the reserve if there is room for it and some to spare; True if held."""
        if self.size <= 0:
            return True
        with self._lock:
            if self.held:
                return True
            if free_bytes(self.path.parent) < 2 * self.size:
                return False
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.posix_fallocate(fd, 0, self.size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, self.path)
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    return False
                raise
            log.info("holding %d bytes in reserve for deletions (%s)", self.size, self.path)
            return True

    def release(self) -> bool:
        """Give the reserve up (the disk is full); True if that freed room."""
        with self._lock:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return False
            log.warning("disk of %s is full: released the %d-byte reserve so deletions can commit;"
                        " writes get ENOSPC until there is room again (delete files, run pffs gc)",
                        self.path.parent, self.size)
            return True

    def before_put(self, nbytes: int) -> None:
        """Refuse (StoreFull) a put of *nbytes* that would eat into the reserve's room."""
        if self.size <= 0 or self.held:
            return
        if self.ensure():
            return
        free = free_bytes(self.path.parent)
        if free - nbytes < self.size:
            raise StoreFull(f"disk full: {free} bytes free, {self.size} kept in reserve for deletions")
