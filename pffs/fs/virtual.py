"""The hidden ``.pffs/`` folder: files pffs makes up on the fly, never cached.

``.pffs`` is not listed in the root but can be reached by name.  It holds
``stats.json`` (SPEC §4 figures, computed at open, and a count of the FUSE
requests served, by operation), ``version``, ``store.json`` (where the store
is, for engines' bridges on this host: pffs.fs.direct) and ``engine.sock``
(a symlink to the live-engine socket in the store folder).
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
STORE = VIRT_BASE + 5
FH_BASE = 1 << 62

_FILES = {b"stats.json": STATS, b"version": VERSION, b"engine.sock": SOCK, b"store.json": STORE}


class VirtualTree:
    def __init__(self, ops, socket_path: str = "", store_root: str = ""):
        self.ops = ops
        self.store_root = store_root
        self.socket_path = socket_path.encode()
        self.handles: dict[int, bytes] = {}
        self._next_fh = FH_BASE
        self._t = ns.now_ns()
        #: pffs.live.view.LiveView while the daemon serves live engines (``engines/``)
        self.live = None
        #: The bytes of store.json (set by the daemon: pffs.fs.direct.store_info)
        self.store_json = b"{}\n"
        self._stats: tuple[int, dict] | None = None   # (db data_version, namespace figures)

    def attach_live(self, view) -> None:
        """Serve ``engines/`` through *view*; its open files share this handle table."""
        self.live = view
        view.handles = self.handles

    def _live_owns(self, ino: int) -> bool:
        return self.live is not None and self.live.owns(ino)

    def owns(self, ino: int) -> bool:
        return ino >= VIRT_BASE

    def reserved(self, parent: int, name: bytes) -> bool:
        return (parent == ns.ROOT_INODE and name in (b".pffs", b"engines")) or self.owns(parent)

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
            # The namespace's figures take a pass over its tables: computed again
            # only once something committed (lookup, getattr and open each ask).
            gen = self.ops.db.data_version()
            if self._stats is None or self._stats[0] != gen:
                self._stats = (gen, ns.stats(self.ops.db.ro).to_json())
            figures = dict(self._stats[1])
            figures["cache"] = {"bytes": self.ops.cache.used, "hits": self.ops.cache.hits,
                                "misses": self.ops.cache.misses,
                                "fetched_by_reads": self.ops.fetched_by_reads}
            figures["requests"] = dict(sorted(self.ops.requests.items()))
            return (json.dumps(figures, indent=2) + "\n").encode()
        if ino == STORE:
            return self.store_json
        if ino == VERSION:
            return (f"pffs {__version__}\nschema {ns.SCHEMA_VERSION}\npid {os.getpid()}\n"
                    f"store {self.store_root}\n").encode()
        raise FUSEError(errno.ENOENT)

    def getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        if ino == PFFS_DIR:
            return self._attr(ino, stat.S_IFDIR | 0o555, 0, 2)
        if ino == SOCK:
            return self._attr(ino, stat.S_IFLNK | 0o777, len(self.socket_path))
        if ino in (STATS, VERSION, STORE):
            return self._attr(ino, stat.S_IFREG | 0o444, len(self._content(ino)))
        raise FUSEError(errno.ENOENT)

    async def lookup(self, parent: int, name: bytes, ctx=None):
        if self.live is not None:
            v = await self.live.lookup(parent, name, ctx)
            if v is not None:
                return v
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

    async def stat(self, ino: int, ctx=None) -> pyfuse3.EntryAttributes:
        if self._live_owns(ino):
            return await self.live.getattr(ino, ctx)
        return self.getattr(ino)

    async def open(self, ino: int, flags: int, ctx=None) -> pyfuse3.FileInfo:
        if self._live_owns(ino):
            return await self.live.open(ino, flags, ctx)
        if ino == PFFS_DIR:
            raise FUSEError(errno.EISDIR)
        if (flags & os.O_ACCMODE) != os.O_RDONLY:
            raise FUSEError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = self._content(ino)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles[fh]
        if not isinstance(h, bytes):
            return await self.live.read(h, off, size)
        return h[off:off + size]

    def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None and not isinstance(h, bytes):
            self.live.release(h)

    async def readdir(self, fh: int, start_id: int, token) -> None:
        if self.live is not None and self.live.owns_dir_handle(fh):
            await self.live.readdir(fh, start_id, token)
            return
        if fh != PFFS_DIR:
            raise FUSEError(errno.ENOTDIR)
        entries = sorted(_FILES.items(), key=lambda kv: kv[1])
        for name, ino in entries:
            if ino <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, name, self.getattr(ino), ino):
                break

    # -- engines/ (pffs.live.view): routes for what only it can do ---------------

    def _need_live(self, ino: int):
        if not self._live_owns(ino):
            raise FUSEError(errno.EPERM)
        return self.live

    async def opendir(self, ino: int, ctx=None) -> int:
        if self._live_owns(ino):
            return await self.live.opendir(ino, ctx)
        return ino

    def releasedir(self, fh: int) -> None:
        if self.live is not None:
            self.live.releasedir(fh)

    def readdir_root(self, start_id: int, token) -> None:
        if self.live is not None:
            self.live.readdir_root(start_id, token)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handles[fh]
        if isinstance(h, bytes):
            raise FUSEError(errno.EBADF)
        return await self.live.write(h, off, buf)

    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is not None and not isinstance(h, bytes):
            await self.live.flush(h)

    async def setattr(self, ino, attr, fields, fh, ctx):
        return await self._need_live(ino).setattr(ino, attr, fields, fh, ctx)

    async def mkdir(self, parent, name, mode, ctx):
        return await self._need_live(parent).mkdir(parent, name, mode, ctx)

    async def create(self, parent, name, mode, flags, ctx):
        return await self._need_live(parent).create(parent, name, mode, flags, ctx)

    async def unlink(self, parent, name, ctx):
        await self._need_live(parent).unlink(parent, name, ctx)

    async def rmdir(self, parent, name, ctx):
        await self._need_live(parent).rmdir(parent, name, ctx)

    async def rename(self, p_old, n_old, p_new, n_new, flags, ctx):
        if not (self._live_owns(p_old) or self._live_owns(p_new)):
            raise FUSEError(errno.EPERM)
        await self.live.rename(p_old, n_old, p_new, n_new, flags, ctx)
