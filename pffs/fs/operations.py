"""pyfuse3 handlers: thin translations from FUSE requests to namespace and content calls.

State kept in memory, on the trio thread only (code between two awaits is
atomic with respect to other handlers):

- ``lookups``: the kernel's lookup count per inode; an unlinked inode is
  deleted when its count reaches zero and nothing has it open.
- ``states``: per inode with open handles or staged writes: the staging
  buffer, the committed block list, and a lock that orders writes and the
  commit of that inode.
- ``handles``: open file handles.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field

import outcome
import pyfuse3
import trio
from pyfuse3 import FUSEError

from .. import manifest as mf
from .. import namespace as ns
from ..errors import IntegrityError, StoreFull, StoreUnavailable
from ..namespace import BLOCK_SIZE, FsError
from ..store.local import LocalBlobStore
from .blobcache import BlobCache
from .content import AcceptedManifest, ContentStore, StoredContent
from .db import Database, WorkerPool
from .direct import PAGES_XATTR, STORE_XATTR, page_verdict
from .staging import MemoryBudget, Staging, journal_inode
from .virtual import VirtualTree

log = logging.getLogger("pffs.fs")

ENTRY_TIMEOUT = 10.0
ATTR_TIMEOUT = 10.0
BLKSIZE = 1 << 20
DIGEST_XATTR = b"user.pffs.digest"
# Directories: how many names they hold (read-only, not listed, like the digest).
ENTRIES_XATTR = b"user.pffs.entries"
READONLY_XATTRS = (DIGEST_XATTR, ENTRIES_XATTR, PAGES_XATTR, STORE_XATTR)
# Write-only, on a session folder holding an empty pages/ (what `pffs fork`
# makes): its value, a path from the mount's root to a valid manifest.json,
# gives the folder a manifest.json holding the same blob, and the pages as a
# metadata-only fork would.  No byte of the manifest crosses FUSE.
FORK_XATTR = b"user.pffs.fork"
# Write-only, on a live session folder engines/E/S: its value, the path of a
# new session from the mount's root, has engine E page S out there itself.
SAVE_XATTR = b"user.pffs.save"
# Write-only, on an engine's folder engines/E: its value, JSON {"session":
# path from the mount's root, "name": a session name}, has E page that
# session in itself.
LOAD_XATTR = b"user.pffs.load"
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 << 10
PREFETCH_PAGES = 16  # files fetched ahead of a sequential reader: refilled half at a time
# Writes to (and reads of) a staged file on disk up to this size are done on
# the event loop: a pwrite into the page cache costs less than a hand-off.
SMALL_WRITE = 64 << 10
PREFETCH_WINDOW = 64   # page files whose content one query reads (see PageWindow)
LISTINGS_KEPT = 8           # directories whose listing order is remembered (see Listing)
LISTING_MAX = 1 << 16       # entries remembered of one listing (about 100 bytes each)
MANIFEST = mf.MANIFEST_NAME.encode()
# PFFS_TIMING=1: count and time every handler; the daemon logs the totals at unmount.
TIMING: dict[str, tuple[int, float]] | None = {} if os.environ.get("PFFS_TIMING") else None


def handler(fn):
    """Map namespace errors to errnos; log anything unexpected and answer EIO."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args):
        t0 = time.perf_counter()
        self.requests[name] = self.requests.get(name, 0) + 1
        try:
            return await fn(self, *args)
        except FUSEError:
            raise
        except FsError as e:
            if e.errno == errno.ENAMETOOLONG:
                log.info("%s: %s refused (limit %d)", name, e, ns.NAME_MAX)
            raise FUSEError(e.errno) from None
        except StoreFull as e:
            log.warning("%s: %s", name, e)
            raise FUSEError(errno.ENOSPC) from None
        except StoreUnavailable as e:
            log.error("%s: blob store unreachable: %s", name, e)
            raise FUSEError(errno.EIO) from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("%s: store is full: %s", name, e)
                raise FUSEError(errno.ENOSPC) from None
            if e.errno == errno.EFBIG:
                log.info("%s: the staging folder's filesystem refused the size: %s", name, e)
                raise FUSEError(errno.EFBIG) from None
            log.exception("%s%r failed", name, args[:2])
            raise FUSEError(errno.EIO) from None
        except Exception:
            log.exception("%s%r failed", name, args[:2])
            raise FUSEError(errno.EIO) from None
        finally:
            if TIMING is not None:
                n, total = TIMING.get(name, (0, 0.0))
                TIMING[name] = (n + 1, total + time.perf_counter() - t0)
    return wrapper


def _may(node: ns.Inode, ctx, bit: int) -> bool:
    """Whether the caller of *ctx* has permission *bit* (4 read, 1 search) on *node*."""
    if ctx.uid == 0:
        return True
    if ctx.uid == node.uid:
        return bool(node.mode & (bit << 6))
    if ctx.gid == node.gid:
        return bool(node.mode & (bit << 3))
    return bool(node.mode & bit)


class _LateRefusal(Exception):
    """A commit's bytes, not checked as a manifest, found named manifest.json in its transaction."""

    def __init__(self, error: mf.ManifestError):
        super().__init__(str(error))
        self.error = error


@dataclass
class InodeState:
    lock: trio.Lock = field(default_factory=trio.Lock)
    opens: int = 0
    writers: int = 0                    # handles open for writing
    staging: Staging | None = None
    blocks: list[str] | None = None     # committed blob digests, by block number
    size: int = 0                       # committed size (valid while blocks is not None)
    writer_uid: int = 0
    writer_gid: int = 0
    # Created under a name other than manifest.json and given no other name
    # since (rename and link clear it): a commit need not look up its names.
    plain: bool = False
    behind: dict[int, trio.Event] = field(default_factory=dict)   # write-behind jobs, by block


@dataclass
class PageWindow:
    """The committed content of a run of page files of one directory, read in
    one query at one namespace generation (``Database.generation``): the opens
    of a sequential reader (cp, tar, page-in) then need no query of their own
    to prefetch, nor their first read to find the blocks."""
    gen: int
    first: int                                   # page indexes [first, end) asked for
    end: int
    pages: dict[int, tuple[list[str], list[int]]]  # page index -> (blobs, raw sizes)
    files: dict[int, tuple[int, list[str]]]      # inode -> (size, blobs)


@dataclass
class Listing:
    """The order in which readdir listed a directory's entries: the order in
    which cp -r, tar and find-style readers open its files."""
    inos: list[int] = field(default_factory=list)
    pos: dict[int, int] = field(default_factory=dict)      # inode -> index in inos


@dataclass
class FileWindow:
    """The committed content of the files that follow one in a directory's
    listing, read in one query at one namespace generation."""
    gen: int
    first: int                                   # listing positions [first, end) asked for
    end: int
    files: dict[int, tuple[int, list[str], list[int]]]  # inode -> (size, blobs, raw sizes)


