"""The hidden ``.pffs/`` folder: files pffs makes up on the fly, never cached.

``.pffs`` is not listed in the root but can be reached by name.  It holds
``stats.json`` (SPEC §4 figures, computed at open), ``version`` and
``engine.sock`` (a symlink to the live-engine socket in the store folder).
"""

from __future__ import annotations

import errno
import json
import os
import stat

import pyfuse3
from pyfuse3 import FUSEError

from .. import __version__
from .. import namespace as ns

VIRT_BASE = 1 << 62
PFFS_DIR = VIRT_BASE + 1
STATS = VIRT_BASE + 2
VERSION = VIRT_BASE + 3
SOCK = VIRT_BASE + 4
FH_BASE = 1 << 62

_FILES = {b"stats.json": STATS, b"version": VERSION, b"engine.sock": SOCK}


class VirtualTree:
    def __init__(self, ops, socket_path: str = "", store_root: str = ""):
        self.ops = ops
        self.store_root = store_root
        self.socket_path = socket_path.encode()
        self.handles: dict[int, bytes] = {}
        self._next_fh = FH_BASE
        self._t = ns.now_ns()

    def owns(self, ino: int) -> bool:
        return ino >= VIRT_BASE

    def reserved(self, parent: int, name: bytes) -> bool:
        return (parent == ns.ROOT_INODE and name == b".pffs") or self.owns(parent)

    def _attr(self, ino: int, mode: int, size: int, nlink: int = 1) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = mode
        a.st_nlink = nlink
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        a.st_size = size
        a.st_blksize = 1 << 20
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self._t
        # Made up on the fly: the kernel must ask every time.
        a.attr_timeout = 0
        a.entry_timeout = 0
        return a

    def _content(self, ino: int) -> bytes:
        if ino == STATS:
            figures = ns.stats(self.ops.db.ro).to_json()
            figures["cache"] = {"bytes": self.ops.cache.used, "hits": self.ops.cache.hits,
                                "misses": self.ops.cache.misses}
            return (json.dumps(figures, indent=2) + "\n").encode()
        if ino == VERSION:
            return (f"pffs {__version__}\nschema {ns.SCHEMA_VERSION}\npid {os.getpid()}\n"
                    f"store {self.store_root}\n").encode()
        raise FUSEError(errno.ENOENT)

    def getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        if ino == PFFS_DIR:
            return self._attr(ino, stat.S_IFDIR | 0o555, 0, 2)
        if ino == SOCK:
            return self._attr(ino, stat.S_IFLNK | 0o777, len(self.socket_path))
        if ino in (STATS, VERSION):
            return self._attr(ino, stat.S_IFREG | 0o444, len(self._content(ino)))
        raise FUSEError(errno.ENOENT)

    def lookup(self, parent: int, name: bytes):
        if parent == ns.ROOT_INODE and name == b".pffs":
            return self.getattr(PFFS_DIR)
        if parent == PFFS_DIR:
            ino = _FILES.get(name)
            if ino is None:
                raise FUSEError(errno.ENOENT)
            return self.getattr(ino)
        return None

    def readlink(self, ino: int):
        if ino == SOCK:
            return self.socket_path
        return None

    def open(self, ino: int, flags: int) -> pyfuse3.FileInfo:
        if ino == PFFS_DIR:
            raise FUSEError(errno.EISDIR)
        if (flags & os.O_ACCMODE) != os.O_RDONLY:
            raise FUSEError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = self._content(ino)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return self.handles[fh][off:off + size]

    def release(self, fh: int) -> None:
        self.handles.pop(fh, None)

    async def readdir(self, fh: int, start_id: int, token) -> None:
        if fh != PFFS_DIR:
            raise FUSEError(errno.ENOTDIR)
        entries = sorted(_FILES.items(), key=lambda kv: kv[1])
        for name, ino in entries:
            if ino <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, name, self.getattr(ino), ino):
                break
