"""The namespace's FUSE handlers: names, attributes, folders and extended
attributes in SQLite (pffs.namespace), file contents through pffs.fs.files,
manifest acceptance and forks through pffs.fs.manifests.

Reads of the namespace are short indexed queries on the loop's read
connection (functions of pffs.namespace); every change is one function of
pffs.namespace run by the writer (``Database.write``), or on the loop where
it need not wait (``Database.write_small``).  What is staged of an open file
is asked of pffs.fs.files.  See docs/concurrency.md.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

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
    StatvfsData,
    XAttrNameT,
)

from pffs import namespace as ns
from pffs.fs.blobcache import BlobReader
from pffs.fs.content import ContentStore
from pffs.fs.db import Database
from pffs.fs.files import MANIFEST, Files
from pffs.fs.inodes import InodeTable, Invalidator
from pffs.fs.manifests import Manifests
from pffs.fs.prefetch import LISTING_MAX, Prefetch
from pffs.fs.routing import ROOT, Tree, reserved
from pffs.names import DIGEST_XATTR_B as DIGEST_XATTR
from pffs.names import ENTRIES_XATTR_B as ENTRIES_XATTR
from pffs.names import FORK_XATTR_B as FORK_XATTR
from pffs.names import PAGES_XATTR_B as PAGES_XATTR
from pffs.names import PREFIX_PUT_XATTR_B as PREFIX_PUT_XATTR
from pffs.names import PREFIX_TOUCH_XATTR_B as PREFIX_TOUCH_XATTR
from pffs.names import PREFIX_XATTR_B as PREFIX_XATTR
from pffs.names import STORE_XATTR_B as STORE_XATTR
from pffs.namespace import prefix_index
from pffs.tokenkeys import parse_keys_value, parse_pairs_value
from pffs.types import Digest

log = logging.getLogger("pffs.fs")

ENTRY_TIMEOUT = 10.0
ATTR_TIMEOUT = 10.0
BLKSIZE = 1 << 20
READONLY_XATTRS = (DIGEST_XATTR, ENTRIES_XATTR, PAGES_XATTR, STORE_XATTR)
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 << 10


def _held(ino: int) -> bool:
    """(For ns.unlink and ns.rmdir: the inode is left for maybe_delete.)"""
    return True


def xattr_ns_ok(name: bytes) -> None:
    """The namespaces pffs keeps: user.* and trusted.*."""
    if not (name.startswith(b"user.") or name.startswith(b"trusted.")):
        raise FUSEError(errno.EOPNOTSUPP)
    if len(name) > XATTR_NAME_MAX:
        raise FUSEError(errno.ERANGE)


#: Calls of the key-only cache between two sums of its bytes (a count that a rolled-back
#: transaction left wrong is right again after at most these).
RECOUNT_EVERY = 4096


def _cache_counted(conn, space: str, rows, t: int, limit: int, held: list) -> int:
    """(In the namespace's writer thread, one at a time) key-only cache rows recorded and
    evicted past *limit*, the cache's bytes kept in *held*."""
    held[1] += 1
    if held[1] >= RECOUNT_EVERY:
        held[:] = [None, 0]
    gone, held[0] = prefix_index.cache_pages_counted(conn, space, rows, t, limit, held[0])
    return gone


@dataclass(eq=False)
class NamespaceTree(Tree):
    db: Database
    content: ContentStore
    inodes: InodeTable
    files: Files
    manifests: Manifests
    prefetch: Prefetch
    invalidate: Invalidator
    #: .pffs/store.json's bytes, also the root's STORE_XATTR (pffs.fs.adoption)
    store_json: bytes = b"{}\n"
    #: bytes the key-only prefix cache may hold (-o prefix_cache_size=)
    prefix_cache_size: int = 4 << 30
    #: [bytes the key-only cache holds (None: not counted yet), calls since counted]:
    #: kept by the writer thread (_cache_counted), so a call costs no pass over its rows
    _cached_bytes: list = field(default_factory=lambda: [None, 0])

    @property
    def reader(self) -> BlobReader:
        return self.files.reader

    def path_of(self, ino: int) -> str:
        return self.inodes.path_of(ino)

    def attrs(self, node: ns.Inode) -> EntryAttributes:
        a = EntryAttributes()
        a.st_ino = node.id
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = node.rdev
        size, mtime = self.files.size_and_mtime(node)
        a.st_size = size
        a.st_blksize = BLKSIZE
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = mtime
        a.st_ctime_ns = node.ctime_ns
        return a

    def _getattr(self, ino: int) -> EntryAttributes:
        return self.attrs(ns.get_inode(self.db.ro, ino))

    # -- lookups and attributes --------------------------------------------

    async def lookup(self, parent: InodeT, name: FileNameT, ctx: RequestContext | None) -> EntryAttributes:
        if len(name) > ns.NAME_MAX:
            log.info("lookup in %s: name of %d bytes refused (limit %d)", self.path_of(parent),
                     len(name), ns.NAME_MAX)
            raise FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            ino = parent
        elif name == b"..":
            row = ns.first_entry(self.db.ro, parent)
            ino = row[0] if row else ns.ROOT_INODE
        else:
            found = ns.lookup(self.db.ro, parent, name)
            ino = found if found is not None else await self._lookup_folded(parent, name)
        attr = self._getattr(ino)
        self.inodes.looked_up(ino)
        if name not in (b".", b".."):
            self.prefetch.where[ino] = (parent, name)
        return attr

    async def _lookup_folded(self, parent: int, name: bytes) -> int:
        """A name missing from *parent*: there after all once a folded fork there is unfolded."""
        ino, folded = ns.lookup_or_folded(self.db.ro, parent, name)
        if ino is None and folded:
            await self.db.write(ns.unfold, parent)
            ino = ns.lookup(self.db.ro, parent, name)
        if ino is None:
            raise FUSEError(errno.ENOENT)
        return ino

    async def forget(self, inode: InodeT, n: int) -> None:
        if not self.inodes.forgot(inode, n):
            return
        self.prefetch.forgot(inode)
        try:
            await self.inodes.maybe_delete(inode)
        except Exception:
            log.exception("forget of inode %d", inode)

    async def getattr(self, inode: InodeT, ctx: RequestContext | None) -> EntryAttributes:
        return self._getattr(inode)

    async def setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields,
                      fh: FileHandleT | None, ctx: RequestContext) -> EntryAttributes:
        node = ns.get_inode(self.db.ro, inode)
        if fields.update_size:
            if not node.is_reg:
                raise FUSEError(errno.EINVAL)
            self.files.size_ok(inode, attr.st_size, "truncate")
            await self.files.truncate(inode, attr.st_size, ctx)
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
            self.files.set_mtime(inode, attr.st_mtime_ns)
        if changes or fields.update_size:
            changes["ctime_ns"] = attr.st_ctime_ns if fields.update_ctime else t
            await self.db.write_small(functools.partial(ns.set_attrs, **changes), inode)
        return self._getattr(inode)

    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        node = ns.get_inode(self.db.ro, inode)
        if not stat.S_ISLNK(node.mode) or node.target is None:
            raise FUSEError(errno.EINVAL)
        return node.target

    # -- directory changes -------------------------------------------------

    async def _make(self, parent: InodeT, name: FileNameT, mode: int, ctx: RequestContext, rdev: int = 0,
                    target: bytes | None = None) -> EntryAttributes:
        if reserved(parent, name):
            raise FUSEError(errno.EEXIST)
        node = await self.db.write_small(ns.make_inode, parent, name, mode, ctx.uid, ctx.gid, rdev, target)
        self.inodes.looked_up(node.id)
        return self.attrs(node)

    async def mkdir(self, parent: InodeT, name: FileNameT, mode: ModeT, ctx: RequestContext) -> EntryAttributes:
        mode = stat.S_IFDIR | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make(parent, name, mode, ctx)

    async def mknod(self, parent: InodeT, name: FileNameT, mode: ModeT, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        if stat.S_IFMT(mode) == 0:
            mode |= stat.S_IFREG
        mode = stat.S_IFMT(mode) | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make(parent, name, mode, ctx, rdev=rdev)

    async def symlink(self, parent: InodeT, name: FileNameT, target: FileNameT,
                      ctx: RequestContext) -> EntryAttributes:
        if len(target) > 4096:
            raise FUSEError(errno.ENAMETOOLONG)
        return await self._make(parent, name, stat.S_IFLNK | 0o777, ctx, target=target)

    async def create(self, parent: InodeT, name: FileNameT, mode: ModeT, flags: FlagT,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        mode = stat.S_IFREG | (stat.S_IMODE(mode) & ~ctx.umask)
        attr = await self._make(parent, name, mode, ctx)
        fh = self.files.created(attr.st_ino, name, flags, ctx)
        return FileInfo(fh=fh, keep_cache=True), attr

    async def unlink(self, parent: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        await self._remove(ns.unlink, parent, name)

    async def rmdir(self, parent: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        await self._remove(ns.rmdir, parent, name)

    async def _remove(self, remove: Callable[..., tuple[int, bool]], parent: int, name: bytes) -> None:
        """A name gone (``ns.unlink`` or ``ns.rmdir``), then its inode unless held.

        The name is a few rows, changed on the loop where nothing else writes
        (write_small); the inode, with what it holds, goes in ``maybe_delete``
        (at once where nothing holds it, else at the kernel's FORGET)."""
        if reserved(parent, name):
            raise FUSEError(errno.EPERM)
        ino, _ = await self.db.write_small(remove, parent, name, _held)
        await self.inodes.maybe_delete(ino)

    async def rename(self, p_old: InodeT, n_old: FileNameT, p_new: InodeT, n_new: FileNameT, flags: FlagT,
                     ctx: RequestContext) -> None:
        if reserved(p_old, n_old) or reserved(p_new, n_new):
            raise FUSEError(errno.EPERM)
        if len(n_new) > ns.NAME_MAX:
            log.info("rename into %s: name of %d bytes refused (limit %d)",
                     self.path_of(p_new), len(n_new), ns.NAME_MAX)
            raise FUSEError(errno.ENAMETOOLONG)
        checked = None
        if n_new == MANIFEST:
            ino = ns.lookup(self.db.ro, p_old, n_old)
            if ino is None:
                raise FUSEError(errno.ENOENT)
            checked = await self.manifests.validate_existing(ino, p_new, "rename")
        for name_of in ((p_old, n_old), (p_new, n_new)):
            # Both may take a new name (an exchange moves the target too).
            self.files.named_anew(ns.lookup(self.db.ro, *name_of) or 0)
        replaced, deleted, created = await self.db.write(
            ns.rename_with_manifest, p_old, n_old, p_new, n_new, flags, self.inodes.in_use, checked,
            ctx.uid, ctx.gid)
        self.invalidate.announce(created)
        if replaced is not None and not deleted:
            await self.inodes.maybe_delete(replaced)

    async def link(self, inode: InodeT, new_parent: InodeT, new_name: FileNameT,
                   ctx: RequestContext) -> EntryAttributes:
        if reserved(new_parent, new_name):
            raise FUSEError(errno.EPERM)
        checked = None
        if new_name == MANIFEST:
            checked = await self.manifests.validate_existing(inode, new_parent, "link")
        self.files.named_anew(inode)
        node, created = await self.db.write(ns.link_with_manifest, inode, new_parent, new_name, checked,
                                            ctx.uid, ctx.gid)
        self.invalidate.announce(created)
        self.inodes.looked_up(inode)
        return self.attrs(node)

    # -- open files: pffs.fs.files ----------------------------------------------

    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        return await self.files.open(inode, flags, ctx)

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes | memoryview:
        return await self.files.read(fh, off, size)

    async def write(self, fh: FileHandleT, off: int, buf: bytes) -> int:
        return await self.files.write(fh, off, buf)

    async def flush(self, fh: FileHandleT) -> None:
        await self.files.flush(fh)

    async def whole_blob(self, fh: FileHandleT) -> tuple[str, int, ns.BlobRow | None] | None:
        return self.files.whole_blob(fh)

    async def take_blob(self, fh: FileHandleT, digest: str, size: int, row: ns.BlobRow | None) -> bool:
        return await self.files.take_blob(fh, digest, size, row)

    async def copy_file_range(self, fh_in: FileHandleT, off_in: int, fh_out: FileHandleT, off_out: int,
                              length: int, flags: FlagT) -> int:
        if flags:
            raise FUSEError(errno.EINVAL)
        return await self.files.copy_range(fh_in, off_in, fh_out, off_out, length)

    async def fallocate(self, fh: FileHandleT, mode: int, offset: int, length: int) -> None:
        """Mode 0 only: the file grows to *offset* + *length* where it is shorter, the
        new bytes a hole (which costs nothing, so nothing is reserved either).
        Keeping the size, punching or zeroing a range: EOPNOTSUPP."""
        of = self.files.handles[fh]     # (open for writing: the kernel checks)
        if mode != 0:
            log.info("fallocate %s: mode %#x refused (pffs grows a file, mode 0, and no other)",
                     self.path_of(of.ino), mode)
            raise FUSEError(errno.EOPNOTSUPP)
        end = offset + length
        self.files.size_ok(of.ino, end, "fallocate")
        if end > self.files.size_and_mtime(ns.get_inode(self.db.ro, of.ino))[0]:
            await self.files.truncate(of.ino, end, of, grow=True)

    async def fsync(self, fh: FileHandleT, datasync: bool) -> None:
        await self.files.fsync(fh, datasync)

    async def release(self, fh: FileHandleT) -> None:
        await self.files.release(fh)

    # -- directories ------------------------------------------------------------

    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        node = ns.get_inode(self.db.ro, inode)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        if ns.is_folded(self.db.ro, inode):
            await self.db.write(ns.unfold, inode)
        return inode

    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> bool:
        """List folder *fh* from cookie *start_id*: whether every entry fit."""
        if start_id == 0 and ns.is_folded(self.db.ro, fh):
            # A fork folded it since opendir (which unfolds too): its page files
            # are rows again before they are listed.  (Only an empty pages/ is
            # folded, so a listing under way, past its first entry, never is.)
            await self.db.write(ns.unfold, fh)
        entries = ns.readdir(self.db.ro, fh, start_id)
        listing = self.prefetch.listing(fh, start_id)
        for cookie, name, node in entries:
            if not pyfuse3.readdir_reply(token, name, self.attrs(node), cookie):
                return False
            self.inodes.looked_up(node.id)
            self.prefetch.where[node.id] = (fh, name)
            if len(listing.inos) < LISTING_MAX:
                listing.pos[node.id] = len(listing.inos)
                listing.inos.append(node.id)
        return True

    async def fsyncdir(self, fh: FileHandleT, datasync: bool) -> None:
        await self.content.sync_pending()
        await self.db.sync_wal()

    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        return self.content.statfs(self.db.ro, self.db.data_version())

    # -- extended attributes ----------------------------------------------------

    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: RequestContext) -> None:
        if name in READONLY_XATTRS:
            raise FUSEError(errno.EPERM)
        if name == FORK_XATTR:
            return await self.manifests.fork_into(inode, value, ctx)
        if name in (PREFIX_XATTR, PREFIX_TOUCH_XATTR):
            return await self._prefix(inode, name, value)
        if name == PREFIX_PUT_XATTR:
            return await self._prefix_put(inode, value)
        xattr_ns_ok(name)
        if len(value) > XATTR_SIZE_MAX:
            raise FUSEError(errno.E2BIG)
        await self.db.write(ns.set_xattr, inode, name, value, ns.now_ns())

    async def getxattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> bytes:
        if name == DIGEST_XATTR:
            return await self._digest(inode)
        if name == STORE_XATTR and inode == ROOT:
            return self.store_json  # .pffs/store.json in one request, for bridges
        if name == PAGES_XATTR:
            # A session folder: which page files do not hold what its manifest lists.
            verdict = ns.page_verdict(self.db.ro, inode, self.inodes.dirty())
            if verdict is None:
                raise FUSEError(pyfuse3.ENOATTR)
            return json.dumps(verdict, separators=(",", ":")).encode()
        if name == ENTRIES_XATTR:
            if not ns.get_inode(self.db.ro, inode).is_dir:
                raise FUSEError(pyfuse3.ENOATTR)
            return str(ns.entry_count(self.db.ro, inode)).encode()
        value = ns.get_xattr(self.db.ro, inode, name)
        if value is None:
            raise FUSEError(pyfuse3.ENOATTR)
        return value

    async def _prefix(self, inode: int, name: bytes, value: bytes) -> None:
        """PREFIX_XATTR: the file's blob kept by one token chain key in the key-only prefix
        cache; PREFIX_TOUCH_XATTR: keys of that cache marked used (SPEC §7)."""
        where = self.inodes.path_of(inode)
        try:
            space, keys = parse_keys_value(value)
        except ValueError as e:
            log.warning("setxattr %s %s: refused: %s", where, name.decode(), e)
            raise FUSEError(errno.EINVAL) from None
        if name == PREFIX_TOUCH_XATTR:
            await self.db.write(prefix_index.touch, space, keys, ns.now_ns())
            return
        node = ns.get_inode(self.db.ro, inode)
        if node.is_reg and await self.files.commit_staged(inode):
            node = ns.get_inode(self.db.ro, inode)
        if len(keys) != 1 or not node.is_reg or node.digest is None or not node.size:
            log.warning("setxattr %s %s: refused: one key for a file of one page", where, name.decode())
            raise FUSEError(errno.EINVAL)
        await self._cache_pages(space, [(keys[0], node.digest, node.size)])

    async def _cache_pages(self, space: str, rows: list[tuple[str, str, int]]) -> None:
        """Key-only cache rows (key, blob, size) recorded, then its LRU eviction."""
        gone = await self.db.write(_cache_counted, space, rows, ns.now_ns(), self.prefix_cache_size,
                                   self._cached_bytes)
        if self.content.publisher is not None:
            self.content.publisher.publish(space, [(k, d) for k, d, _ in rows])
        if gone:
            log.info("prefix cache: %d least recently used key-only pages evicted past %d bytes",
                     gone, self.prefix_cache_size)

    async def _prefix_put(self, inode: int, value: bytes) -> None:
        """PREFIX_PUT_XATTR on the root: blobs a client put into the store (the direct path)
        kept in the key-only prefix cache, each under its key.  Blob files not yet known
        are adopted as a manifest's are; if any named blob is not in the store, nothing is
        recorded (ENOENT)."""
        where = self.inodes.path_of(inode)
        try:
            if inode != ROOT:
                raise ValueError("it is set on the mount's root")
            space, pairs = parse_pairs_value(value)
        except ValueError as e:
            log.warning("setxattr %s %s: refused: %s", where, PREFIX_PUT_XATTR.decode(), e)
            raise FUSEError(errno.EINVAL) from None
        digests = [Digest("sha256:" + d) for _, d in pairs]
        if self.content.adopt is not None:
            await trio.to_thread.run_sync(self.content.adopt, digests, limiter=self.content.limiter)
        sizes = ns.known_blobs(self.db.ro, digests)
        missing = sum(1 for d in set(digests) if d not in sizes)
        if missing:
            log.warning("setxattr %s %s: refused: %d of the %d blobs named are not in the store",
                        where, PREFIX_PUT_XATTR.decode(), missing, len(set(digests)))
            raise FUSEError(errno.ENOENT)
        await self._cache_pages(space, [(k, d, sizes[d]) for (k, _), d in zip(pairs, digests)])

    async def _digest(self, inode: int) -> bytes:
        """DIGEST_XATTR: the sha256 of a file's bytes, its staged ones committed first."""
        node = ns.get_inode(self.db.ro, inode)
        if not node.is_reg:
            raise FUSEError(pyfuse3.ENOATTR)
        if await self.files.commit_staged(inode):
            node = ns.get_inode(self.db.ro, inode)
        if node.digest is None:
            # Several blocks: no commit hashes every byte (a small write into a
            # large file re-commits one block), so it is reckoned here.
            h = hashlib.sha256()
            for d in ns.blocks_of(self.db.ro, inode):
                await trio.to_thread.run_sync(h.update, await self.reader.blob(d, inode))
            return ("sha256:" + h.hexdigest()).encode()
        return node.digest.encode()

    async def listxattr(self, inode: InodeT, ctx: RequestContext) -> list[XAttrNameT]:
        return ns.list_xattrs(self.db.ro, inode)

    async def removexattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> None:
        if name in READONLY_XATTRS:
            raise FUSEError(errno.EPERM)
        await self.db.write(ns.remove_xattr, inode, name, ns.now_ns())