@dataclass
class OpenFile:
    ino: int
    writable: bool
    uid: int
    gid: int


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, db: Database, content: ContentStore, *, cache_size: int = 128 << 20,
                 staging_memory: int = 128 << 20, virtual: VirtualTree | None = None):
        super().__init__()
        self.db = db
        self.content = content
        self.cache = BlobCache(cache_size)
        self.budget = MemoryBudget(staging_memory)
        self.lookups: dict[int, int] = {}
        self.requests: dict[str, int] = {}   # FUSE requests served, by handler (in stats.json)
        self._said_negative = False          # a forget found a lookup count going below 0
        self.states: dict[int, InodeState] = {}
        self.handles: dict[int, OpenFile] = {}
        # fsync() of a staged file journals its bytes rather than committing them
        # (off for an S3 store: there, fsync uploads).
        self.journal_fsync = True
        # Full blocks of a file being written are stored while it is written
        # (off where a commit uploads or syncs its blobs: S3, -o sync=close).
        self.write_behind = not content.sync_on_close
        self.behind_limiter = trio.CapacityLimiter(1)   # (the block budget allows one anyway)
        self._next_fh = 1
        self._loading: dict[str, trio.Event] = {}
        self._prefetched: dict[int, int] = {}  # directory inode -> last page index prefetched
        self._windows: dict[int, PageWindow] = {}  # directory inode -> pages around the reader
        # Readers that follow a directory's listing rather than its page order
        # (cp -r or tar of a session whose files were created out of order).
        self._listings: dict[int, Listing] = {}      # directory inode -> its last listing
        self._fwindows: dict[int, FileWindow] = {}   # directory inode -> files after the reader
        self._lprefetched: dict[int, int] = {}       # directory inode -> last position prefetched
        self._last_open: dict[int, int] = {}         # directory inode -> inode opened last
        self.fetched_by_reads = 0  # blobs a read had to fetch itself: neither cached nor prefetched
        # Where the kernel found each inode it holds (from lookups and readdir):
        # spares a query per open when deciding what to prefetch.
        self._where: dict[int, tuple[int, bytes]] = {}
        # Threads that fetch and decode blobs ahead of readers: a queue and one
        # callback a job, cheaper than a trio task and trio.to_thread each.
        self.prefetcher = WorkerPool(max(1, (os.cpu_count() or 2)), "pffs-prefetch")
        # A local blob is read and decoded in well under a millisecond, so a
        # refill's blobs go as one job with one answer: on two cores, waking
        # the event loop once a blob cost a fifth of a cold read's CPU time.
        # A remote blob waits on the network: one job each, answered at once.
        self._prefetch_in_batches = isinstance(content.blobs, LocalBlobStore)
        self.virtual = virtual or VirtualTree(self)
        self.nursery: trio.Nursery | None = None
        self._notify_send, self._notify_recv = trio.open_memory_channel(10000)

    # -- plumbing ---------------------------------------------------------

    async def notifier(self) -> None:
        """Send kernel cache invalidations from a worker thread, never from a handler."""
        async for kind, args in self._notify_recv:
            try:
                if kind == "inode":
                    await trio.to_thread.run_sync(pyfuse3.invalidate_inode, *args)
                else:
                    pyfuse3.invalidate_entry_async(*args, ignore_enoent=True)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTCONN):
                    log.debug("invalidate %s %r: %s", kind, args, e)

    def _notify(self, kind: str, *args) -> None:
        try:
            self._notify_send.send_nowait((kind, args))
        except trio.WouldBlock:
            log.debug("invalidation queue full, dropping %s %r", kind, args)

    def _lookup_inc(self, ino: int, n: int = 1) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + n

    def _in_use(self, ino: int) -> bool:
        return ino in self.lookups or ino in self.states

    def path_of(self, ino: int) -> str:
        return ns.path_of(self.db.ro, ino)

    def _attrs(self, node: ns.Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.id
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = node.rdev
        size = node.size
        mtime = node.mtime_ns
        st = self.states.get(node.id)
        if st is not None and st.staging is not None:
            size = st.staging.size
            if st.staging.mtime_ns is not None:
                mtime = st.staging.mtime_ns
        a.st_size = size
        a.st_blksize = BLKSIZE
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = mtime
        a.st_ctime_ns = node.ctime_ns
        return a

    def _getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        return self._attrs(ns.get_inode(self.db.ro, ino))

    def _state(self, ino: int) -> InodeState:
        st = self.states.get(ino)
        if st is None:
            st = self.states[ino] = InodeState()
        return st

    async def _maybe_delete(self, ino: int) -> None:
        """Delete an unlinked inode once the kernel and every handle let go of it."""
        if self._in_use(ino):
            return
        row = self.db.ro.execute("SELECT nlink FROM inodes WHERE id=?", (ino,)).fetchone()
        if row is None or row[0] != 0:
            return

        def fn(conn):
            row = conn.execute("SELECT nlink FROM inodes WHERE id=?", (ino,)).fetchone()
            if row is not None and row[0] == 0 and not self._in_use(ino):
                ns.delete_inode(conn, ino)
        await self.db.write(fn)

    # -- lookups and attributes --------------------------------------------

    @handler
    async def lookup(self, parent_inode, name, ctx=None):
        v = await self.virtual.lookup(parent_inode, name, ctx)
        if v is not None:
            return v
        if len(name) > ns.NAME_MAX:
            log.info("lookup in %s: name of %d bytes refused (limit %d)", self.path_of(parent_inode),
                     len(name), ns.NAME_MAX)
            raise FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            ino = parent_inode
        elif name == b"..":
            row = self.db.ro.execute("SELECT parent FROM dentries WHERE inode=? LIMIT 1",
                                     (parent_inode,)).fetchone()
            ino = row[0] if row else ns.ROOT_INODE
        else:
            ino = ns.lookup(self.db.ro, parent_inode, name)
            if ino is None:
                ino = await self._lookup_folded(parent_inode, name)
        attr = self._getattr(ino)
        self._lookup_inc(ino)
        if name not in (b".", b".."):
            self._where[ino] = (parent_inode, name)
        return attr

    async def _lookup_folded(self, parent: int, name: bytes) -> int:
        """A name missing from *parent*: there after all once a folded fork there is unfolded."""
        # One statement, one snapshot: an unfold committed between a lookup
        # and a look at folds would otherwise hide the name.
        ino, folded = self.db.ro.execute(
            "SELECT (SELECT inode FROM dentries WHERE parent=:p AND name=:n),"
            " EXISTS (SELECT 1 FROM folds WHERE dir=:p)", dict(p=parent, n=name)).fetchone()
        if ino is None and folded:
            await self.db.write(ns.unfold, parent)
            ino = ns.lookup(self.db.ro, parent, name)
        if ino is None:
            raise FUSEError(errno.ENOENT)
        return ino

    @handler
    async def forget(self, inode_list):
        for ino, n in inode_list:
            left = self.lookups.get(ino, 0) - n
            if left > 0:
                self.lookups[ino] = left
                continue
            if left < 0 and not self.virtual.owns(ino) and not self._said_negative:
                # (.pffs/ and engines/ count no lookups.)  Said once: a count
                # pffs lost is a bug, and an unlinked inode may then go early.
                self._said_negative = True
                log.warning("forget of inode %d: the kernel forgot %d lookups, pffs counted %d",
                            ino, n, self.lookups.get(ino, 0))
            self.lookups.pop(ino, None)
            self._where.pop(ino, None)
            if not self.virtual.owns(ino):
                try:
                    await self._maybe_delete(ino)
                except Exception:
                    log.exception("forget of inode %d", ino)

    @handler
    async def getattr(self, inode, ctx=None):
        if self.virtual.owns(inode):
            return await self.virtual.stat(inode, ctx)
        return self._getattr(inode)

    @handler
    async def setattr(self, inode, attr, fields, fh, ctx):
        if self.virtual.owns(inode):
            return await self.virtual.setattr(inode, attr, fields, fh, ctx)
        node = ns.get_inode(self.db.ro, inode)
        if fields.update_size:
            if not node.is_reg:
                raise FUSEError(errno.EINVAL)
            self._size_ok(inode, attr.st_size, "truncate")
            await self._truncate(inode, attr.st_size, ctx)
        t = ns.now_ns()
        changes = {}
        if fields.update_mode:
            changes["mode"] = (node.mode & ns.S_IFMT) | (attr.st_mode & ~ns.S_IFMT)
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
            st = self.states.get(inode)
            if st is not None and st.staging is not None:
                # An explicit mtime wins over the time of the staged writes.
                st.staging.mtime_ns = attr.st_mtime_ns
        if changes or fields.update_size:
            changes["ctime_ns"] = attr.st_ctime_ns if fields.update_ctime else t
            await self.db.write(lambda c: ns.set_attrs(c, inode, **changes))
        return self._getattr(inode)

    @handler
    async def readlink(self, inode, ctx):
        v = self.virtual.readlink(inode)
        if v is not None:
            return v
        node = ns.get_inode(self.db.ro, inode)
        if not stat.S_ISLNK(node.mode):
            raise FUSEError(errno.EINVAL)
        return node.target

    # -- directory changes -------------------------------------------------

    def _reserved(self, parent: int, name: bytes) -> None:
        if self.virtual.reserved(parent, name):
            raise FUSEError(errno.EEXIST)

    async def _make(self, parent, name, mode, ctx, rdev=0, target=None) -> pyfuse3.EntryAttributes:
        self._reserved(parent, name)
        node = await self.db.write(ns.make_inode, parent, name, mode, ctx.uid, ctx.gid, rdev, target)
        self._lookup_inc(node.id)
        return self._attrs(node)

    @handler
    async def mkdir(self, parent_inode, name, mode, ctx):
        if self.virtual.owns(parent_inode):
            return await self.virtual.mkdir(parent_inode, name, mode, ctx)
        mode = stat.S_IFDIR | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make(parent_inode, name, mode, ctx)

    @handler
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if stat.S_IFMT(mode) == 0:
            mode |= stat.S_IFREG
        mode = stat.S_IFMT(mode) | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make(parent_inode, name, mode, ctx, rdev=rdev)

    @handler
    async def symlink(self, parent_inode, name, target, ctx):
        if len(target) > 4096:
            raise FUSEError(errno.ENAMETOOLONG)
        return await self._make(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=target)

    @handler
    async def create(self, parent_inode, name, mode, flags, ctx):
        if self.virtual.owns(parent_inode):
            return await self.virtual.create(parent_inode, name, mode, flags, ctx)
        mode = stat.S_IFREG | (stat.S_IMODE(mode) & ~ctx.umask)
        attr = await self._make(parent_inode, name, mode, ctx)
        fh = self._open_handle(attr.st_ino, flags, ctx)
        st = self.states[attr.st_ino]
        if st.staging is None:
            # New and empty: its first write needs nothing from the namespace.
            st.staging = Staging(self.budget, str(self.content.staging_dir))
            st.plain = name != MANIFEST
            st.blocks, st.size = [], 0  # what is committed: nothing
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), attr

    @handler
    async def unlink(self, parent_inode, name, ctx):
        if self.virtual.owns(parent_inode):
            return await self.virtual.unlink(parent_inode, name, ctx)
        if self.virtual.reserved(parent_inode, name):
            raise FUSEError(errno.EPERM)
        ino, deleted = await self.db.write(ns.unlink, parent_inode, name, self._in_use)
        if not deleted:
            await self._maybe_delete(ino)

    @handler
    async def rmdir(self, parent_inode, name, ctx):
        if self.virtual.owns(parent_inode):
            return await self.virtual.rmdir(parent_inode, name, ctx)
        if self.virtual.reserved(parent_inode, name):
            raise FUSEError(errno.EPERM)
        ino, deleted = await self.db.write(ns.rmdir, parent_inode, name, self._in_use)
        if not deleted:
            await self._maybe_delete(ino)

    @handler
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if self.virtual.owns(parent_inode_old) or self.virtual.owns(parent_inode_new):
            return await self.virtual.rename(parent_inode_old, name_old, parent_inode_new,
                                             name_new, flags, ctx)
        if (self.virtual.reserved(parent_inode_old, name_old)
                or self.virtual.reserved(parent_inode_new, name_new)):
            raise FUSEError(errno.EPERM)
        if len(name_new) > ns.NAME_MAX:
            log.info("rename into %s: name of %d bytes refused (limit %d)",
                     self.path_of(parent_inode_new), len(name_new), ns.NAME_MAX)
            raise FUSEError(errno.ENAMETOOLONG)
        checked = None
        if name_new == MANIFEST:
            ino = ns.lookup(self.db.ro, parent_inode_old, name_old)
            if ino is None:
                raise FUSEError(errno.ENOENT)
            checked = await self._validate_existing(ino, parent_inode_new, "rename")
        uid, gid = ctx.uid, ctx.gid

        def fn(conn):
            ino, replaced, deleted = ns.rename(conn, parent_inode_old, name_old, parent_inode_new,
                                               name_new, flags, self._in_use)
            moved = self.states.get(ino)
            if moved is not None:
                moved.plain = False     # before the commit: no later flush skips the check
            created = []
            if checked is not None:
                created = self._take_manifest_name(conn, ino, checked, parent_inode_new, uid, gid)
            return replaced, deleted, created

        replaced, deleted, created = await self.db.write(fn)
        self._announce(created)
        if replaced is not None and not deleted:
            await self._maybe_delete(replaced)

    @handler
    async def link(self, inode, new_parent_inode, new_name, ctx):
        if self.virtual.owns(inode) or self.virtual.reserved(new_parent_inode, new_name):
            raise FUSEError(errno.EPERM)
        checked = None
        if new_name == MANIFEST:
            checked = await self._validate_existing(inode, new_parent_inode, "link")
        uid, gid = ctx.uid, ctx.gid
        st = self.states.get(inode)
        if st is not None:
            st.plain = False

        def fn(conn):
            node = ns.link(conn, inode, new_parent_inode, new_name)
            created = []
            if checked is not None:
                created = self._take_manifest_name(conn, inode, checked, new_parent_inode, uid, gid)
            return node, created

        node, created = await self.db.write(fn)
        self._announce(created)
        self._lookup_inc(inode)
        return self._attrs(node)

    # -- manifests -----------------------------------------------------------

    async def _validate_existing(self, ino: int, new_parent: int, op: str):
        """Validate the content of *ino* before it takes the name manifest.json."""
        node = ns.get_inode(self.db.ro, ino)
        if not node.is_reg:
            return None
        st = self.states.get(ino)
        if st is not None and st.staging is not None and st.staging.dirty:
            async with st.lock:
                await self._commit(ino, st, check_manifest=False)
            node = ns.get_inode(self.db.ro, ino)
        blocks = ns.blocks_of(self.db.ro, ino)
        where = f"{self.path_of(new_parent).rstrip('/')}/manifest.json"
        if node.size > mf.MAX_MANIFEST_BYTES:
            log.warning("%s %s: refused manifest: %d bytes exceed the %d-byte cap", op, where,
                        node.size, mf.MAX_MANIFEST_BYTES)
            raise FUSEError(errno.EINVAL)
        try:
            data = b"".join([await self._blob(d, ino) for d in blocks])
            m = await trio.to_thread.run_sync(mf.parse, data, limiter=self.content.limiter)
            if self.content.adopt is not None:
                await trio.to_thread.run_sync(self.content.adopt, m.pages, limiter=self.content.limiter)
        except mf.ManifestError as e:
            log.warning("%s %s: refused manifest: %s", op, where, e)
            raise FUSEError(errno.EINVAL) from None
        return (node.digest, m.pages)

    def _take_manifest_name(self, conn, ino, checked, parent, uid, gid):
        digest, pages = checked
        if ns.get_inode(conn, ino).digest != digest:
            raise FsError(errno.EAGAIN, "manifest changed while it was being validated")
        ns.record_manifest(conn, ino, pages, digest)
        return ns.fork_pages(conn, parent, digest, uid, gid)

    def _resolve_readable(self, path: bytes, ctx, folder: bool = False) -> int:
        """The inode at *path* (from the mount's root) that the caller may read:
        search permission on every folder on the way, read permission on the
        file, as the kernel would check them (the caller's supplementary
        groups are not known here: they do not count).  With *folder*, a
        folder the caller may search."""
        ino = ns.ROOT_INODE
        for name in (n for n in path.split(b"/") if n and n != b"."):
            node = ns.get_inode(self.db.ro, ino)
            if not node.is_dir:
                raise FsError(errno.ENOTDIR)
            if not _may(node, ctx, 1):
                raise FsError(errno.EACCES)
            if name == b".." or self.virtual.reserved(ino, name):
                raise FsError(errno.EINVAL)
            found = ns.lookup(self.db.ro, ino, name)
            if found is None:
                raise FsError(errno.ENOENT)
            ino = found
        node = ns.get_inode(self.db.ro, ino)
        if folder:
            if not node.is_dir:
                raise FsError(errno.ENOTDIR)
            if not _may(node, ctx, 1):
                raise FsError(errno.EACCES)
            return ino
        if not node.is_reg:
            raise FsError(errno.EINVAL)
        if not _may(node, ctx, 4):
            raise FsError(errno.EACCES)
        return ino

    async def _fork_into(self, folder: int, value: bytes, ctx) -> None:
        """``setxattr(folder, user.pffs.fork, path)``: see FORK_XATTR.

        EINVAL when *path* is not a manifest.json accepted as valid (the
        caller then copies its bytes, whose close says why), EEXIST when the
        folder has a manifest.json, EOPNOTSUPP on an S3 store (whose forks
        adopt pages from the bucket as the manifest's close does).
        """
        if self.content.remote:
            raise FUSEError(errno.EOPNOTSUPP)
        src = self._resolve_readable(value, ctx)
        st = self.states.get(src)
        if st is not None and st.staging is not None and st.staging.dirty:
            async with st.lock:
                await self._commit(src, st)
        uid, gid = ctx.uid, ctx.gid

        def fn(conn):
            row = conn.execute("SELECT n_pages, digest FROM manifests WHERE inode=?", (src,)).fetchone()
            node = ns.get_inode(conn, src)
            if row is None or node.digest != row[1]:
                raise FsError(errno.EINVAL, "not an accepted manifest")
            n_pages, digest = row
            blocks = ns.blocks_of(conn, src)
            new = ns.make_inode(conn, folder, MANIFEST, stat.S_IFREG | 0o644, uid, gid)
            ns.set_content(conn, new.id, node.size, digest, blocks, [], None, new.ctime_ns,
                           was_empty=True)
            if not ns.record_known_manifest(conn, new.id, digest, n_pages):
                raise FsError(errno.EINVAL, "its page list is not recorded whole")
            return ns.fork_pages(conn, folder, digest, uid, gid)

        created = await self.db.write(fn)
        self._notify("inode", folder, True)
        self._announce(created)

    def _resolve_new(self, path: bytes, ctx) -> int:
        """The folder that will hold a new entry at *path* (from the mount's root),
        which the caller may search and write, as the kernel would check."""
        parts = [n for n in path.split(b"/") if n and n != b"."]
        if not parts:
            raise FsError(errno.EINVAL)
        ns.check_name(parts[-1])
        parent = self._resolve_readable(b"/".join(parts[:-1]), ctx, folder=True)
        node = ns.get_inode(self.db.ro, parent)
        if not (_may(node, ctx, 2) and _may(node, ctx, 1)):
            raise FsError(errno.EACCES)
        if self.virtual.reserved(parent, parts[-1]):
            raise FsError(errno.EINVAL)
        if ns.lookup(self.db.ro, parent, parts[-1]) is not None:
            raise FsError(errno.EEXIST)
        return parent

    async def _live_fork(self, inode: int, name: bytes, value: bytes, ctx) -> None:
        """``pffs fork`` out of or into ``engines/``: the engine's bridge moves the
        bytes itself (the direct path where its process may use the store).

        SAVE_XATTR on ``engines/E/S``, value a new session's path from the
        mount's root; LOAD_XATTR on ``engines/E``, value JSON ``{"session":
        path, "name": name}``.  The caller's permissions are checked as for
        writing, or reading, those paths.
        """
        live = self.virtual.live
        if name == SAVE_XATTR:
            parent = self._resolve_new(value, ctx)
            where = "/" + os.fsdecode(value).strip("/")
            await live.save(inode, live.reg.mountpoint + where, where)
            self._notify("inode", parent, True)
            return
        try:
            spec = json.loads(value)
            src, target = os.fsencode(spec["session"]), str(spec["name"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise FUSEError(errno.EINVAL) from None
        self._resolve_readable(src.rstrip(b"/") + b"/" + MANIFEST, ctx)
        where = "/" + os.fsdecode(src).strip("/")
        await live.load(inode, target, live.reg.mountpoint + where, where, ctx)

    def _announce(self, created) -> None:
        """Tell the kernel about page files that appeared by themselves (forks).

        The kernel never caches a negative entry from an ENOENT reply (it
        revalidates it), so only the directories' attributes need invalidating.
        """
        dirs = {pdir for pdir, _n in created}
        for d in dirs:
            self._notify("inode", d, True)
        if created:
            log.info("metadata-only fork: %d page files appeared in %s", sum(n for _d, n in created),
                     ", ".join(self.path_of(d) for d in dirs))

    # -- open files -----------------------------------------------------------

    def _open_handle(self, ino: int, flags: int, ctx) -> int:
        fh = self._next_fh
        self._next_fh += 1
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        self.handles[fh] = OpenFile(ino, writable, ctx.uid, ctx.gid)
        st = self._state(ino)
        st.opens += 1
        if writable:
            st.writers += 1
            st.writer_uid, st.writer_gid = ctx.uid, ctx.gid
        return fh

    @handler
    async def open(self, inode, flags, ctx):
        if self.virtual.owns(inode):
            return await self.virtual.open(inode, flags, ctx)
        # (The kernel sends opendir, never open, for a directory.)
        fh = self._open_handle(inode, flags, ctx)
        if self.nursery is not None and (flags & os.O_ACCMODE) != os.O_WRONLY:
            self._prefetch_after(inode)
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
            # libfuse asks for atomic O_TRUNC: the truncation arrives here, and
            # is staged like a write (a refused manifest keeps its old bytes).
            st = self.states[inode]
            async with st.lock:
                stg = st.staging or await self._load_staging(inode, st, empty=True)
                if stg.size:
                    stg.truncate(0)
                else:
                    stg._changed()
                stg.mtime_ns = ns.now_ns()
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    def _prefetch_after(self, ino: int) -> None:
        """Opening a file: decode the files a sequential reader opens next in the background.

        Sequential readers (cp, rsync, tar, cat, page-in) then find them
        decoded in the cache, and decoding runs on the other cores.  Page
        files are read in page order (page-in, shell globs, rsync) or in the
        order the directory was listed (cp -r, tar): whichever the previous
        open in the same directory followed, the listing on a first open.
        """
        row = self._where.get(ino)
        if row is None:
            row = self.db.ro.execute("SELECT parent, name FROM dentries WHERE inode=? LIMIT 1",
                                     (ino,)).fetchone()
            if row is None:
                return
        parent = row[0]
        ix = mf.parse_page_name(row[1])
        prev = self._last_open.get(parent)
        if len(self._last_open) > 1024:
            self._last_open.clear()
        self._last_open[parent] = ino
        listing = self._listings.get(parent)
        at = listing.pos.get(ino) if listing is not None else None
        if at is not None and at > 0 and listing.inos[at - 1] == prev:
            self._prefetch_listed(parent, listing, at)
            return
        if ix is None:
            if at is not None:
                self._prefetch_listed(parent, listing, at)
            return
        if at is not None and (prev is None or prev == ino):
            # A first open: the listing, unless it names the pages in order anyway.
            if at + 1 < len(listing.inos) and self._where.get(listing.inos[at + 1], (0, b""))[1] \
                    != mf.page_name(ix + 1).encode():
                self._prefetch_listed(parent, listing, at)
                return
        w = self._window(parent, ix, ix + PREFETCH_PAGES + 1)
        self._prefetch_run(self._prefetched, parent, ix, w.pages.get)

    def _prefetch_listed(self, parent: int, listing: Listing, at: int) -> None:
        """Decode the files listed after position *at* of *parent* in the background."""
        w = self._file_window(parent, listing, at, at + PREFETCH_PAGES + 1)

        def content(j):
            if j >= len(listing.inos):
                return None
            f = w.files.get(listing.inos[j])
            return ((), ()) if f is None else (f[1], f[2])  # (None: a directory, or gone)
        self._prefetch_run(self._lprefetched, parent, at, content)

    def _prefetch_run(self, marks: dict[int, int], parent: int, at: int, content) -> None:
        """Prefetch the files at positions at+1 .. at+PREFETCH_PAGES of *parent*
        (``content(j)``: their blobs and sizes, None past the end), from where
        the previous call for this directory stopped (``marks``), once no more
        than half of them are on their way: a refill is a batch of blobs."""
        budget = self.cache.limit // 4
        mark = marks.get(parent, -1)
        if mark > at + PREFETCH_PAGES or mark < at:
            mark = at
        elif mark - at > PREFETCH_PAGES // 2:
            return  # enough on its way: refill once half of it is read
        if len(marks) > 1024:
            marks.clear()
        batch: list[str] = []
        for j in range(mark + 1, at + PREFETCH_PAGES + 1):
            blobs = content(j)
            if blobs is None:
                break
            marks[parent] = j
            budget = self._prefetch_blobs(*blobs, budget, batch)
            if budget is None:
                break
        if not batch:
            return
        if self._prefetch_in_batches:
            self.prefetcher.submit(functools.partial(self._prefetched_all, batch),
                                   self._fetch_all, batch)
        else:
            for d in batch:
                self.prefetcher.submit(functools.partial(self._prefetched_one, d),
                                       self.content.get, d)

    def _prefetch_blobs(self, digests, sizes, budget: int, batch: list[str]) -> int | None:
        """Add to *batch* the blobs neither cached nor on their way (marked as
        on their way); the budget left, or None once it is spent."""
        for d, size in zip(digests, sizes):
            if d in self._loading or self.cache.get(d, count=False) is not None:
                continue
            size = size or 0   # (a blob row gone: the read will say why)
            if size > budget:
                return None
            budget -= size
            self._loading[d] = trio.Event()
            batch.append(d)
        return budget

    def _fetch_all(self, digests: list[str]) -> list[tuple[str, outcome.Outcome]]:
        """In a prefetch thread: each blob of a refill, or why it could not be had."""
        return [(d, outcome.capture(self.content.get, d)) for d in digests]

    def _prefetched_all(self, digests: list[str], fetched: outcome.Outcome) -> None:
        """On the trio thread: the blobs of a refill (see :meth:`_prefetched_one`)."""
        each = fetched.value if isinstance(fetched, outcome.Value) else [(d, fetched) for d in digests]
        for d, one in each:
            self._prefetched_one(d, one)

    def _file_window(self, parent: int, listing: Listing, first: int, end: int) -> FileWindow:
        """Committed content of the files at listing positions [first, end) (and more)."""
        gen = self.db.generation  # before the query: a commit meanwhile makes it stale
        w = self._covering(self._fwindows, parent, first, end)
        if w is not None:
            return w
        end = min(max(end, first + PREFETCH_WINDOW), len(listing.inos))
        inos = listing.inos[first:end]
        w = FileWindow(gen, first, end, {})
        if not inos:
            return w
        for ino, size, blob, raw in self.db.ro.execute(
                "SELECT i.id, i.size, b.blob, bl.raw_size FROM inodes i"
                " LEFT JOIN blocks b ON b.inode = i.id LEFT JOIN blobs bl ON bl.digest = b.blob"
                f" WHERE i.id IN ({','.join('?' * len(inos))}) AND (i.mode & 61440) = 32768"
                " ORDER BY i.id, b.blockno", inos):
            f = w.files.get(ino)
            if f is None:
                f = w.files[ino] = (size, [], [])
            if blob is not None:
                f[1].append(blob)
                f[2].append(raw)
        return self._keep(self._fwindows, parent, w)

    @staticmethod
    def _covering(windows: dict, parent: int, first: int, end: int):
        """The window of *parent* kept in *windows* if it covers [first, end).

        Prefetching takes it even after later commits: what it names is only
        a hint there (a file changed since has its blobs fetched by its own
        read), and re-reading the window at every open while another file is
        being written (cp -r within the mount) cost a fifth of the event
        loop.  Reads take a window only at the current generation
        (``_committed``)."""
        w = windows.get(parent)
        if w is not None and w.first <= first and end <= w.end:
            return w
        return None

    @staticmethod
    def _keep(windows: dict, parent: int, w):
        if len(windows) > 1024:
            windows.clear()
        windows[parent] = w
        return w

    def _window(self, parent: int, first: int, end: int) -> PageWindow:
        """Pages [first, end) of directory *parent* (and more after them), committed content."""
        gen = self.db.generation  # before the query: a commit meanwhile makes it stale
        w = self._covering(self._windows, parent, first, end)
        if w is not None:
            return w
        end = max(end, first + PREFETCH_WINDOW)
        names = [mf.page_name(i).encode() for i in range(first, end)]
        w = PageWindow(gen, first, end, {}, {})
        for name, ino, size, blob, raw in self.db.ro.execute(
                "SELECT e.name, i.id, i.size, b.blob, bl.raw_size FROM dentries e"
                " JOIN inodes i ON i.id = e.inode LEFT JOIN blocks b ON b.inode = i.id"
                " LEFT JOIN blobs bl ON bl.digest = b.blob"
                f" WHERE e.parent=? AND e.name IN ({','.join('?' * len(names))})"
                " AND (i.mode & 61440) = 32768 ORDER BY e.name, b.blockno", (parent, *names)):
            f = w.files.get(ino)
            if f is None:
                f = w.files[ino] = (size, [])
            page = w.pages.setdefault(mf.parse_page_name(name), ([], []))
            if blob is not None:
                f[1].append(blob)
                page[0].append(blob)
                page[1].append(raw)
        return self._keep(self._windows, parent, w)

    def _committed(self, ino: int) -> tuple[int, list[str]]:
        """(size, blobs by block number) of what is committed for *ino*."""
        where = self._where.get(ino)
        if where is not None:
            w = self._windows.get(where[0])
            if w is not None and w.gen == self.db.generation:
                f = w.files.get(ino)
                if f is not None:
                    return f
            fw = self._fwindows.get(where[0])
            if fw is not None and fw.gen == self.db.generation:
                f = fw.files.get(ino)
                if f is not None:
                    return f[0], f[1]
        size = self.db.ro.execute("SELECT size FROM inodes WHERE id=?", (ino,)).fetchone()[0]
        return size, ns.blocks_of(self.db.ro, ino)

    def _prefetched_one(self, digest: str, fetched: outcome.Outcome) -> None:
        """On the trio thread: a blob the prefetcher fetched, or failed to (the
        reader's own fetch then reports why)."""
        if isinstance(fetched, outcome.Value):
            self.cache.put(digest, fetched.value)
        ev = self._loading.pop(digest, None)
        if ev is not None:
            ev.set()

    async def _blob(self, digest: str, ino: int) -> bytes:
        """Decoded, verified bytes of a blob, through the cache (EIO if damaged)."""
        data = self.cache.get(digest)
        if data is not None:
            return data
        while digest in self._loading:
            await self._loading[digest].wait()
            data = self.cache.get(digest)
            if data is not None:
                return data
        ev = self._loading[digest] = trio.Event()
        self.fetched_by_reads += 1
        try:
            data = await trio.to_thread.run_sync(self.content.get, digest,
                                                 limiter=self.content.limiter)
        except IntegrityError as e:
            log.error("read %s: %s", self.path_of(ino), e)
            raise FUSEError(errno.EIO) from None
        finally:
            del self._loading[digest]
            ev.set()
        self.cache.put(digest, data)
        return data

    @handler
    async def read(self, fh, off, size):
        if fh in self.virtual.handles:
            return await self.virtual.read(fh, off, size)
        of = self.handles[fh]
        st = self.states.get(of.ino)
        if st is not None and st.staging is not None:
            async with st.lock:
                stg = st.staging
                if stg is not None:
                    end = min(off + size, stg.size)
                    if stg.unloaded_in(off, end):
                        return await self._read_staged(of.ino, stg, off, end)
                    if stg.in_memory or size <= SMALL_WRITE:
                        return stg.read(off, size)
                    return await trio.to_thread.run_sync(stg.read, off, size)
        if st is None or st.blocks is None:
            # Committed size and blocks, kept until the next commit of this inode.
            size_now, blocks = self._committed(of.ino)
            if st is not None:
                st.blocks, st.size = blocks, size_now
        else:
            blocks, size_now = st.blocks, st.size
        end = min(off + size, size_now)
        if off >= end:
            return b""
        out = []
        for bn in range(off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
            data = await self._blob(blocks[bn], of.ino)
            base = bn * BLOCK_SIZE
            out.append(data[max(off, base) - base:min(end, base + len(data)) - base])
        return out[0] if len(out) == 1 else b"".join(out)

    async def _read_staged(self, ino: int, stg: Staging, off: int, end: int) -> bytes:
        """Bytes [off, end) of a staged file some of whose blocks are not read in
        yet: those from the blob cache, the others from the spill file."""
        parts = []
        for bn in range(off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
            base = bn * BLOCK_SIZE
            a, b = max(off, base), min(end, base + BLOCK_SIZE)
            if bn in stg.unloaded:
                parts.append((await self._blob(stg.clean[bn], ino))[a - base:b - base])
            else:
                parts.append(await trio.to_thread.run_sync(stg.read, a, b - a))
        return b"".join(parts)

    async def _load_staging(self, ino: int, st: InodeState, empty: bool = False) -> Staging:
        """Stage a file for change, starting from its committed bytes (or none): a
        file of several blocks reads each in when it is first changed."""
        node = ns.get_inode(self.db.ro, ino)
        blocks = ns.blocks_of(self.db.ro, ino) if node.size and not empty else []
        if len(blocks) == 1:
            stg = Staging(self.budget, str(self.content.staging_dir), await self._blob(blocks[0], ino))
        else:
            # A block at a time into the staging's spill file, never the whole
            # file in memory; blocks of zeros stay holes, read nor written.
            stg = Staging(self.budget, str(self.content.staging_dir), b"")
            zero = {}
            if blocks:
                await trio.to_thread.run_sync(stg.truncate, node.size)
                for n in {BLOCK_SIZE, node.size - (len(blocks) - 1) * BLOCK_SIZE}:
                    zero[n] = await trio.to_thread.run_sync(self.content.zero_digest, n)
            stg.clean = dict(enumerate(blocks))
            # (Read in when first changed, see Staging.unloaded.)
            stg.unloaded = {bn for bn, d in enumerate(blocks)
                            if d != zero[min(BLOCK_SIZE, node.size - bn * BLOCK_SIZE)]}
            stg.fetch = self.content.get
        stg.dirty = False
        st.staging = stg
        return stg

    @handler
    async def write(self, fh, off, buf):
        if fh in self.virtual.handles:
            return await self.virtual.write(fh, off, buf)
        of = self.handles[fh]
        if not of.writable:
            raise FUSEError(errno.EBADF)
        self._size_ok(of.ino, off + len(buf), "write")
        st = self.states[of.ino]
        async with st.lock:
            stg = st.staging or await self._load_staging(of.ino, st)
            end = off + len(buf)
            if stg.unloaded:
                await self._read_in(of.ino, stg, min(off, stg.size), end, (off, end))
            was_in_memory = stg.in_memory
            if (stg.in_memory and not stg.spills(off, len(buf))) \
                    or (not stg.in_memory and len(buf) <= SMALL_WRITE):
                # A copy into memory, or a small one into the spill file's page
                # cache (a database's pages): not worth a thread's hand-off.
                stg.write(off, buf)
            else:
                await trio.to_thread.run_sync(stg.write, off, buf)
            stg.mtime_ns = ns.now_ns()
            if end >= BLOCK_SIZE and self.write_behind and not stg.in_memory \
                    and self.nursery is not None:
                # Blocks the write ends (and those before it when it moved the file
                # to disk) that one run of sequential writes wrote whole: a random
                # writer's blocks would be written again, and stored for nothing.
                lo = 0 if was_in_memory else off // BLOCK_SIZE
                lo = max(lo, -(-stg.run_start // BLOCK_SIZE))
                for bn in range(lo, min(end, stg.size) // BLOCK_SIZE):
                    if bn not in stg.clean and bn not in stg.inflight:
                        stg.inflight.add(bn)
                        stg.spoiled.discard(bn)
                        st.behind[bn] = trio.Event()
                        self.nursery.start_soon(self._write_behind, of.ino, st, stg, bn)
        return len(buf)

    async def _read_in(self, ino: int, stg: Staging, off: int, end: int,
                       whole: tuple[int, int] = (0, 0)) -> None:
        """Before bytes [off, end) of a staged file change: read in the blocks
        that hold them (Staging.unloaded), through the blob cache, but those the
        write's range *whole* covers entirely."""
        for bn in stg.to_read_in(off, end, whole):
            data = await self._blob(stg.clean[bn], ino)
            if bn in stg.unloaded:
                await trio.to_thread.run_sync(stg.fill, bn, data)

    async def _write_behind(self, ino: int, st: InodeState, stg: Staging, bn: int) -> None:
        """A writer just wrote the last bytes of block *bn*: store it now, in a
        worker thread, while the writer goes on (a sequential writer's commit is
        then its last block only).  Its blob is named at the commit if no write
        touched the block meanwhile (``Staging.spoiled``)."""
        done = st.behind[bn]
        row = None
        fd = -1
        try:
            if stg.fd is None:
                return
            fd = os.dup(stg.fd)
            if stg.pins is None and self.content.gc_lock is not None:
                stg.pins = self.content.gc_lock.pin()
            row = await trio.to_thread.run_sync(self.content.store_block, stg, fd, bn,
                                                limiter=self.behind_limiter)
        except (OSError, StoreFull, ValueError) as e:
            # (The commit stores the block itself, and reports what fails then.)
            log.debug("write-behind of block %d of inode %d: %s", bn, ino, e)
        finally:
            if fd >= 0:
                os.close(fd)
            stg.inflight.discard(bn)
            del st.behind[bn]
            done.set()
        if row is not None and bn not in stg.spoiled and st.staging is stg \
                and (bn + 1) * BLOCK_SIZE <= stg.size:
            stg.clean[bn] = row.digest
            stg.early_rows[row.digest] = row
        stg.spoiled.discard(bn)

    def _size_ok(self, ino: int, size: int, op: str) -> None:
        if size > ns.MAX_FILE_SIZE:
            log.info("%s %s: %d bytes refused (the largest file is %d bytes)", op, self.path_of(ino),
                     size, ns.MAX_FILE_SIZE)
            raise FUSEError(errno.EFBIG)

    async def _truncate(self, ino: int, size: int, ctx) -> None:
        st = self._state(ino)
        st.opens += 1  # hold the state while we work
        try:
            async with st.lock:
                stg = st.staging or await self._load_staging(ino, st)
                # (The blocks cut or grown into; none past the new end.)
                await self._read_in(ino, stg, min(size, stg.size),
                                    min(max(size, stg.size), -(-size // BLOCK_SIZE) * BLOCK_SIZE))
                await trio.to_thread.run_sync(stg.truncate, size)
                stg.mtime_ns = ns.now_ns()
                if not st.writers:
                    # No handle open for writing will flush this: commit now.
                    st.writer_uid, st.writer_gid = ctx.uid, ctx.gid
                    await self._commit(ino, st)
        finally:
            st.opens -= 1
            await self._drop_state_if_idle(ino)

    async def _commit(self, ino: int, st: InodeState, check_manifest: bool = True) -> None:
        """Hash, compress and store the staged bytes, then point the inode at them.

        Caller holds ``st.lock``.  A file named manifest.json must hold a valid
        manifest, else EINVAL and the staged bytes are dropped (the previous
        content stays).
        """
        while st.behind:    # blocks being stored by write-behind: their results first
            await next(iter(st.behind.values())).wait()
        stg = st.staging
        if stg is None or not stg.dirty:
            return
        is_manifest = check_manifest and self._named_manifest(ino, st)
        uid, gid = st.writer_uid, st.writer_gid
        was_empty = st.blocks == []     # known committed content: none

        def fn(conn, stored):
            m = stored.manifest
            if m is None and any(n == MANIFEST for _, n in ns.names_of(conn, ino)):
                # It took the name manifest.json after the check above (a rename
                # committed meanwhile): its bytes are checked here, where the
                # names are those this transaction commits against.
                try:
                    if stored.size > mf.MAX_MANIFEST_BYTES:
                        raise mf.ManifestError("manifest", f"{stored.size} bytes exceed the "
                                               f"{mf.MAX_MANIFEST_BYTES}-byte cap")
                    m = mf.parse(stg.read(0, stored.size))
                except mf.ManifestError as e:
                    raise _LateRefusal(e) from None
            ns.set_content(conn, ino, stored.size, stored.digest, stored.blocks, stored.blob_rows,
                           stg.mtime_ns, was_empty=was_empty)
            created = []
            if isinstance(m, AcceptedManifest):
                # A fork's manifest: its page list is the accepted one's, unless
                # that went with its last holder since (then it is parsed anew).
                if not ns.record_known_manifest(conn, ino, stored.digest, m.n_pages):
                    ns.record_manifest(conn, ino, mf.parse(stg.read(0, stored.size)).pages,
                                       stored.digest)
            elif m is not None:
                ns.record_manifest(conn, ino, m.pages, stored.digest)
            if m is not None:
                for parent, name in ns.names_of(conn, ino):
                    if name == MANIFEST:
                        created += ns.fork_pages(conn, parent, stored.digest, uid, gid)
            return created

        try:
            stored, created = await self.content.store(
                stg, parse_manifest=is_manifest,
                then=lambda stored: self.db.run_in_transaction(fn, stored))
        except StoreFull as e:
            stg.forget_early()     # (gc may take write-behind's blobs: room comes back sooner)
            raise StoreFull(f"{self.path_of(ino)}: {e}") from None  # the log line names the file
        except _LateRefusal as e:
            stored = StoredContent(stg.size, "", [], [], manifest_error=e.error)
        if stored.manifest_error is not None:
            where = self.path_of(ino)
            log.warning("close %s: refused manifest: %s", where, stored.manifest_error)
            stg.close()
            st.staging = None
            self._notify("inode", ino, False)
            raise FUSEError(errno.EINVAL)
        st.blocks, st.size = stored.blocks, stored.size
        stg.dirty = False
        stg.unsynced = 0
        self._announce(created)

    async def _drop_state_if_idle(self, ino: int) -> None:
        st = self.states.get(ino)
        if st is None or st.opens > 0:
            return
        if st.staging is not None:
            if st.staging.dirty:
                async with st.lock:
                    try:
                        await self._commit(ino, st)
                    except FUSEError as e:
                        log.warning("release %s: staged changes dropped (%s)", self.path_of(ino),
                                    os.strerror(e.errno))
                    except (StoreFull, StoreUnavailable) as e:
                        log.warning("release %s: staged changes dropped (%s)", self.path_of(ino), e)
            if st.opens > 0:
                return
            if st.staging is not None:
                stg = st.staging
                st.staging = None  # a release waiting on the lock finds nothing left to commit
                if stg.journaled and not stg.dirty:
                    # Its fsynced bytes are committed: that commit is made durable
                    # before the journal file goes.
                    await self.content.sync_pending()
                    await self.db.sync_wal()
                stg.close()
                if st.opens > 0:
                    return      # (opened again meanwhile)
        if self.states.get(ino) is st:  # (such a waiter may come second)
            del self.states[ino]
            await self._maybe_delete(ino)

    @handler
    async def flush(self, fh):
        if fh in self.virtual.handles:
            return await self.virtual.flush(fh)
        await self._flush(self.handles[fh])

    async def _flush(self, of: OpenFile, any_handle: bool = False) -> None:
        st = self.states.get(of.ino)
        # A reader's close neither commits nor fails on a writer's staged bytes
        # (say, left by a close that failed); fsync of any handle does commit.
        if (of.writable or any_handle) and st is not None and st.staging is not None \
                and st.staging.dirty:
            async with st.lock:
                await self._commit(of.ino, st)

    @handler
    async def fsync(self, fh, datasync):
        if fh in self.virtual.handles:
            return
        of = self.handles[fh]
        st = self.states.get(of.ino)
        if st is not None and st.staging is not None and st.staging.dirty and self.journal_fsync:
            async with st.lock:
                stg = st.staging
                if stg is not None and stg.dirty and not stg.unloaded \
                        and (stg.journaled or stg.journal_pays()) \
                        and not self._named_manifest(of.ino, st):
                    # Durable, not committed: the staged bytes go to a journal file
                    # (flushed), at the cost of what changed since the last fsync; the
                    # close commits them. A manifest.json is committed (and checked) now.
                    await trio.to_thread.run_sync(stg.journal, of.ino)
        if not (st is not None and st.staging is not None and st.staging.journaled):
            await self._flush(of, True)
        await self.content.sync_pending()
        await self.db.sync_wal()

    def _named_manifest(self, ino: int, st: InodeState) -> bool:
        return not st.plain and any(n == MANIFEST for _, n in ns.names_of(self.db.ro, ino))

    async def replay_journals(self, paths: list[str]) -> None:
        """At mount, before serving: commit the bytes that fsync() left in journal
        files (``staging/fsynced-<inode>-…``) of a daemon that ended without
        committing them (killed, or the machine went down)."""
        for path in paths:
            ino = journal_inode(os.path.basename(path))
            node = None
            try:
                node = ns.get_inode(self.db.ro, ino) if ino is not None else None
            except FsError:
                pass
            if node is None or not stat.S_ISREG(node.mode) or not ns.names_of(self.db.ro, ino):
                log.info("fsynced bytes of inode %s dropped: the file is gone (%s)", ino, path)
                os.unlink(path)
                continue
            st = self._state(ino)
            st.opens += 1
            try:
                st.staging = Staging.adopt(self.budget, path)
                size = st.staging.size
                st.writer_uid, st.writer_gid = node.uid, node.gid
                async with st.lock:
                    try:
                        await self._commit(ino, st)
                    except (FUSEError, StoreFull, StoreUnavailable) as e:
                        why = os.strerror(e.errno) if isinstance(e, FUSEError) else str(e)
                        log.warning("fsynced bytes of %s not committed (%s): %s kept for the next "
                                    "mount", self.path_of(ino), why, path)
                        if st.staging is not None:
                            st.staging.path = None      # (the file stays)
                            st.staging.close()
                            st.staging = None
                        continue
                log.info("committed the fsynced bytes of %s (%d bytes) left by the previous run",
                         self.path_of(ino), size)
            finally:
                st.opens -= 1
                await self._drop_state_if_idle(ino)

    @handler
    async def release(self, fh):
        if fh in self.virtual.handles:
            self.virtual.release(fh)
            return
        of = self.handles.pop(fh)
        st = self.states.get(of.ino)
        if st is None:
            return
        st.opens -= 1
        st.writers -= of.writable
        await self._drop_state_if_idle(of.ino)

    # -- directories ------------------------------------------------------------

    @handler
    async def opendir(self, inode, ctx):
        if self.virtual.owns(inode):
            return await self.virtual.opendir(inode, ctx)
        node = ns.get_inode(self.db.ro, inode)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        if ns.is_folded(self.db.ro, inode):
            await self.db.write(ns.unfold, inode)
        return inode

    @handler
    async def readdir(self, fh, start_id, token):
        if self.virtual.owns(fh):
            await self.virtual.readdir(fh, start_id, token)
            return
        cur = self.db.ro.execute(ns.READDIR_SQL, (fh, start_id))
        listing = self._listings.get(fh)
        if start_id == 0 or listing is None:
            if len(self._listings) >= LISTINGS_KEPT:
                self._listings.pop(next(iter(self._listings)))
            listing = self._listings[fh] = Listing()
        for row in cur:
            node = ns.Inode(*row[2:])
            if not pyfuse3.readdir_reply(token, row[1], self._attrs(node), row[0]):
                return
            self._lookup_inc(node.id)
            self._where[node.id] = (fh, row[1])
            if len(listing.inos) < LISTING_MAX:
                listing.pos[node.id] = len(listing.inos)
                listing.inos.append(node.id)
        if fh == ns.ROOT_INODE:
            self.virtual.readdir_root(start_id, token)

    @handler
    async def releasedir(self, fh):
        if self.virtual.owns(fh):
            self.virtual.releasedir(fh)

    @handler
    async def fsyncdir(self, fh, datasync):
        await self.content.sync_pending()
        await self.db.sync_wal()

    @handler
    async def statfs(self, ctx):
        return self.content.statfs(self.db.ro, self.db.data_version())

    # -- extended attributes ----------------------------------------------------

    @staticmethod
    def _xattr_ns_ok(name: bytes) -> None:
        if not (name.startswith(b"user.") or name.startswith(b"trusted.")):
            raise FUSEError(errno.EOPNOTSUPP)
        if len(name) > XATTR_NAME_MAX:
            raise FUSEError(errno.ERANGE)

    @handler
    async def setxattr(self, inode, name, value, ctx):
        if self.virtual.owns(inode):
            if name in (SAVE_XATTR, LOAD_XATTR) and self.virtual.live is not None:
                return await self._live_fork(inode, name, value, ctx)
            raise FUSEError(errno.EPERM)
        if name in READONLY_XATTRS:
            raise FUSEError(errno.EPERM)
        if name == FORK_XATTR:
            return await self._fork_into(inode, value, ctx)
        self._xattr_ns_ok(name)
        if len(value) > XATTR_SIZE_MAX:
            raise FUSEError(errno.E2BIG)
        t = ns.now_ns()

        def fn(conn):
            ns.get_inode(conn, inode)
            conn.execute("INSERT OR REPLACE INTO xattrs (inode, name, value) VALUES (?,?,?)",
                         (inode, name, value))
            conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, inode))
        await self.db.write(fn)

    @handler
    async def getxattr(self, inode, name, ctx):
        if not (name.startswith(b"user.") or name.startswith(b"trusted.")):
            # Namespaces pffs does not keep (security.*, system.posix_acl_*),
            # answered at once: security.capability is asked before every
            # write, and on EOPNOTSUPP `ls -l` stops asking for SELinux labels
            # and ACLs on this filesystem after its first file.
            raise FUSEError(errno.EOPNOTSUPP)
        if self.virtual.owns(inode):
            raise FUSEError(pyfuse3.ENOATTR)
        if name == DIGEST_XATTR:
            node = ns.get_inode(self.db.ro, inode)
            if not node.is_reg:
                raise FUSEError(pyfuse3.ENOATTR)
            st = self.states.get(inode)
            if st is not None and st.staging is not None and st.staging.dirty:
                async with st.lock:
                    await self._commit(inode, st)
                node = ns.get_inode(self.db.ro, inode)
            if node.digest is None:
                # Several blocks: no commit hashes every byte (a small write into a
                # large file re-commits one block), so it is reckoned here.
                h = hashlib.sha256()
                for d in ns.blocks_of(self.db.ro, inode):
                    await trio.to_thread.run_sync(h.update, await self._blob(d, inode))
                return ("sha256:" + h.hexdigest()).encode()
            return node.digest.encode()
        if name == STORE_XATTR and inode == ns.ROOT_INODE:
            return self.virtual.store_json  # .pffs/store.json in one request, for bridges
        if name == PAGES_XATTR:
            # A session folder: which page files do not hold what its manifest lists.
            dirty = {ino for ino, st in self.states.items()
                     if st.staging is not None and st.staging.dirty}
            verdict = page_verdict(self.db.ro, inode, dirty)
            if verdict is None:
                raise FUSEError(pyfuse3.ENOATTR)
            return json.dumps(verdict, separators=(",", ":")).encode()
        if name == ENTRIES_XATTR:
            if not ns.get_inode(self.db.ro, inode).is_dir:
                raise FUSEError(pyfuse3.ENOATTR)
            n = self.db.ro.execute(
                "SELECT (SELECT COUNT(*) FROM dentries WHERE parent=:d)"
                " + COALESCE((SELECT files FROM folds WHERE dir=:d), 0)", dict(d=inode)).fetchone()[0]
            return str(n).encode()
        row = self.db.ro.execute("SELECT value FROM xattrs WHERE inode=? AND name=?",
                                 (inode, name)).fetchone()
        if row is None:
            raise FUSEError(pyfuse3.ENOATTR)
        return row[0]

    @handler
    async def listxattr(self, inode, ctx):
        if self.virtual.owns(inode):
            return []
        return [r[0] for r in self.db.ro.execute("SELECT name FROM xattrs WHERE inode=?", (inode,))]

    @handler
    async def removexattr(self, inode, name, ctx):
        if name in READONLY_XATTRS or self.virtual.owns(inode):
            raise FUSEError(errno.EPERM)
        t = ns.now_ns()

        def fn(conn):
            cur = conn.execute("DELETE FROM xattrs WHERE inode=? AND name=?", (inode, name))
            if cur.rowcount == 0:
                raise FsError(pyfuse3.ENOATTR)
            conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, inode))
        await self.db.write(fn)

    # -- lifecycle ----------------------------------------------------------------

    async def commit_all(self) -> None:
        """Commit every staged change (at unmount)."""
        for ino, st in list(self.states.items()):
            if st.staging is not None and st.staging.dirty:
                async with st.lock:
                    try:
                        await self._commit(ino, st)
                    except FUSEError as e:
                        log.warning("unmount: %s: staged changes dropped (%s)", self.path_of(ino),
                                    os.strerror(e.errno))
                    except (StoreFull, StoreUnavailable) as e:
                        log.warning("unmount: %s: staged changes dropped (%s)", self.path_of(ino), e)

