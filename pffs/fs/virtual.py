"""The hidden ``.pffs/`` folder: files pffs makes up on the fly, never cached.

``.pffs`` is not listed in the root but can be reached by name.  It holds
``stats.json`` (contract §4 figures, computed at open, and a count of the FUSE
requests served, by operation), ``version``, ``store.json`` (where the store
is, for engines' bridges on this host: pffs.fs.adoption) and ``engine.sock``
(a symlink to the live-engine socket in the store folder).

``engines/`` is another tree in the same handler protocol
(pffs.live.view.EnginesTree).
"""

from __future__ import annotations

import errno
import json
import os
import stat

import pyfuse3
from pyfuse3 import (
    EntryAttributes,
    FileHandleT,
    FileInfo,
    FileNameT,
    FlagT,
    FUSEError,
    InodeT,
    ReaddirToken,
    RequestContext,
)

from pffs import __version__
from pffs import namespace as ns
from pffs.fs.blobcache import BlobReader
from pffs.fs.db import Database
from pffs.fs.files import NOFLUSH
from pffs.fs.routing import ROOT, VIRT_BASE, Tree
from pffs.names import SOCKET_NAME_B, STATS_NAME_B, STORE_INFO_NAME_B, VERSION_NAME_B

PFFS_DIR = VIRT_BASE + 1
STATS = VIRT_BASE + 2
VERSION = VIRT_BASE + 3
SOCK = VIRT_BASE + 4
STORE = VIRT_BASE + 5
FH_BASE = VIRT_BASE      # (pffs.fs.routing.FILE_HANDLES)

_FILES = {STATS_NAME_B: STATS, VERSION_NAME_B: VERSION, SOCKET_NAME_B: SOCK, STORE_INFO_NAME_B: STORE}


class PffsTree(Tree):
    def __init__(self, db: Database, reader: BlobReader, requests: dict[str, int],
                 socket_path: str = "", store_root: str = "", store_json: bytes = b"{}\n",
                 copies: dict[str, int] | None = None, live: dict[str, int] | None = None,
                 named: dict[str, int] | None = None, shared: dict[str, int] | None = None):
        self.db = db
        self.reader = reader
        self.requests = requests             # FUSE requests served, by handler
        self.copies = copies if copies is not None else {}   # (pffs.fs.files.Files.copies)
        self.live = live                     # (pffs.live.registry.LiveRegistry.counts)
        self.named = named if named is not None else {}   # (pffs.fs.content.ContentStore.named)
        self.shared = shared        # (pffs.bucket.shared_index.Publisher.counts)
        self.store_root = store_root
        self.socket_path = socket_path.encode()
        self.store_json = store_json         # (pffs.fs.adoption.store_info)
        self.handles: dict[FileHandleT, bytes] = {}
        self._next_fh = FH_BASE
        self._t = ns.now_ns()
        self._stats: tuple[int, dict] | None = None   # (db data_version, namespace figures)

    def _attr(self, ino: int, mode: int, size: int, nlink: int = 1) -> EntryAttributes:
        a = EntryAttributes()
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
            gen = self.db.data_version()
            if self._stats is None or self._stats[0] != gen:
                self._stats = (gen, ns.stats(self.db.ro).to_json())
            figures = dict(self._stats[1])
            cache = self.reader.cache
            figures["cache"] = {"bytes": cache.used, "hits": cache.hits, "misses": cache.misses,
                                "fetched_by_reads": self.reader.fetched_by_reads,
                                "prefetched": self.reader.prefetched_blobs,
                                "prefetch_jobs": self.reader.prefetch_jobs}
            figures["requests"] = dict(sorted(self.requests.items()))
            if hasattr(pyfuse3, "read_counts"):
                figures["request_reads"] = pyfuse3.read_counts()
            figures["copies"] = dict(self.copies)
            figures["blobs_named"] = dict(self.named)
            if self.live is not None:
                figures["live"] = dict(self.live)
            if self.shared is not None:
                figures["shared_index"] = dict(self.shared)
            figures["namespace_writes"] = dict(self.db.counts)
            return (json.dumps(figures, indent=2) + "\n").encode()
        if ino == STORE:
            return self.store_json
        if ino == VERSION:
            return (f"pffs {__version__}\nschema {ns.SCHEMA_VERSION}\npid {os.getpid()}\n"
                    f"store {self.store_root}\n").encode()
        raise FUSEError(errno.ENOENT)

    def _getattr(self, ino: int) -> EntryAttributes:
        if ino == PFFS_DIR:
            return self._attr(ino, stat.S_IFDIR | 0o555, 0, 2)
        if ino == SOCK:
            return self._attr(ino, stat.S_IFLNK | 0o777, len(self.socket_path))
        if ino in (STATS, VERSION, STORE):
            return self._attr(ino, stat.S_IFREG | 0o444, len(self._content(ino)))
        raise FUSEError(errno.ENOENT)

    async def lookup(self, parent: InodeT, name: FileNameT, ctx: RequestContext | None) -> EntryAttributes:
        if parent == ROOT and name == b".pffs":
            return self._getattr(PFFS_DIR)
        if parent == PFFS_DIR:
            ino = _FILES.get(name)
            if ino is not None:
                return self._getattr(ino)
        raise FUSEError(errno.ENOENT)

    async def getattr(self, inode: InodeT, ctx: RequestContext | None) -> EntryAttributes:
        return self._getattr(inode)

    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        if inode == SOCK:
            return self.socket_path
        raise FUSEError(errno.EINVAL)

    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        if inode == PFFS_DIR:
            raise FUSEError(errno.EISDIR)
        if (flags & os.O_ACCMODE) != os.O_RDONLY:
            raise FUSEError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = self._content(inode)
        if NOFLUSH:
            return FileInfo(fh=fh, direct_io=True, keep_cache=False, noflush=True)
        return FileInfo(fh=fh, direct_io=True, keep_cache=False)

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes:
        return self.handles[fh][off:off + size]

    async def release(self, fh: FileHandleT) -> None:
        self.handles.pop(fh, None)

    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> bool:
        if fh != PFFS_DIR:
            raise FUSEError(errno.ENOTDIR)
        entries = sorted(_FILES.items(), key=lambda kv: kv[1])
        for name, ino in entries:
            if ino <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, name, self._getattr(ino), ino):
                break
        return True
