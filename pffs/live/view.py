"""``MNT/engines/``: live sessions of attached engines, and sessions copied into them.

:class:`EnginesTree` is the tree (pffs.fs.routing.Tree) that answers every
FUSE request under ``engines/``: it turns inode numbers (:mod:`.attrs`,
:mod:`.numbering`) and handles into engines, sessions and files, reads live
sessions through their engine (:mod:`.engines`), and hands the files of
sessions being copied in to :class:`pffs.live.copyin.CopyIn` and copies out
of live sessions to :class:`pffs.live.copyout.CopyOut`.  ``pffs fork`` into
and out of an engine folder arrives as an extended attribute (setxattr).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time

import pyfuse3
import trio
from pyfuse3 import (
    EntryAttributes,
    FileHandleT,
    FileInfo,
    FileNameT,
    FlagT,
    FUSEError,
    InodeT,
    ModeT,
    ReaddirToken,
    RequestContext,
    SetattrFields,
    XAttrNameT,
)

from pffs import manifest as mf
from pffs.fs.files import NOFLUSH
from pffs.fs.manifests import Manifests
from pffs.fs.routing import Tree
from pffs.live.attrs import LiveAttrs
from pffs.live.copyin import CopyIn, check_gathering
from pffs.live.copyout import CopyOut
from pffs.live.engines import Registry, SessionEntry
from pffs.live.errors import EngineError, EngineGone, EngineRefused
from pffs.live.handles import DirHandle, Handle, LiveStore, engine_errors, reader_pid
from pffs.live.incoming import MANIFEST, PAGES, IncomingSession, Node
from pffs.live.numbering import (
    DH_BASE,
    ENGINES_NAME,
    FH_BASE,
    MANIFEST_J,
    PAGE_OFFSET,
    PAGES_J,
    ROOT_COOKIE,
    base,
    owns,
)
from pffs.live.protocol import valid_name
from pffs.names import LOAD_XATTR_B as LOAD_XATTR
from pffs.names import SAVE_XATTR_B as SAVE_XATTR
from pffs.namespace import ROOT_INODE, BlobRow
from pffs.types import InodeNo, PageIndex

log = logging.getLogger("pffs.live")


class EnginesTree(Tree):
    """``engines/``: attached engines' live sessions (read, and copied out),
    sessions copied into an engine, and ``pffs fork`` into and out of one."""

    def __init__(self, registry: Registry, store: LiveStore, manifests: Manifests, nursery: trio.Nursery):
        self.registry = registry
        self.attrs = LiveAttrs(registry, registry.cache)
        self.copy_in = CopyIn(registry, store, registry.cache)
        self.copy_out = CopyOut(store, registry.counts, nursery)
        self.store = store
        # Paths of ``pffs fork`` checked as the namespace's (resolve_new, resolve_readable).
        self.manifests = manifests
        self.handles: dict[FileHandleT, Handle] = {}      # open files
        self.dirs: dict[FileHandleT, DirHandle] = {}      # open folders
        self._next_fh = FH_BASE
        self._next_dh = DH_BASE

    # -- names and attributes ----------------------------------------------------------

    @engine_errors
    async def lookup(self, parent: InodeT, name: FileNameT, ctx: RequestContext | None) -> EntryAttributes:
        if parent == ROOT_INODE:
            if name != ENGINES_NAME or not self.registry.engines:
                raise FUSEError(errno.ENOENT)
            return self.attrs.engines()
        if not owns(parent):
            raise FUSEError(errno.ENOENT)
        kind, obj, extra = self.attrs.resolve(InodeNo(parent))
        if kind == "engines":
            eng = self.registry.engines.get(os.fsdecode(name))
            if eng is None:
                raise FUSEError(errno.ENOENT)
            return self.attrs.engine(eng)
        if kind == "engine":
            entry = await self.attrs.find_session(obj, name, reader_pid(ctx))
            if entry is None:
                raise FUSEError(errno.ENOENT)
            if entry.incoming is not None:
                return self.attrs.node(entry.incoming.root)
            return self.attrs.session(entry, 0, self.attrs.bound(entry, reader_pid(ctx)))
        if kind == "session":
            if name == MANIFEST:
                snap = await obj.engine.snapshot_for(obj, reader_pid(ctx))
                await obj.engine.manifest_of(snap)
                return self.attrs.session(obj, MANIFEST_J, snap)
            if name == PAGES:
                return self.attrs.session(obj, PAGES_J, self.attrs.bound(obj, reader_pid(ctx)))
            raise FUSEError(errno.ENOENT)
        if kind == "pages":
            ix = mf.parse_page_name(name)
            if ix is None:
                raise FUSEError(errno.ENOENT)
            snap = await obj.engine.snapshot_for(obj, reader_pid(ctx))
            if ix >= snap.n_pages:
                raise FUSEError(errno.ENOENT)
            return self.attrs.session(obj, PAGE_OFFSET, snap, ix)
        if kind == "node":
            if not extra.is_dir:
                raise FUSEError(errno.ENOTDIR)
            child = extra.children.get(name)
            if child is None:
                raise FUSEError(errno.ENOENT)
            return self.attrs.node(child)
        raise FUSEError(errno.ENOTDIR)

    @engine_errors
    async def getattr(self, inode: InodeT, ctx: RequestContext | None) -> EntryAttributes:
        kind, obj, extra = self.attrs.resolve(InodeNo(inode))
        if kind == "engines":
            return self.attrs.engines()
        if kind == "engine":
            return self.attrs.engine(obj)
        if kind == "node":
            return self.attrs.node(extra)
        pid = reader_pid(ctx)
        if kind == "manifest":
            snap = await obj.engine.snapshot_for(obj, pid)
            await obj.engine.manifest_of(snap)
            return self.attrs.session(obj, MANIFEST_J, snap)
        bound = self.attrs.bound(obj, pid)
        if kind == "session":
            return self.attrs.session(obj, 0, bound)
        if kind == "pages":
            return self.attrs.session(obj, PAGES_J, bound)
        snap = bound if bound is not None else await obj.engine.snapshot_for(obj, pid)
        if extra >= snap.n_pages:
            raise FUSEError(errno.ENOENT)   # (a name the kernel kept: not in this reader's snapshot)
        return self.attrs.session(obj, PAGE_OFFSET, snap, extra)

    @engine_errors
    async def setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields,
                      fh: FileHandleT | None, ctx: RequestContext) -> EntryAttributes:
        kind, obj, node = self.attrs.resolve(InodeNo(inode))
        if kind != "node":
            if fields.update_size:
                raise FUSEError(errno.EPERM)
            # Live files keep their modes and times; tools that copy a
            # session in (cp -a, rsync -a) set them last and must not fail.
            return await self.getattr(inode, ctx)
        await self.copy_in.setattr(obj, node, attr, fields)
        return self.attrs.node(node)

    # -- sessions being copied in ---------------------------------------------------------

    def _incoming_parent(self, parent: InodeT) -> tuple[SessionEntry, IncomingSession, Node]:
        """The folder *parent* of a session being copied in, to make or change a name in."""
        kind, obj, node = self.attrs.resolve(InodeNo(parent))
        if kind != "node":
            raise FUSEError(errno.EACCES if kind in ("session", "pages") else errno.EPERM)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        inc = obj.incoming
        check_gathering(inc)
        return obj, inc, node

    @engine_errors
    async def mkdir(self, parent: InodeT, name: FileNameT, mode: ModeT, ctx: RequestContext) -> EntryAttributes:
        mode = stat.S_IMODE(mode) & ~ctx.umask
        kind, obj, _ = self.attrs.resolve(InodeNo(parent))
        if kind == "engine":
            sname = os.fsdecode(name)
            if not valid_name(sname):
                raise FUSEError(errno.EINVAL)
            if await self.attrs.find_session(obj, name, reader_pid(ctx)) is not None:
                raise FUSEError(errno.EEXIST)
            entry = obj.entry(sname)
            if entry.incoming is not None:
                raise FUSEError(errno.EEXIST)   # made while we asked the engine
            entry.incoming = IncomingSession(sname, base(entry.key), mode, ctx.uid, ctx.gid)
            return self.attrs.node(entry.incoming.root)
        _, inc, node = self._incoming_parent(parent)
        if name in node.children:
            raise FUSEError(errno.EEXIST)
        return self.attrs.node(inc.make(node, name, stat.S_IFDIR | mode, ctx.uid, ctx.gid))

    @engine_errors
    async def create(self, parent: InodeT, name: FileNameT, mode: ModeT, flags: FlagT,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        entry, inc, node = self._incoming_parent(parent)
        if name in node.children:
            raise FUSEError(errno.EEXIST)
        child = inc.make(node, name, stat.S_IFREG | (stat.S_IMODE(mode) & ~ctx.umask), ctx.uid, ctx.gid)
        fh = self._new_handle(Handle("file", entry, node=child, inc=inc,
                                     writable=(flags & os.O_ACCMODE) != os.O_RDONLY))
        return FileInfo(fh=fh, direct_io=True, keep_cache=False), self.attrs.node(child)

    @engine_errors
    async def unlink(self, parent: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        entry, inc, node = self._incoming_parent(parent)
        child = node.children.get(name)
        if child is None:
            raise FUSEError(errno.ENOENT)
        if child.is_dir:
            raise FUSEError(errno.EISDIR)
        self.copy_in.account(entry.engine, -inc.detach(child))

    @engine_errors
    async def rmdir(self, parent: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        kind, obj, _ = self.attrs.resolve(InodeNo(parent))
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

    @engine_errors
    async def rename(self, p_old: InodeT, n_old: FileNameT, p_new: InodeT, n_new: FileNameT, flags: FlagT,
                     ctx: RequestContext) -> None:
        if not (owns(p_old) and owns(p_new)):
            raise FUSEError(errno.EXDEV)
        entry, inc, src_dir = self._incoming_parent(p_old)
        _, inc2, dst_dir = self._incoming_parent(p_new)
        if inc2 is not inc:
            raise FUSEError(errno.EXDEV)
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise FUSEError(errno.EINVAL)
        await self.copy_in.move(entry, src_dir, n_old, dst_dir, n_new, flags)

    # -- files ---------------------------------------------------------------------------

    def _new_handle(self, h: Handle) -> FileHandleT:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = h
        return fh

    @engine_errors
    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        kind, obj, extra = self.attrs.resolve(InodeNo(inode))
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if kind in ("engines", "engine", "session", "pages") or (kind == "node" and extra.is_dir):
            raise FUSEError(errno.EISDIR)
        if kind == "node":
            inc = obj.incoming
            if writable:
                check_gathering(inc)
                if flags & os.O_TRUNC and extra.size:
                    self.copy_in.account(obj.engine, inc.truncate(extra, 0))
            h = Handle("file", obj, node=extra, inc=inc, writable=writable)
        else:
            if writable:
                raise FUSEError(errno.EACCES)
            pid = reader_pid(ctx)
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
            return FileInfo(fh=fh, direct_io=True, keep_cache=False, noflush=True)
        return FileInfo(fh=fh, direct_io=True, keep_cache=False)

    @engine_errors
    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes | memoryview:
        h = self.handles[fh]
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
            return await eng.pages.read(snap, h.ix, off, size)
        node = h.node
        assert node is not None         # a file being copied in: create() or open() gave it
        if node.blob is not None:
            return (await self.store.fetch_blob(node.blob))[off:off + size]    # (held by name)
        data = node.data
        return bytes(data[off:off + size])

    @engine_errors
    async def write(self, fh: FileHandleT, off: int, buf: bytes) -> int:
        return await self.copy_in.write(self.handles[fh], off, buf)

    @engine_errors
    async def flush(self, fh: FileHandleT) -> None:
        h = self.handles.get(fh)
        if h is not None:
            await self.copy_in.flush(h)

    async def take_blob(self, fh: FileHandleT, digest: str, size: int, row: BlobRow | None) -> bool:
        h = self.handles.get(fh)
        return h is not None and self.copy_in.take_blob(h, digest, size)

    async def whole_blob(self, fh: FileHandleT) -> tuple[str, int, BlobRow | None] | None:
        h = self.handles.get(fh)
        return None if h is None else await self.copy_out.page_blob(h)

    async def release(self, fh: FileHandleT) -> None:
        h = self.handles.pop(fh, None)
        if h is not None and h.snap is not None:
            h.snap.refs -= 1
            h.snap.last_used = time.monotonic()

    # -- folders ---------------------------------------------------------------------

    @engine_errors
    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        ino = InodeNo(inode)
        kind, obj, node = self.attrs.resolve(ino)
        if kind in ("manifest", "page") or (kind == "node" and not node.is_dir):
            raise FUSEError(errno.ENOTDIR)
        dh = DirHandle(ino)
        if kind == "pages":
            dh.snap = await obj.engine.snapshot_for(obj, reader_pid(ctx), fresh="pages/")
            dh.snap.refs += 1
        fh = self._next_dh
        self._next_dh += 1
        self.dirs[fh] = dh
        return fh

    async def releasedir(self, fh: FileHandleT) -> None:
        dh = self.dirs.pop(fh, None)
        if dh is not None and dh.snap is not None:
            dh.snap.refs -= 1
            dh.snap.last_used = time.monotonic()

    @engine_errors
    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> bool:
        dh = self.dirs[fh]
        kind, obj, node = self.attrs.resolve(dh.ino)
        if kind == "engines":
            for eng in sorted(self.registry.engines.values(), key=lambda e: e.key):
                if eng.key > start_id and not pyfuse3.readdir_reply(
                        token, os.fsencode(eng.name), self.attrs.engine(eng), eng.key):
                    break
        elif kind == "engine":
            names = await obj.names(max_age=0 if start_id == 0 else 1.0)
            entries = {obj.entry(n) for n in names}
            entries |= {e for e in obj.entries.values() if e.incoming is not None}
            for e in sorted(entries, key=lambda e: e.key):
                if e.key <= start_id:
                    continue
                attr = (self.attrs.node(e.incoming.root) if e.incoming is not None
                        else self.attrs.session(e, 0))
                if not pyfuse3.readdir_reply(token, os.fsencode(e.name), attr, e.key):
                    break
        elif kind == "session":
            snap = obj.latest if obj.latest is not None and not obj.latest.released else None
            items = [(PAGES, self.attrs.session(obj, PAGES_J, snap), PAGES_J),
                     (MANIFEST, self.attrs.session(obj, MANIFEST_J, snap), MANIFEST_J)]
            for name, attr, cookie in items:
                if cookie > start_id and not pyfuse3.readdir_reply(token, name, attr, cookie):
                    break
        elif kind == "pages":
            snap = dh.snap
            assert snap is not None     # opendir() took it
            if snap.released:
                raise FUSEError(errno.EIO)
            for ix in range(start_id, snap.n_pages):
                if not pyfuse3.readdir_reply(token, mf.page_name(ix).encode(),
                                             self.attrs.session(obj, PAGE_OFFSET, snap, ix), ix + 1):
                    break
        elif kind == "node":
            first = base(obj.key)
            for child in sorted(node.children.values(), key=lambda c: c.ino):
                cookie = child.ino - first
                if cookie > start_id and not pyfuse3.readdir_reply(
                        token, child.name, self.attrs.node(child), cookie):
                    break
        else:
            raise FUSEError(errno.ENOTDIR)
        return True

    def readdir_root(self, start_id: int, token: ReaddirToken) -> None:
        """The ``engines`` entry at the end of the root listing, while engines are attached."""
        if self.registry.engines and start_id < ROOT_COOKIE:
            pyfuse3.readdir_reply(token, ENGINES_NAME, self.attrs.engines(), ROOT_COOKIE)

    # -- pffs fork into and out of an engine -------------------------------------------------

    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: RequestContext) -> None:
        """``pffs fork`` out of or into ``engines/``: the engine's bridge moves the
        bytes itself (the direct path where its process may use the store).

        SAVE_XATTR on ``engines/E/S``, value a new session's path from the
        mount's root; LOAD_XATTR on ``engines/E``, value JSON ``{"session":
        path, "name": name}``.  The caller's permissions are checked as for
        writing, or reading, those paths (pffs.fs.manifests).
        """
        ino = InodeNo(inode)
        mount = self.registry.mountpoint
        if name == SAVE_XATTR:
            parent = self.manifests.resolve_new(value, ctx)
            where = "/" + os.fsdecode(value).strip("/")
            await self._save(ino, mount + where, where)
            self.manifests.invalidate.inode(parent, True)
            return
        if name != LOAD_XATTR:
            raise FUSEError(errno.EPERM)
        try:
            spec = json.loads(value)
            src, target = os.fsencode(spec["session"]), str(spec["name"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise FUSEError(errno.EINVAL) from None
        self.manifests.resolve_readable(src.rstrip(b"/") + b"/" + MANIFEST, ctx)
        where = "/" + os.fsdecode(src).strip("/")
        await self._load(ino, target, mount + where, where)

    async def _save(self, ino: InodeNo, path: str, where: str) -> int:
        """``pffs fork engines/E/S DST``: engine E pages S out at *path* itself."""
        kind, entry, _ = self.attrs.resolve(ino)
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

    async def _load(self, ino: InodeNo, name: str, path: str, where: str) -> list[str]:
        """``pffs fork SRC engines/E[/NAME]``: engine E pages the session at *path* in itself."""
        kind, eng, _ = self.attrs.resolve(ino)
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
