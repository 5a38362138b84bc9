"""``MNT/engines/``: live sessions of attached engines, and sessions copied into them.

Inode numbers (pffs.fs.routing.INODES: the ENGINES range): key 0 is
``engines/``; each engine and each session name gets a key of its own, and
key *k* owns ``LIVE_BASE + k * SPAN`` and up::

    +0              the folder (engines/NAME or engines/NAME/SESSION)
    +1, +2          a live session's pages/ and manifest.json (in that order:
                    ``cp -r`` copies a folder's entries by inode number, so it
                    copies the pages, storing each as it goes, before the
                    manifest, which then names what was stored without
                    hashing a page again)
    +3 ...          files and folders of a session being copied in (once the
                    engine took it, the live files they were: SessionEntry.taken)
    +PAGE_OFFSET+i  pages/NNNNNN (page i) of a live session

Keys are never reused while the daemon runs, so a re-attached engine gets
new inodes.  What the kernel may keep (each told where it changes):
``engines/`` and ``engines/NAME`` (invalidated when an engine attaches or
detaches); the files and folders of a session being copied in (invalidated
when it goes); a live session's folder, its ``pages/`` and its page names
for LIST_TTL, as long as the daemon keeps its own list of the engine's
sessions.  The attributes of a live session's files are never kept, and
every file is opened with direct_io.  Which snapshot a reader sees is
decided by its process (pffs.live.engines.LiveEngine.snapshot_for).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio
from pyfuse3 import FUSEError

from pffs import manifest as mf
from pffs.fs.files import NOFLUSH
from pffs.fs.routing import LIVE_BASE, LIVE_END, LIVE_HANDLES
from pffs.live.engines import LiveEngine, Registry
from pffs.live.errors import EngineGone, EngineRefused
from pffs.live.handles import _TGID_TTL, DirHandle, Handle, _errors, _pid, _tgids  # noqa: F401 (_TGID_TTL, _tgids)
from pffs.live.incoming import MANIFEST, PAGES, Node
from pffs.live.listings import LIST_TTL, EngineSessions, SessionEntry, Snapshot
from pffs.live.writes import _PARSE_INLINE, IncomingWrites  # noqa: F401 (_PARSE_INLINE: still importable here)
from pffs.namespace import ROOT_INODE, BlobRow, now_ns
from pffs.types import FileHandle, InodeNo, PageIndex

if TYPE_CHECKING:
    from pffs.fs.inodes import Invalidator

log = logging.getLogger("pffs.live")

SPAN = 1 << 25
PAGE_OFFSET = 1 << 24
ENGINES_INO = LIVE_BASE
# File and folder handles are two number spaces (pffs.fs.routing.FILE_HANDLES, DIR_HANDLES).
FH_BASE = DH_BASE = LIVE_HANDLES
ENGINES_NAME = b"engines"
# Seconds the kernel may keep engines/ and engines/NAME (invalidated at every
# attach and detach: see LiveView._cached).
ENGINE_DIRS_TIMEOUT = 300.0
# Pages of a live snapshot stored as blobs ahead of a copy out of it (page_blob),
# and how many are read and stored at once (each holds a page in memory).
COPY_AHEAD = 16
STORE_AT_ONCE = 4
# Where the engine stores the pages itself: pages a request (queued in whole batches), and
# requests at once (the engine's threads take both's pages: none waits between the two).
ENGINE_STORE_BATCH = 8
ENGINE_STORES_AT_ONCE = 2
ROOT_COOKIE = 1 << 62               # readdir cookie of engines/ in the root, past every row id
PAGES_J, MANIFEST_J = 1, 2


class LiveView(IncomingWrites):
    def __init__(self, registry: Registry):
        self.reg = registry
        # Set by pffs.fs.operations.build: a blob of the mount's store made of
        # some bytes (its row), and how to start work in the background.
        self.store_blob: Callable[..., Awaitable[BlobRow]] | None = None   # (bytes, digest=None)
        # ... and blobs an engine put in the store itself given rows (a local store only).
        self.adopt_blobs: Callable[[list[str]], Awaitable[Any]] | None = None
        self.spawn: Callable[..., None] | None = None
        # Pages of live snapshots queued to be stored ahead of copies out of
        # them (_store_ahead), and the tasks storing them.
        self._store_queue: collections.deque[tuple[EngineSessions, Snapshot, int]] = collections.deque()
        self._store_runners = 0
        #: open files, by handle (pffs.fs.virtual.EnginesTree finds them here)
        self.handles: dict[FileHandle, Any] = {}
        self.dirs: dict[FileHandle, DirHandle] = {}
        self._next_fh = FH_BASE
        self._next_dh = DH_BASE
        self._t = now_ns()
        # Set by pffs.fs.operations.build: the kernel cache invalidations.
        self.invalidate: Invalidator | None = None
        registry.changed = self._engine_changed
        registry.incoming_gone = self._incoming_gone
        registry.forget_pages = self._forget_pages

    # -- numbering -----------------------------------------------------------

    @staticmethod
    def owns(ino: InodeNo) -> bool:
        return LIVE_BASE <= ino < LIVE_END

    @staticmethod
    def base(key: int) -> InodeNo:
        return InodeNo(LIVE_BASE + key * SPAN)

    def _resolve(self, ino: InodeNo) -> tuple[str, Any, Any]:
        """(kind, object, extra) for an inode: engines / engine / session / manifest / pages / page / node."""
        if ino == ENGINES_INO:
            return "engines", None, None
        if not self.owns(ino):
            raise FUSEError(errno.ENOENT)
        key, j = divmod(ino - LIVE_BASE, SPAN)
        obj = self.reg.keys.get(key)
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
        # rename completing the copy cannot wait for _incoming_gone): the live one.
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
        a.st_uid = self.reg.uid if uid is None else uid
        a.st_gid = self.reg.gid if gid is None else gid
        a.st_rdev = 0
        a.st_size = size
        a.st_blksize = 1 << 20
        a.st_blocks = (size + 511) // 512
        t = self._t if mtime_ns is None else mtime_ns
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        return a

    def _engines_attr(self) -> pyfuse3.EntryAttributes:
        return self._cached(self._attr(ENGINES_INO, stat.S_IFDIR | 0o755, nlink=2 + len(self.reg.engines)))

    def _engine_attr(self, eng: LiveEngine) -> pyfuse3.EntryAttributes:
        # Owned by the mount's owner, who copies sessions in (not the engine's uid).
        return self._cached(self._attr(self.base(eng.key), stat.S_IFDIR | 0o755, nlink=2,
                                       mtime_ns=eng.attached_ns))

    def _cached(self, a: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        """Kept by the kernel until invalidated (engines/ and engines/NAME: the same
        for every process until an engine attaches or detaches): no LOOKUP and GETATTR."""
        if self.invalidate is not None:
            a.entry_timeout = a.attr_timeout = ENGINE_DIRS_TIMEOUT
        return a

    def _engine_changed(self, name: str, attached: bool) -> None:
        if self.invalidate is None:
            return
        self.invalidate.inode(ENGINES_INO, True)     # (its link count)
        if not attached:
            self.invalidate.entry(ENGINES_INO, os.fsencode(name))
            if not self.reg.engines:
                self.invalidate.entry(ROOT_INODE, ENGINES_NAME)

    def _session_attr(self, entry: SessionEntry, j: int = 0, snap: Snapshot | None = None,
                      ix: int = 0) -> pyfuse3.EntryAttributes:
        eng = entry.engine
        uid, gid = self.reg.uid, self.reg.gid
        t = snap.taken_ns if snap is not None else eng.attached_ns
        base = self.base(entry.key)
        if j == 0 or j == PAGES_J:
            # The same for every process (their time: when the session was
            # first seen), kept by the kernel as long as the daemon keeps its
            # list of the engine's sessions (LIST_TTL; cp -r out of engines/
            # asked a LOOKUP and a GETATTR of both twice a file).
            a = self._attr(base + j, stat.S_IFDIR | 0o755, uid=uid, gid=gid, nlink=3 if j == 0 else 2,
                           mtime_ns=entry.seen_ns)
            if self.invalidate is not None:
                a.entry_timeout = a.attr_timeout = LIST_TTL
            return a
        if j == MANIFEST_J:
            size = len(snap.manifest) if snap is not None and snap.manifest is not None else 0
            return self._attr(base + MANIFEST_J, stat.S_IFREG | 0o644, size, uid, gid, mtime_ns=t)
        a = self._attr(base + PAGE_OFFSET + ix, stat.S_IFREG | 0o644, eng.page_bytes, uid, gid,
                       mtime_ns=t)
        if self.invalidate is not None:
            # The name (a page's number is its inode's; getattr and open ask
            # whether it is in the reader's snapshot: a name kept after the
            # request changed costs nothing wrong), and its attributes while
            # every reader sees the same (keep_page_attrs).
            a.entry_timeout = LIST_TTL
            if snap is not None and eng.keep_page_attrs(entry, snap, LIST_TTL):
                a.attr_timeout = LIST_TTL
        return a

    async def _forget_pages(self, entry: SessionEntry, n: int) -> None:
        if self.invalidate is not None:
            base = self.base(entry.key) + PAGE_OFFSET
            await self.invalidate.attrs_now(range(base, base + n))

    def _node_attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = self._attr(node.ino, node.mode, node.size, node.uid, node.gid,
                       2 + node.subdirs if node.is_dir else 1,
                       node.mtime_ns)
        a.st_atime_ns, a.st_ctime_ns = node.atime_ns, node.ctime_ns
        # A file or folder of a session being copied in changes only by requests
        # through the mount (the kernel sees them) until the session goes
        # (_incoming_gone invalidates it): the kernel may keep it, so that cp -r
        # of a session into engines/ costs no LOOKUP and GETATTR of NAME and
        # NAME/pages a file.
        return self._cached(a)

    def _incoming_gone(self, engine_key: int, key: int, name: str, children: list[bytes]) -> None:
        if self.invalidate is None:
            return
        base = self.base(key)
        self.invalidate.inode(base, True)    # (now a live session's folder, or gone)
        for child in children:
            self.invalidate.entry(base, child)
        self.invalidate.entry(self.base(engine_key), os.fsencode(name))

    def _bound(self, entry: SessionEntry, pid: int) -> Snapshot | None:
        s = entry.bound.get(pid) or entry.latest
        return s if s is not None and not s.released else None

    # -- lookups -----------------------------------------------------------------

    @_errors
    async def lookup(self, parent: InodeNo, name: bytes, ctx) -> pyfuse3.EntryAttributes | None:
        """Attributes of *name* in *parent*; None when *parent* is not ours (the root, mostly)."""
        if parent == ROOT_INODE:
            if name != ENGINES_NAME:
                return None
            if not self.reg.engines:
                raise FUSEError(errno.ENOENT)
            return self._engines_attr()
        if not self.owns(parent):
            return None
        kind, obj, extra = self._resolve(parent)
        if kind == "engines":
            eng = self.reg.engines.get(os.fsdecode(name))
            if eng is None:
                raise FUSEError(errno.ENOENT)
            return self._engine_attr(eng)
        if kind == "engine":
            entry = await self._find_session(obj, name, _pid(ctx))
            if entry is None:
                raise FUSEError(errno.ENOENT)
            if entry.incoming is not None:
                return self._node_attr(entry.incoming.root)
            return self._session_attr(entry, 0, self._bound(entry, _pid(ctx)))
        if kind == "session":
            if name == MANIFEST:
                snap = await obj.engine.snapshot_for(obj, _pid(ctx))
                await obj.engine.manifest_of(snap)
                return self._session_attr(obj, MANIFEST_J, snap)
            if name == PAGES:
                return self._session_attr(obj, PAGES_J, self._bound(obj, _pid(ctx)))
            raise FUSEError(errno.ENOENT)
        if kind == "pages":
            ix = mf.parse_page_name(name)
            if ix is None:
                raise FUSEError(errno.ENOENT)
            snap = await obj.engine.snapshot_for(obj, _pid(ctx))
            if ix >= snap.n_pages:
                raise FUSEError(errno.ENOENT)
            return self._session_attr(obj, PAGE_OFFSET, snap, ix)
        if kind == "node":
            if not extra.is_dir:
                raise FUSEError(errno.ENOTDIR)
            child = extra.children.get(name)
            if child is None:
                raise FUSEError(errno.ENOENT)
            return self._node_attr(child)
        raise FUSEError(errno.ENOTDIR)

    async def _find_session(self, eng: LiveEngine, name: bytes, pid: int) -> SessionEntry | None:
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

    @_errors
    async def getattr(self, ino: InodeNo, ctx) -> pyfuse3.EntryAttributes:
        kind, obj, extra = self._resolve(ino)
        if kind == "engines":
            return self._engines_attr()
        if kind == "engine":
            return self._engine_attr(obj)
        if kind == "node":
            return self._node_attr(extra)
        pid = _pid(ctx)
        if kind == "manifest":
            snap = await obj.engine.snapshot_for(obj, pid)
            await obj.engine.manifest_of(snap)
            return self._session_attr(obj, MANIFEST_J, snap)
        snap = self._bound(obj, pid)
        if kind == "session":
            return self._session_attr(obj, 0, snap)
        if kind == "pages":
            return self._session_attr(obj, PAGES_J, snap)
        if snap is None:
            snap = await obj.engine.snapshot_for(obj, pid)
        if extra >= snap.n_pages:
            raise FUSEError(errno.ENOENT)   # (a name the kernel kept: not in this reader's snapshot)
        return self._session_attr(obj, PAGE_OFFSET, snap, extra)
    # -- folders ---------------------------------------------------------------------

    @_errors
    async def opendir(self, ino: InodeNo, ctx) -> FileHandle:
        kind, obj, node = self._resolve(ino)
        if kind in ("manifest", "page") or (kind == "node" and not node.is_dir):
            raise FUSEError(errno.ENOTDIR)
        dh = DirHandle(ino)
        if kind == "pages":
            dh.snap = await obj.engine.snapshot_for(obj, _pid(ctx), fresh="pages/")
            dh.snap.refs += 1
        fh = FileHandle(self._next_dh)
        self._next_dh += 1
        self.dirs[fh] = dh
        return fh

    def owns_dir_handle(self, fh: FileHandle) -> bool:
        return fh in self.dirs

    def releasedir(self, fh: FileHandle) -> None:
        dh = self.dirs.pop(fh, None)
        if dh is not None and dh.snap is not None:
            dh.snap.refs -= 1
            dh.snap.last_used = time.monotonic()

    @_errors
    async def readdir(self, fh: FileHandle, start_id: int, token) -> None:
        dh = self.dirs[fh]
        kind, obj, node = self._resolve(dh.ino)
        if kind == "engines":
            for eng in sorted(self.reg.engines.values(), key=lambda e: e.key):
                if eng.key > start_id and not pyfuse3.readdir_reply(
                        token, os.fsencode(eng.name), self._engine_attr(eng), eng.key):
                    return
            return
        if kind == "engine":
            names = await obj.names(max_age=0 if start_id == 0 else 1.0)
            entries = {obj.entry(n) for n in names}
            entries |= {e for e in obj.entries.values() if e.incoming is not None}
            for e in sorted(entries, key=lambda e: e.key):
                if e.key <= start_id:
                    continue
                attr = (self._node_attr(e.incoming.root) if e.incoming is not None
                        else self._session_attr(e, 0))
                if not pyfuse3.readdir_reply(token, os.fsencode(e.name), attr, e.key):
                    return
            return
        if kind == "session":
            snap = obj.latest if obj.latest is not None and not obj.latest.released else None
            items = [(PAGES, self._session_attr(obj, PAGES_J, snap), PAGES_J),
                     (MANIFEST, self._session_attr(obj, MANIFEST_J, snap), MANIFEST_J)]
            for name, attr, cookie in items:
                if cookie > start_id and not pyfuse3.readdir_reply(token, name, attr, cookie):
                    return
            return
        if kind == "pages":
            snap = dh.snap
            assert snap is not None     # opendir() took it
            if snap.released:
                raise FUSEError(errno.EIO)
            for ix in range(start_id, snap.n_pages):
                if not pyfuse3.readdir_reply(token, mf.page_name(ix).encode(),
                                             self._session_attr(obj, PAGE_OFFSET, snap, ix), ix + 1):
                    return
            return
        if kind == "node":
            base = self.base(obj.key)
            for child in sorted(node.children.values(), key=lambda c: c.ino):
                cookie = child.ino - base
                if cookie > start_id and not pyfuse3.readdir_reply(
                        token, child.name, self._node_attr(child), cookie):
                    return
            return
        raise FUSEError(errno.ENOTDIR)

    def readdir_root(self, start_id: int, token) -> None:
        """The ``engines`` entry at the end of the root listing, while engines are attached."""
        if self.reg.engines and start_id < ROOT_COOKIE:
            pyfuse3.readdir_reply(token, ENGINES_NAME, self._engines_attr(), ROOT_COOKIE)

    # -- files -----------------------------------------------------------------------

    def _new_handle(self, h: Handle) -> FileHandle:
        fh = FileHandle(self._next_fh)
        self._next_fh += 1
        self.handles[fh] = h
        return fh

    @_errors
    async def open(self, ino: InodeNo, flags: int, ctx) -> pyfuse3.FileInfo:
        kind, obj, extra = self._resolve(ino)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if kind in ("engines", "engine", "session", "pages") or (kind == "node" and extra.is_dir):
            raise FUSEError(errno.EISDIR)
        if kind == "node":
            inc = obj.incoming
            if writable:
                self._check_gathering(inc)
                if flags & os.O_TRUNC and extra.size:
                    self._account(obj.engine, inc.truncate(extra, 0))
            h = Handle("file", obj, node=extra, inc=inc, writable=writable)
        else:
            if writable:
                raise FUSEError(errno.EACCES)
            pid = _pid(ctx)
            snap = await obj.engine.snapshot_for(obj, pid, fresh="manifest.json" if kind == "manifest" else "")
            if kind == "manifest":
                await obj.engine.manifest_of(snap)
            elif extra >= snap.n_pages:
                raise FUSEError(errno.ENOENT)
            snap.refs += 1
            h = Handle(kind, obj, snap, PageIndex(extra or 0))
        fh = self._new_handle(h)
        if NOFLUSH and not writable:
            # (Nothing to do at a reader's close: no FLUSH request for it.)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, noflush=True)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    @_errors
    async def read(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        snap = h.snap
        if h.kind == "manifest":
            # open() took the snapshot and waited for its manifest.json, which stays.
            assert snap is not None and snap.manifest is not None
            return snap.manifest[off:off + size]
        if h.kind == "page":
            assert snap is not None     # open() took it
            eng = h.entry.engine
            if snap.released:
                raise EngineGone(f"engine {eng.name} is gone")
            return await eng.read(snap, h.ix, off, size)
        node = h.node
        assert node is not None         # a file being copied in: create() or open() gave it
        if node.blob is not None:
            return (await self.fetch_blob(node.blob))[off:off + size]    # (held by name)
        data = node.data
        return bytes(data[off:off + size])

    async def page_blob(self, h: Handle) -> tuple[str, int, BlobRow] | None:
        """copy_file_range out of a live session (cp -r of it): for a page, the
        page stored as a blob of the mount's store, for the copy to name (None
        where that failed: the bytes are copied).  COPY_AHEAD pages ahead are
        stored meanwhile (every page once its manifest.json is copied), in
        parallel though cp copies one file at a time.  cp copies pages/ first
        (inode order): manifest.json, copied last, lists their digests."""
        snap = h.snap
        if h.kind not in ("page", "manifest") or snap is None or self.store_blob is None \
                or snap.released:
            return None
        eng = h.entry.engine
        if h.kind == "manifest":
            if self.spawn is not None:
                self._store_ahead(eng, snap, range(snap.n_pages))
            return None     # (its bytes are copied, and checked where they land)
        if self.spawn is None:
            if h.ix not in snap.storing:
                ev = snap.storing[h.ix] = trio.Event()
                await self._store_page(eng, snap, h.ix, ev)
        else:
            # Whole batches where the engine stores them (else a request a page, once cp moved on)
            b = ENGINE_STORE_BATCH if self.adopt_blobs is not None and eng.stores else 1
            self._store_ahead(eng, snap, range(h.ix, min(snap.n_pages, -(-(h.ix + COPY_AHEAD) // b) * b)))
        await snap.storing[h.ix].wait()
        row = snap.blobs.get(h.ix)
        return None if row is None else (row.digest, row.raw_size, row)

    def _store_ahead(self, eng: EngineSessions, snap: Snapshot, ixs: range) -> None:
        """Queue pages *ixs* to be stored, in order: tasks take them first come
        first served, so the page a copy asks for next is among the first
        stored (a task a page stored them from the last page back)."""
        assert self.spawn is not None
        for j in ixs:
            if j not in snap.storing:
                snap.storing[j] = trio.Event()
                self._store_queue.append((eng, snap, j))
        at_once = ENGINE_STORES_AT_ONCE if self.adopt_blobs is not None and eng.stores else STORE_AT_ONCE
        while self._store_runners < min(at_once, len(self._store_queue)):
            self._store_runners += 1
            self.spawn(self._store_runner)

    async def _store_runner(self) -> None:
        try:
            while self._store_queue:
                eng, snap, ix = self._store_queue.popleft()
                if self.adopt_blobs is not None and eng.stores:
                    ixs = [ix]
                    while self._store_queue and len(ixs) < ENGINE_STORE_BATCH \
                            and self._store_queue[0][1] is snap:
                        ixs.append(self._store_queue.popleft()[2])
                    await self._engine_stores(eng, snap, ixs)
                else:
                    await self._store_page(eng, snap, ix, snap.storing[ix])
        finally:
            self._store_runners -= 1

    async def _engine_stores(self, eng: EngineSessions, snap: Snapshot, ixs: list[int]) -> None:
        """Pages *ixs* stored by the engine itself, straight into the store as its
        page-out writes them (gathered, hashed and compressed on its threads, no
        byte through staging or this process), then adopted; stored here from
        staging instead where the engine cannot reach the store."""
        assert self.adopt_blobs is not None
        left = set(ixs)
        try:
            rows = await eng.store_pages(snap, [PageIndex(ix) for ix in ixs])
            await self.adopt_blobs([row.digest for _, row in rows])
            for j, row in rows:
                snap.blobs[j] = row
                self.reg.counts["pages_stored"] += 1
                snap.storing[j].set()
                left.discard(j)
        except EngineRefused as e:
            if not eng.stores:      # (it cannot reach the store: this process stores them)
                for k in ixs:
                    left.discard(k)
                    await self._store_page(eng, snap, k, snap.storing[k])
            else:
                log.debug("engines/%s/%s: pages not stored ahead of their copy: %s", eng.name,
                          snap.session, e)
        except Exception as e:  # (the engine went, the store is full): the copies move the bytes
            log.debug("engines/%s/%s: pages not stored ahead of their copy: %s", eng.name, snap.session, e)
        finally:
            for k in left:
                snap.storing[k].set()

    async def _store_page(self, eng: EngineSessions, snap: Snapshot, ix: int, done: trio.Event) -> None:
        assert self.store_blob is not None
        try:
            # Hashed and compressed where the engine gathered it (no copy); not
            # hashed again where manifest.json listed it already (a snapshot's
            # pages read the same bytes for as long as it lives).  The pages
            # queued next are gathered with it, a batch a request to the engine.
            digest = snap.skeleton.pages[ix] if snap.manifest is not None and snap.skeleton else None
            # The batch after is asked for meanwhile, so that it is in staging
            # when its turn comes (else every store waits on each batch's gather).
            b = eng.gather_batch()
            ahead = [PageIndex(j) for j in range(ix + 1, min(snap.n_pages, ix + 2 * b))
                     if j in snap.storing and j not in snap.blobs]
            eng.gather_soon(snap, [PageIndex(ix), *ahead[:b - 1]])
            eng.gather_soon(snap, ahead[b - 1:])
            snap.blobs[ix] = await eng.with_page(
                snap, PageIndex(ix), functools.partial(self.store_blob, digest=digest), ahead[:b - 1])
            self.reg.counts["pages_stored"] += 1
        except Exception as e:  # (the engine went, the store is full): the copy moves the bytes, and says why
            log.debug("engines/%s/%s: page %d not stored ahead of its copy: %s", eng.name,
                      snap.session, ix, e)
        finally:
            done.set()

    def release(self, h: Handle) -> None:
        if h.snap is not None:
            h.snap.refs -= 1
            h.snap.last_used = time.monotonic()
