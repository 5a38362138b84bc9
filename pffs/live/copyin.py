"""Copies into ``MNT/engines/E/``: the files of a session being copied in, and its page-in.

The files arrive by mkdir/create/write/rename as a copy makes them
(:class:`pffs.live.incoming.IncomingSession` keeps them in memory, its
memory charged against the engine's pool and the daemon's limit); when the
last of them arrives (a close, or a rename onto manifest.json) the session
is complete and the engine pages it in.  A page file copied whole from the
mount holds its blob's name instead of its bytes, and the engine reads the
blob from the store itself where it can.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3
import trio
from pyfuse3 import FUSEError

from pffs import manifest as mf
from pffs.live.engines import LiveEngine, Registry, SessionEntry
from pffs.live.errors import EngineError, EngineRefused
from pffs.live.handles import Handle, LiveStore
from pffs.live.incoming import MANIFEST, IncomingSession, Node
from pffs.live.numbering import KernelCache
from pffs.live.registry import INCOMING_LIMIT
from pffs.namespace import now_ns

log = logging.getLogger("pffs.live")

# Manifests above this size are parsed in a worker thread.
PARSE_INLINE = 1 << 20


def check_gathering(inc: IncomingSession) -> None:
    """EBUSY unless the session is still being copied in (not paging in, not gone)."""
    if inc.state != "gathering":
        raise FUSEError(errno.EBUSY)


class CopyIn:
    """Sessions being copied into engines: their files' bytes and attributes,
    the memory they hold, and the page-in once complete."""

    def __init__(self, registry: Registry, store: LiveStore, cache: KernelCache):
        self.registry = registry
        self.store = store
        self.cache = cache

    # -- files ------------------------------------------------------------------------

    def take_blob(self, h: Handle, digest: str, size: int) -> bool:
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

    async def unblob(self, eng: LiveEngine, inc: IncomingSession, node: Node) -> None:
        """Give a file held by name its bytes (before they are read or changed here)."""
        digest = node.blob
        if digest is None:
            return
        data = await self.store.fetch_blob(digest)
        if node.blob != digest:
            return  # (changed meanwhile)
        self.charge(eng, len(data))
        self.account(eng, inc.unblob(node, data))

    async def write(self, h: Handle, off: int, buf: bytes) -> int:
        entry, node, inc = h.entry, h.node, h.inc
        if not h.writable or node is None or inc is None:   # (writable: a file being copied in)
            raise FUSEError(errno.EBADF)
        if inc.state == "gone":
            raise FUSEError(errno.ENOENT)   # paged in or refused meanwhile
        check_gathering(inc)
        await self.unblob(entry.engine, inc, node)
        grow = max(0, off + len(buf) - node.size)
        self.charge(entry.engine, grow)
        self.account(entry.engine, inc.write(node, off, buf))
        return len(buf)

    async def setattr(self, entry: SessionEntry, node: Node, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields) -> None:
        """Set what *fields* say of *attr* on a file or folder being copied in."""
        inc = entry.incoming
        assert inc is not None      # (a node of it: resolved just now)
        if fields.update_size:
            if node.is_dir:
                raise FUSEError(errno.EISDIR)
            check_gathering(inc)
            await self.unblob(entry.engine, inc, node)
            grow = attr.st_size - node.size
            self.charge(entry.engine, grow)
            inc.truncate(node, attr.st_size)
            self.account(entry.engine, grow)
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
                m, data, version = await self.parse_manifest(entry, node, self.path(entry, node), "close")
            except FUSEError:
                inc.set_manifest(None, None)
                raise
            if inc.is_manifest(node) and node.linked and node.arrived and node.version == version:
                inc.set_manifest(m, data)
        if inc.complete():
            try:
                await self.page_in(entry, self.path(entry, node), "close")
            finally:
                # The folder's files are now the live session's (or gone): the
                # kernel forgets the copied-in ones before this close returns,
                # so that a read right after the copy finds the live session.
                if entry.incoming is None:
                    await self.cache.settled()

    async def move(self, entry: SessionEntry, src_dir: Node, n_old: bytes, dst_dir: Node, n_new: bytes,
                   flags: int) -> None:
        """rename within a session being copied in (*flags*: RENAME_NOREPLACE or none)."""
        inc = entry.incoming
        assert inc is not None      # (both folders: resolved just now)
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
            checked = await self.parse_manifest(
                entry, node, self.path(entry, dst_dir) + "/" + mf.MANIFEST_NAME, "rename")
            if (inc.state != "gathering" or src_dir.children.get(n_old) is not node
                    or dst_dir.children.get(n_new) is not target):
                raise FUSEError(errno.EBUSY)
        if target is not None:
            self.account(entry.engine, -inc.detach(target))
        inc.move(node, dst_dir, n_new)
        if checked is not None and node.arrived and node.version == checked[2]:
            inc.set_manifest(checked[0], checked[1])
        if inc.complete():
            await self.page_in(entry, self.path(entry, node), "rename")

    # -- memory ------------------------------------------------------------------------

    def charge(self, eng: LiveEngine, grow: int) -> None:
        """ENOSPC where *grow* more bytes would pass the engine's pool or the daemon's limit."""
        if grow <= 0:
            return
        nb = eng.reg.info.get("num_blocks")
        own = (nb * eng.page_bytes + (64 << 20)) if isinstance(nb, int) and nb > 0 else INCOMING_LIMIT
        if eng.incoming_bytes + grow > own or self.registry.incoming_bytes + grow > INCOMING_LIMIT:
            log.warning("write into engines/%s: sessions being copied in would hold %d bytes "
                        "(engine pool %s, daemon limit %d)", eng.name, eng.incoming_bytes + grow,
                        own, INCOMING_LIMIT)
            raise FUSEError(errno.ENOSPC)

    def account(self, eng: LiveEngine, grow: int) -> None:
        eng.incoming_bytes += grow
        self.registry.incoming_bytes += grow

    # -- the page-in ---------------------------------------------------------------------

    @staticmethod
    def path(entry: SessionEntry, node: Node | None = None) -> str:
        """engines/E/S/... of *node* (S itself without), for log lines."""
        parts = []
        while node is not None and node.parent is not None:
            parts.append(os.fsdecode(node.name))
            node = node.parent
        return "/".join(["engines", entry.engine.name, entry.name, *reversed(parts)])

    async def parse_manifest(self, entry: SessionEntry, node: Node, where: str, op: str
                             ) -> tuple[mf.Manifest, bytes, int]:
        """Parse a manifest being copied in: (manifest, bytes, node version) or EINVAL, logged."""
        assert entry.incoming is not None
        await self.unblob(entry.engine, entry.incoming, node)
        version = node.version
        data = bytes(node.data)
        try:
            if len(data) > PARSE_INLINE:
                m = await trio.to_thread.run_sync(mf.parse, data)
            else:
                m = mf.parse(data)
        except mf.ManifestError as e:
            log.warning("%s %s: refused manifest: %s", op, where, e)
            raise FUSEError(errno.EINVAL) from None
        return m, data, version

    async def page_in(self, entry: SessionEntry, where: str, op: str) -> None:
        """Hand a complete session to its engine (the folder goes either way)."""
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
                await self.unblob(eng, inc, n)
            seqs = await eng.page_in(entry)
        except EngineRefused as e:
            log.warning("%s %s: engine %s refused the session, folder removed: %s", op, where,
                        eng.name, e)
            raise FUSEError(e.errno) from None
        except EngineError as e:
            log.warning("%s %s: page-in into engine %s failed: %s", op, where, eng.name, e)
            raise FUSEError(errno.EIO) from None
        log.info("engines/%s/%s: paged in (sequences %s)", eng.name, entry.name, ", ".join(seqs))
