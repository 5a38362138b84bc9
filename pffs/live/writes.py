"""Sessions copied into ``MNT/engines/E/``, and save/load: the writing half of the FUSE view.

:class:`IncomingWrites` is the part of :class:`pffs.live.view.LiveView` that
takes mkdir/create/write/rename/unlink/rmdir under an engine folder, the
attributes set on those files, the page-in when the last one arrives, and
``pffs fork`` into and out of an engine; it uses the view's numbering and
attributes (see pffs.live.view).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio
from pyfuse3 import FUSEError

from pffs import manifest as mf
from pffs.live.engines import LiveEngine, Registry
from pffs.live.errors import EngineError, EngineRefused
from pffs.live.handles import Handle, _errors, _pid
from pffs.live.incoming import MANIFEST, IncomingSession, Node
from pffs.live.listings import EngineSessions, SessionEntry
from pffs.live.protocol import valid_name
from pffs.live.registry import INCOMING_LIMIT
from pffs.namespace import now_ns
from pffs.types import FileHandle, InodeNo

if TYPE_CHECKING:
    from pffs.fs.inodes import Invalidator

log = logging.getLogger("pffs.live")

# Manifests above this size are parsed in a worker thread.
_PARSE_INLINE = 1 << 20


class IncomingWrites:
    """The writing half of LiveView (which holds the registry and the numbering)."""

    reg: Registry
    #: The bytes of a blob of the mount's store (set by pffs.fs.operations.build).
    fetch_blob: Callable[[str], Awaitable[bytes | memoryview]]
    #: The kernel cache invalidations (set by pffs.fs.operations.build; None in unit tests).
    invalidate: Invalidator | None

    if TYPE_CHECKING:
        # The numbering and attributes of LiveView (pffs.live.view) this half uses.
        @staticmethod
        def owns(ino: InodeNo) -> bool: ...
        @staticmethod
        def base(key: int) -> InodeNo: ...
        def _resolve(self, ino: InodeNo) -> tuple[str, Any, Any]: ...
        def _node_attr(self, node: Node) -> pyfuse3.EntryAttributes: ...
        def _new_handle(self, h: Handle) -> FileHandle: ...
        async def _find_session(self, eng: LiveEngine, name: bytes, pid: int) -> SessionEntry | None: ...
        async def getattr(self, ino: InodeNo, ctx) -> pyfuse3.EntryAttributes: ...

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
            await self._unblob(obj.engine, inc, node)
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

    # -- files being copied in ---------------------------------------------------------

    async def take_blob(self, h: Handle, digest: str, size: int) -> bool:
        """copy_file_range of a whole committed file into an empty file being
        copied in: the file holds the blob by name (no byte moved); False if
        it cannot (then the daemon copies the bytes)."""
        node, inc = h.node, h.inc
        if not h.writable or node is None or inc is None or node.is_dir or node.size \
                or inc.state != "gathering" or inc.is_manifest(node):
            return False    # (a manifest.json's bytes are parsed at its close)
        inc.hold_blob(node, digest, size)
        if inc.page_index(node) is not None:
            h.entry.engine.warm(digest)     # (its load will want it decoded)
        return True

    async def _unblob(self, eng: EngineSessions, inc: IncomingSession, node: Node) -> None:
        """Give a file held by name its bytes (before they are read or changed here)."""
        digest = node.blob
        if digest is None:
            return
        data = await self.fetch_blob(digest)
        if node.blob != digest:
            return  # (changed meanwhile)
        self._charge(eng, len(data))
        self._account(eng, inc.unblob(node, data))

    @_errors
    async def write(self, h: Handle, off: int, buf: bytes) -> int:
        entry, node, inc = h.entry, h.node, h.inc
        if not h.writable or node is None or inc is None:   # (writable: a file being copied in)
            raise FUSEError(errno.EBADF)
        if inc.state == "gone":
            raise FUSEError(errno.ENOENT)   # paged in or refused meanwhile
        self._check_gathering(inc)
        await self._unblob(entry.engine, inc, node)
        grow = max(0, off + len(buf) - node.size)
        self._charge(entry.engine, grow)
        self._account(entry.engine, inc.write(node, off, buf))
        return len(buf)

    @_errors
    async def flush(self, h: Handle) -> None:
        """The close of a file being copied in: it has arrived; the last one pages the session in."""
        entry, node, inc = h.entry, h.node, h.inc
        if h.kind != "file" or not h.writable or node is None or inc is None:
            return
        if inc.state != "gathering" or not node.linked:
            return
        if not (node.dirty or not node.arrived):
            return
        inc.closed(node)
        if inc.is_manifest(node):
            try:
                m, data, version = await self._parse_manifest(entry, node, self._path(entry, node), "close")
            except FUSEError:
                inc.set_manifest(None, None)
                raise
            if inc.is_manifest(node) and node.linked and node.arrived and node.version == version:
                inc.set_manifest(m, data)
        if inc.complete():
            try:
                await self._page_in(entry, self._path(entry, node), "close")
            finally:
                # The folder's files are now the live session's (or gone): the
                # kernel forgets the copied-in ones before this close returns,
                # so that a read right after the copy finds the live session.
                if self.invalidate is not None and entry.incoming is None:
                    await self.invalidate.settled()

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

    def _charge(self, eng: EngineSessions, grow: int) -> None:
        if grow <= 0:
            return
        nb = eng.reg.info.get("num_blocks")
        own = (nb * eng.page_bytes + (64 << 20)) if isinstance(nb, int) and nb > 0 else INCOMING_LIMIT
        if eng.incoming_bytes + grow > own or self.reg.incoming_bytes + grow > INCOMING_LIMIT:
            log.warning("write into engines/%s: sessions being copied in would hold %d bytes "
                        "(engine pool %s, daemon limit %d)", eng.name, eng.incoming_bytes + grow,
                        own, INCOMING_LIMIT)
            raise FUSEError(errno.ENOSPC)

    def _account(self, eng: EngineSessions, grow: int) -> None:
        eng.incoming_bytes += grow
        self.reg.incoming_bytes += grow

    async def _parse_manifest(self, entry: SessionEntry, node: Node, where: str, op: str
                              ) -> tuple[mf.Manifest, bytes, int]:
        """Parse a manifest being copied in: (manifest, bytes, node version) or EINVAL, logged."""
        assert entry.incoming is not None
        await self._unblob(entry.engine, entry.incoming, node)
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
        inc = entry.incoming
        assert inc is not None and inc.manifest is not None    # (complete() said so)
        try:
            nodes = inc.page_nodes()
            if nodes and all(n.blob == d for n, d in zip(nodes, inc.manifest.pages)):
                # Every page is the blob its manifest names: the engine reads
                # them from the store itself, if it can.
                seqs = await eng.load_blobs(entry)
                if seqs is not None:
                    log.info("engines/%s/%s: paged in from the store (sequences %s)", eng.name,
                             entry.name, ", ".join(seqs))
                    return
            for n in nodes:
                await self._unblob(eng, inc, n)
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
        p: Node | None = dst_dir
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
            # Validated as it takes the name, like any manifest.json (contract §3.3).
            checked = await self._parse_manifest(
                entry, node, self._path(entry, dst_dir) + "/" + mf.MANIFEST_NAME, "rename")
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
