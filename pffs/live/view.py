"""``MNT/engines/``: live sessions of attached engines, and sessions copied into them.

Inode numbers (all above the namespace's, in VirtualTree's range): key 0 is
``engines/``; each engine and each session name gets a key of its own, and
key *k* owns ``LIVE_BASE + k * SPAN`` and up::

    +0              the folder (engines/NAME or engines/NAME/SESSION)
    +1, +2          a live session's manifest.json and pages/
    +3 ...          files and folders of a session being copied in
    +PAGE_OFFSET+i  pages/NNNNNN (page i) of a live session

Keys are never reused while the daemon runs, so a re-attached engine gets
new inodes.  Nothing here is cached by the kernel: attr and entry timeouts
are 0 and every file is opened with direct_io.  Which snapshot a reader sees
is decided by its process (pffs.live.engines.LiveEngine.snapshot_for).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio
from pyfuse3 import FUSEError

from .. import manifest as mf
from ..fs.virtual import VIRT_BASE
from ..namespace import ROOT_INODE, now_ns
from ..types import FileHandle, InodeNo, PageIndex
from .engines import (INCOMING_LIMIT, EngineError, EngineGone, EngineRefused, LiveEngine,
                      SessionEntry, Snapshot)
from .incoming import MANIFEST, PAGES, IncomingSession, Node
from .protocol import valid_name

if TYPE_CHECKING:
    from .server import LiveEngines

log = logging.getLogger("pffs.live")

LIVE_BASE = VIRT_BASE + (1 << 60)
LIVE_END = VIRT_BASE + (1 << 61)
SPAN = 1 << 25
PAGE_OFFSET = 1 << 24
ENGINES_INO = LIVE_BASE
# File and folder handles are two number spaces; VirtualTree's own start at VIRT_BASE.
FH_BASE = VIRT_BASE + (1 << 61)
DH_BASE = VIRT_BASE + (1 << 61)
ENGINES_NAME = b"engines"
ROOT_COOKIE = 1 << 62               # readdir cookie of engines/ in the root, past every row id
MANIFEST_J, PAGES_J = 1, 2
# Manifests above this size are parsed in a worker thread.
_PARSE_INLINE = 1 << 20


def _errors(fn):
    """Engine failures become the errno a reader or writer gets."""
    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        except EngineError as e:
            raise FUSEError(e.errno) from None
    return wrapper


@dataclass(eq=False)
class Handle:
    kind: str                      # "manifest", "page" or "file" (a file being copied in)
    entry: SessionEntry
    snap: Snapshot | None = None
    ix: PageIndex = PageIndex(0)
    node: Node | None = None
    inc: IncomingSession | None = None
    writable: bool = False


@dataclass(eq=False)
class DirHandle:
    ino: InodeNo
    snap: Snapshot | None = None


_TGID_TTL = 1.0
_tgids: dict[int, tuple[int, float]] = {}


def _pid(ctx) -> int:
    """The process (not thread) a request comes from: readers are told apart by it.

    FUSE gives the calling thread's id; threads of one reader (a page-in
    reading pages from worker threads) must see one snapshot.  The thread ->
    process map is cached for a second (a thread id is not reused sooner).
    """
    tid = getattr(ctx, "pid", 0) if ctx is not None else 0
    if tid <= 0:
        return 0
    now = time.monotonic()
    got = _tgids.get(tid)
    if got is not None and now - got[1] < _TGID_TTL:
        return got[0]
    tgid = tid
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    tgid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    if len(_tgids) > 4096:
        _tgids.clear()
    _tgids[tid] = (tgid, now)
    return tgid


class LiveView:
    def __init__(self, registry: "LiveEngines"):
        self.reg = registry
        #: shared with VirtualTree, whose read/release/flush routes find them there
        self.handles: dict[FileHandle, Any] = {}
        self.dirs: dict[FileHandle, DirHandle] = {}
        self._next_fh = FH_BASE
        self._next_dh = DH_BASE
        self._t = now_ns()

    # -- numbering -----------------------------------------------------------

    @staticmethod
    def owns(ino: InodeNo) -> bool:
        return LIVE_BASE <= ino < LIVE_END

    @staticmethod
    def base(key: int) -> InodeNo:
        return InodeNo(LIVE_BASE + key * SPAN)

    def _resolve(self, ino: InodeNo):
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
        raise FUSEError(errno.ENOENT)

    # -- attributes ------------------------------------------------------------

    def _attr(self, ino: InodeNo, mode: int, size: int = 0, uid: int | None = None,
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
        return self._attr(ENGINES_INO, stat.S_IFDIR | 0o755, nlink=2 + len(self.reg.engines))

    def _engine_attr(self, eng: LiveEngine) -> pyfuse3.EntryAttributes:
        # Owned by the mount's owner (not the engine's uid, which may be root):
        # that is who copies sessions in.
        return self._attr(self.base(eng.key), stat.S_IFDIR | 0o755, nlink=2, mtime_ns=eng.attached_ns)

    def _session_attr(self, entry: SessionEntry, j: int = 0, snap: Snapshot | None = None,
                      ix: int = 0) -> pyfuse3.EntryAttributes:
        eng = entry.engine
        uid, gid = self.reg.uid, self.reg.gid
        t = snap.taken_ns if snap is not None else eng.attached_ns
        base = self.base(entry.key)
        if j == 0:
            return self._attr(base, stat.S_IFDIR | 0o755, uid=uid, gid=gid, nlink=3, mtime_ns=t)
        if j == PAGES_J:
            return self._attr(base + PAGES_J, stat.S_IFDIR | 0o755, uid=uid, gid=gid, nlink=2, mtime_ns=t)
        if j == MANIFEST_J:
            size = len(snap.manifest) if snap is not None and snap.manifest is not None else 0
            return self._attr(base + MANIFEST_J, stat.S_IFREG | 0o644, size, uid, gid, mtime_ns=t)
        return self._attr(base + PAGE_OFFSET + ix, stat.S_IFREG | 0o644, eng.page_bytes, uid, gid,
                          mtime_ns=t)

    def _node_attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = self._attr(node.ino, node.mode, node.size, node.uid, node.gid,
                       2 + sum(c.is_dir for c in node.children.values()) if node.is_dir else 1,
                       node.mtime_ns)
        a.st_atime_ns, a.st_ctime_ns = node.atime_ns, node.ctime_ns
        return a

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
                snap = await obj.engine.snapshot_for(obj, _pid(ctx), fresh=False)
                await obj.engine.manifest_of(snap)
                return self._session_attr(obj, MANIFEST_J, snap)
            if name == PAGES:
                return self._session_attr(obj, PAGES_J, self._bound(obj, _pid(ctx)))
            raise FUSEError(errno.ENOENT)
        if kind == "pages":
            ix = mf.parse_page_name(name)
            if ix is None:
                raise FUSEError(errno.ENOENT)
            snap = await obj.engine.snapshot_for(obj, _pid(ctx), fresh=False)
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
            snap = await obj.engine.snapshot_for(obj, pid, fresh=False)
            await obj.engine.manifest_of(snap)
            return self._session_attr(obj, MANIFEST_J, snap)
        snap = self._bound(obj, pid)
        if kind == "session":
            return self._session_attr(obj, 0, snap)
        if kind == "pages":
            return self._session_attr(obj, PAGES_J, snap)
        return self._session_attr(obj, PAGE_OFFSET, snap, extra)

    @_errors
    async def setattr(self, ino: InodeNo, attr, fields, fh, ctx) -> pyfuse3.EntryAttributes:
        kind, obj, node = self._resolve(ino)
        if kind != "node":
            if fields.update_size:
                raise FUSEError(errno.EPERM)
            # Live files keep their modes and times; tools that copy a
            # session in (cp -a, rsync -a) set them last and must not fail.
            return await self.getattr(ino, ctx)
        inc = obj.incoming
        if fields.update_size:
            if node.is_dir:
                raise FUSEError(errno.EISDIR)
            self._check_gathering(inc)
            grow = attr.st_size - node.size
            self._charge(obj.engine, grow)
            inc.truncate(node, attr.st_size)
            self._account(obj.engine, grow)
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            node.uid = attr.st_uid
        if fields.update_gid:
            node.gid = attr.st_gid
        if fields.update_atime:
            node.atime_ns = attr.st_atime_ns
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        node.ctime_ns = attr.st_ctime_ns if fields.update_ctime else now_ns()
        return self._node_attr(node)

    # -- folders ---------------------------------------------------------------------

    @_errors
    async def opendir(self, ino: InodeNo, ctx) -> FileHandle:
        kind, obj, node = self._resolve(ino)
        if kind in ("manifest", "page") or (kind == "node" and not node.is_dir):
            raise FUSEError(errno.ENOTDIR)
        dh = DirHandle(ino)
        if kind == "pages":
            dh.snap = await obj.engine.snapshot_for(obj, _pid(ctx), fresh=False)
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
            items = [(MANIFEST, self._session_attr(obj, MANIFEST_J, snap), MANIFEST_J),
                     (PAGES, self._session_attr(obj, PAGES_J, snap), PAGES_J)]
            for name, attr, cookie in items:
                if cookie > start_id and not pyfuse3.readdir_reply(token, name, attr, cookie):
                    return
            return
        if kind == "pages":
            snap = dh.snap
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
            snap = await obj.engine.snapshot_for(obj, pid, fresh=kind == "manifest")
            if kind == "manifest":
                await obj.engine.manifest_of(snap)
            elif extra >= snap.n_pages:
                raise FUSEError(errno.ENOENT)
            snap.refs += 1
            h = Handle(kind, obj, snap, extra or 0)
        return pyfuse3.FileInfo(fh=self._new_handle(h), direct_io=True, keep_cache=False)

    @_errors
    async def read(self, h: Handle, off: int, size: int) -> bytes:
        if h.kind == "manifest":
            return h.snap.manifest[off:off + size]
        if h.kind == "page":
            eng = h.entry.engine
            if h.snap.released:
                raise EngineGone(f"engine {eng.name} is gone")
            return await eng.read(h.snap, h.ix, off, size)
        data = h.node.data
        return bytes(data[off:off + size])

    @_errors
    async def write(self, h: Handle, off: int, buf: bytes) -> int:
        if not h.writable:
            raise FUSEError(errno.EBADF)
        entry, node, inc = h.entry, h.node, h.inc
        if inc.state == "gone":
            raise FUSEError(errno.ENOENT)   # paged in or refused meanwhile
        self._check_gathering(inc)
        grow = max(0, off + len(buf) - node.size)
        self._charge(entry.engine, grow)
        self._account(entry.engine, inc.write(node, off, buf))
        return len(buf)

    @_errors
    async def flush(self, h: Handle) -> None:
        """The close of a file being copied in: it has arrived; the last one pages the session in."""
        if h.kind != "file" or not h.writable:
            return
        entry, node, inc = h.entry, h.node, h.inc
        if inc.state != "gathering" or not node.linked:
            return
        if not (node.dirty or not node.arrived):
            return
        inc.closed(node)
        if inc.is_manifest(node):
            try:
                m, data, version = await self._parse_manifest(node, self._path(entry, node), "close")
            except FUSEError:
                inc.set_manifest(None, None)
                raise
            if inc.is_manifest(node) and node.linked and node.arrived and node.version == version:
                inc.set_manifest(m, data)
        if inc.complete():
            await self._page_in(entry, self._path(entry, node), "close")

    def release(self, h: Handle) -> None:
        if h.snap is not None:
            h.snap.refs -= 1
            h.snap.last_used = time.monotonic()

    # -- copying a session in ------------------------------------------------------------

    def _path(self, entry: SessionEntry, node: Node | None = None) -> str:
        parts = []
        while node is not None and node.parent is not None:
            parts.append(os.fsdecode(node.name))
            node = node.parent
        return "/".join(["engines", entry.engine.name, entry.name, *reversed(parts)])

    @staticmethod
    def _check_gathering(inc: IncomingSession) -> None:
        if inc.state != "gathering":
            raise FUSEError(errno.EBUSY)

    def _charge(self, eng: LiveEngine, grow: int) -> None:
        if grow <= 0:
            return
        nb = eng.reg.info.get("num_blocks")
        own = (nb * eng.page_bytes + (64 << 20)) if isinstance(nb, int) and nb > 0 else INCOMING_LIMIT
        if eng.incoming_bytes + grow > own or self.reg.incoming_bytes + grow > INCOMING_LIMIT:
            log.warning("write into engines/%s: sessions being copied in would hold %d bytes "
                        "(engine pool %s, daemon limit %d)", eng.name, eng.incoming_bytes + grow,
                        own, INCOMING_LIMIT)
            raise FUSEError(errno.ENOSPC)

    def _account(self, eng: LiveEngine, grow: int) -> None:
        eng.incoming_bytes += grow
        self.reg.incoming_bytes += grow

    async def _parse_manifest(self, node: Node, where: str, op: str
                              ) -> tuple[mf.Manifest, bytes, int]:
        """Parse a manifest being copied in: (manifest, bytes, node version) or EINVAL, logged."""
        version = node.version
        data = bytes(node.data)
        try:
            if len(data) > _PARSE_INLINE:
                m = await trio.to_thread.run_sync(mf.parse, data)
            else:
                m = mf.parse(data)
        except mf.ManifestError as e:
            log.warning("%s %s: refused manifest: %s", op, where, e)
            raise FUSEError(errno.EINVAL) from None
        return m, data, version

    async def _page_in(self, entry: SessionEntry, where: str, op: str) -> None:
        eng = entry.engine
        try:
            seqs = await eng.page_in(entry)
        except EngineRefused as e:
            log.warning("%s %s: engine %s refused the session, folder removed: %s", op, where,
                        eng.name, e)
            raise FUSEError(e.errno) from None
        except EngineError as e:
            log.warning("%s %s: page-in into engine %s failed: %s", op, where, eng.name, e)
            raise FUSEError(errno.EIO) from None
        log.info("engines/%s/%s: paged in (sequences %s)", eng.name, entry.name, ", ".join(seqs))

    async def save(self, ino: InodeNo, path: str, where: str) -> int:
        """``pffs fork engines/E/S DST``: engine E pages S out at *path* itself."""
        kind, entry, _ = self._resolve(ino)
        if kind != "session":
            raise FUSEError(errno.EPERM)
        if entry.incoming is not None:
            raise FUSEError(errno.EBUSY)
        eng = entry.engine
        try:
            n = await eng.save(entry.name, path)
        except EngineRefused as e:
            log.warning("save engines/%s/%s as %s: the engine refused: %s", eng.name, entry.name, where, e)
            raise FUSEError(e.errno) from None
        except EngineError as e:
            log.warning("save engines/%s/%s as %s failed: %s", eng.name, entry.name, where, e)
            raise FUSEError(errno.EIO) from None
        log.info("engines/%s/%s: saved as %s (%d pages)", eng.name, entry.name, where, n)
        return n

    async def load(self, ino: InodeNo, name: str, path: str, where: str, ctx) -> list[str]:
        """``pffs fork SRC engines/E[/NAME]``: engine E pages the session at *path* in itself."""
        kind, eng, _ = self._resolve(ino)
        if kind != "engine":
            raise FUSEError(errno.EPERM)
        if not valid_name(name):
            raise FUSEError(errno.EINVAL)
        entry = eng.entries.get(name)
        if entry is not None and entry.incoming is not None:
            raise FUSEError(errno.EEXIST)   # being copied in (a live name the engine refuses itself)
        try:
            seqs = await eng.load(name, path)
        except EngineRefused as e:
            log.warning("load %s into engines/%s/%s: the engine refused: %s", where, eng.name, name, e)
            raise FUSEError(e.errno) from None
        except EngineError as e:
            log.warning("load %s into engines/%s/%s failed: %s", where, eng.name, name, e)
            raise FUSEError(errno.EIO) from None
        log.info("engines/%s/%s: paged in from %s (sequences %s)", eng.name, name, where, ", ".join(seqs))
        return seqs

    def _incoming_parent(self, parent: InodeNo) -> tuple[SessionEntry, IncomingSession, Node]:
        kind, obj, node = self._resolve(parent)
        if kind != "node":
            raise FUSEError(errno.EACCES if kind in ("session", "pages") else errno.EPERM)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        inc = obj.incoming
        self._check_gathering(inc)
        return obj, inc, node

    @_errors
    async def mkdir(self, parent: InodeNo, name: bytes, mode: int, ctx) -> pyfuse3.EntryAttributes:
        mode = stat.S_IMODE(mode) & ~ctx.umask
        kind, obj, _ = self._resolve(parent)
        if kind == "engine":
            sname = os.fsdecode(name)
            if not valid_name(sname):
                raise FUSEError(errno.EINVAL)
            if await self._find_session(obj, name, _pid(ctx)) is not None:
                raise FUSEError(errno.EEXIST)
            entry = obj.entry(sname)
            if entry.incoming is not None:
                raise FUSEError(errno.EEXIST)   # made while we asked the engine
            entry.incoming = IncomingSession(sname, self.base(entry.key), mode, ctx.uid, ctx.gid)
            return self._node_attr(entry.incoming.root)
        _, inc, node = self._incoming_parent(parent)
        if name in node.children:
            raise FUSEError(errno.EEXIST)
        return self._node_attr(inc.make(node, name, stat.S_IFDIR | mode, ctx.uid, ctx.gid))

    @_errors
    async def create(self, parent: InodeNo, name: bytes, mode: int, flags: int, ctx):
        entry, inc, node = self._incoming_parent(parent)
        if name in node.children:
            raise FUSEError(errno.EEXIST)
        child = inc.make(node, name, stat.S_IFREG | (stat.S_IMODE(mode) & ~ctx.umask), ctx.uid, ctx.gid)
        fh = self._new_handle(Handle("file", entry, node=child, inc=inc,
                                     writable=(flags & os.O_ACCMODE) != os.O_RDONLY))
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False), self._node_attr(child)

    @_errors
    async def unlink(self, parent: InodeNo, name: bytes, ctx) -> None:
        entry, inc, node = self._incoming_parent(parent)
        child = node.children.get(name)
        if child is None:
            raise FUSEError(errno.ENOENT)
        if child.is_dir:
            raise FUSEError(errno.EISDIR)
        self._account(entry.engine, -inc.detach(child))

    @_errors
    async def rmdir(self, parent: InodeNo, name: bytes, ctx) -> None:
        kind, obj, _ = self._resolve(parent)
        if kind == "engine":
            entry = obj.entries.get(os.fsdecode(name))
            if entry is None or entry.incoming is None:
                # Live sessions end when their requests do, not by rmdir.
                raise FUSEError(errno.EPERM if entry is not None else errno.ENOENT)
            if entry.incoming.root.children:
                raise FUSEError(errno.ENOTEMPTY)
            if entry.incoming.state != "gathering":
                raise FUSEError(errno.EBUSY)
            obj.drop_incoming(entry)
            return
        entry, inc, node = self._incoming_parent(parent)
        child = node.children.get(name)
        if child is None:
            raise FUSEError(errno.ENOENT)
        if not child.is_dir:
            raise FUSEError(errno.ENOTDIR)
        if child.children:
            raise FUSEError(errno.ENOTEMPTY)
        inc.detach(child)

    @_errors
    async def rename(self, p_old: InodeNo, n_old: bytes, p_new: InodeNo, n_new: bytes, flags: int, ctx) -> None:
        if not (self.owns(p_old) and self.owns(p_new)):
            raise FUSEError(errno.EXDEV)
        entry, inc, src_dir = self._incoming_parent(p_old)
        entry2, inc2, dst_dir = self._incoming_parent(p_new)
        if inc2 is not inc:
            raise FUSEError(errno.EXDEV)
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise FUSEError(errno.EINVAL)
        node = src_dir.children.get(n_old)
        if node is None:
            raise FUSEError(errno.ENOENT)
        p = dst_dir
        while p is not None:
            if p is node:
                raise FUSEError(errno.EINVAL)   # into itself
            p = p.parent
        target = dst_dir.children.get(n_new)
        if target is node:
            return
        if target is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise FUSEError(errno.EEXIST)
            if target.is_dir and not node.is_dir:
                raise FUSEError(errno.EISDIR)
            if node.is_dir and not target.is_dir:
                raise FUSEError(errno.ENOTDIR)
            if target.is_dir and target.children:
                raise FUSEError(errno.ENOTEMPTY)
        becomes_manifest = dst_dir is inc.root and n_new == MANIFEST and not node.is_dir
        checked = None
        if becomes_manifest:
            # Validated as it takes the name, like any manifest.json (SPEC §3.3).
            checked = await self._parse_manifest(
                node, self._path(entry, dst_dir) + "/" + mf.MANIFEST_NAME, "rename")
            if (inc.state != "gathering" or src_dir.children.get(n_old) is not node
                    or dst_dir.children.get(n_new) is not target):
                raise FUSEError(errno.EBUSY)
        if target is not None:
            self._account(entry.engine, -inc.detach(target))
        inc.move(node, dst_dir, n_new)
        if checked is not None and node.arrived and node.version == checked[2]:
            inc.set_manifest(checked[0], checked[1])
        if inc.complete():
            await self._page_in(entry, self._path(entry, node), "rename")
