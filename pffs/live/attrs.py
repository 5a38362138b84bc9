"""What each inode of ``MNT/engines/`` is, and its attributes as the kernel sees them.

(The numbers: :mod:`.numbering`.)  Attributes kept by the kernel are kept
only where :class:`pffs.live.numbering.KernelCache` tells it when they change.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

import pyfuse3
from pyfuse3 import FUSEError

from pffs.fs.routing import LIVE_BASE
from pffs.live.engines import LIST_TTL, LiveEngine, Registry, SessionEntry
from pffs.live.incoming import Node
from pffs.live.numbering import (
    ENGINE_DIRS_TIMEOUT,
    ENGINES_INO,
    MANIFEST_J,
    PAGE_OFFSET,
    PAGES_J,
    SPAN,
    KernelCache,
    base,
    owns,
)
from pffs.live.pages import Snapshot
from pffs.namespace import now_ns
from pffs.types import InodeNo


class LiveAttrs:
    """The inodes of engines/: what a number is (``resolve``), and its attributes."""

    def __init__(self, registry: Registry, cache: KernelCache):
        self.registry = registry
        self.cache = cache
        self._t = now_ns()

    def resolve(self, ino: InodeNo) -> tuple[str, Any, Any]:
        """(kind, object, extra) for an inode: engines / engine / session / manifest / pages / page / node."""
        if ino == ENGINES_INO:
            return "engines", None, None
        if not owns(ino):
            raise FUSEError(errno.ENOENT)
        key, j = divmod(ino - LIVE_BASE, SPAN)
        obj = self.registry.keys.get(key)
        if isinstance(obj, LiveEngine):
            if j == 0 and obj.alive:
                return "engine", obj, None
            raise FUSEError(errno.ENOENT)
        if not isinstance(obj, SessionEntry) or not obj.engine.alive:
            raise FUSEError(errno.ENOENT)
        inc = obj.incoming
        if inc is not None:
            node = inc.nodes.get(ino)
            if node is None:
                raise FUSEError(errno.ENOENT)
            return "node", obj, node
        if j == 0:
            return "session", obj, None
        if j == MANIFEST_J:
            return "manifest", obj, None
        if j == PAGES_J:
            return "pages", obj, None
        if j >= PAGE_OFFSET:
            return "page", obj, j - PAGE_OFFSET
        # A copied-in file the engine took, through a name the kernel kept (a
        # rename completing the copy cannot wait for KernelCache.incoming_gone): the live one.
        if (taken := obj.taken.get(ino)) is not None:
            return taken[0], obj, taken[1]
        raise FUSEError(errno.ENOENT)

    # -- attributes ------------------------------------------------------------

    def _attr(self, ino: int, mode: int, size: int = 0, uid: int | None = None,
              gid: int | None = None, nlink: int = 1, mtime_ns: int | None = None
              ) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = 0
        a.attr_timeout = 0
        a.st_mode = mode
        a.st_nlink = nlink
        a.st_uid = self.registry.uid if uid is None else uid
        a.st_gid = self.registry.gid if gid is None else gid
        a.st_rdev = 0
        a.st_size = size
        a.st_blksize = 1 << 20
        a.st_blocks = (size + 511) // 512
        t = self._t if mtime_ns is None else mtime_ns
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        return a

    def engines(self) -> pyfuse3.EntryAttributes:
        return self._cached(self._attr(ENGINES_INO, stat.S_IFDIR | 0o755, nlink=2 + len(self.registry.engines)))

    def engine(self, eng: LiveEngine) -> pyfuse3.EntryAttributes:
        # Owned by the mount's owner, who copies sessions in (not the engine's uid).
        return self._cached(self._attr(base(eng.key), stat.S_IFDIR | 0o755, nlink=2,
                                       mtime_ns=eng.attached_ns))

    def _cached(self, a: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        """Kept by the kernel until invalidated (engines/ and engines/NAME: the same
        for every process until an engine attaches or detaches): no LOOKUP and GETATTR."""
        if self.cache.keeps:
            a.entry_timeout = a.attr_timeout = ENGINE_DIRS_TIMEOUT
        return a

    def session(self, entry: SessionEntry, j: int = 0, snap: Snapshot | None = None,
                ix: int = 0) -> pyfuse3.EntryAttributes:
        """A live session's folder (*j* 0), pages/, manifest.json or page *ix*,
        as reader of snapshot *snap* sees it."""
        eng = entry.engine
        uid, gid = self.registry.uid, self.registry.gid
        t = snap.taken_ns if snap is not None else eng.attached_ns
        first = base(entry.key)
        if j == 0 or j == PAGES_J:
            # The same for every process (their time: when the session was
            # first seen), kept by the kernel as long as the daemon keeps its
            # list of the engine's sessions (LIST_TTL; cp -r out of engines/
            # asked a LOOKUP and a GETATTR of both twice a file).
            a = self._attr(first + j, stat.S_IFDIR | 0o755, uid=uid, gid=gid, nlink=3 if j == 0 else 2,
                           mtime_ns=entry.seen_ns)
            if self.cache.keeps:
                a.entry_timeout = a.attr_timeout = LIST_TTL
            return a
        if j == MANIFEST_J:
            size = len(snap.manifest) if snap is not None and snap.manifest is not None else 0
            return self._attr(first + MANIFEST_J, stat.S_IFREG | 0o644, size, uid, gid, mtime_ns=t)
        a = self._attr(first + PAGE_OFFSET + ix, stat.S_IFREG | 0o644, eng.page_bytes, uid, gid,
                       mtime_ns=t)
        if self.cache.keeps:
            # The name (a page's number is its inode's; getattr and open ask
            # whether it is in the reader's snapshot: a name kept after the
            # request changed costs nothing wrong), and its attributes while
            # every reader sees the same (keep_page_attrs).
            a.entry_timeout = LIST_TTL
            if snap is not None and eng.keep_page_attrs(entry, snap, LIST_TTL):
                a.attr_timeout = LIST_TTL
        return a

    def node(self, node: Node) -> pyfuse3.EntryAttributes:
        a = self._attr(node.ino, node.mode, node.size, node.uid, node.gid,
                       2 + node.subdirs if node.is_dir else 1,
                       node.mtime_ns)
        a.st_atime_ns, a.st_ctime_ns = node.atime_ns, node.ctime_ns
        # A file or folder of a session being copied in changes only by requests
        # through the mount (the kernel sees them) until the session goes
        # (KernelCache.incoming_gone invalidates it): the kernel may keep it, so that cp -r
        # of a session into engines/ costs no LOOKUP and GETATTR of NAME and
        # NAME/pages a file.
        return self._cached(a)

    def bound(self, entry: SessionEntry, pid: int) -> Snapshot | None:
        """Reader *pid*'s snapshot of *entry*, else its latest (None where released)."""
        s = entry.bound.get(pid) or entry.latest
        return s if s is not None and not s.released else None

    async def find_session(self, eng: LiveEngine, name: bytes, pid: int) -> SessionEntry | None:
        """The entry that *name* in engine folder *eng* is for reader *pid*, or None."""
        sname = os.fsdecode(name)
        entry = eng.entries.get(sname)
        if entry is not None:
            mine = entry.bound.get(pid)
            # A reader keeps seeing a session it is reading, even once it ended.
            if entry.incoming is not None or (mine is not None and not mine.released):
                return entry
        names = await eng.names()
        if sname not in names:
            names = await eng.names(max_age=0.05)   # a request that just started
        if sname in names:
            return eng.entry(sname)
        return None
