"""The namespace's FUSE handlers: names, attributes, folders and extended
attributes in SQLite (pffs.namespace), file contents through pffs.fs.files,
manifest acceptance and forks through pffs.fs.manifests.

Reads of the namespace are short indexed queries on the loop's read
connection; every change is one function of pffs.namespace run by the
writer (``Database.write``).  See docs/concurrency.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import stat
from dataclasses import dataclass

import pyfuse3
import trio
from pyfuse3 import FUSEError

from pffs import namespace as ns
from pffs.fs.adoption import page_verdict
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
from pffs.names import STORE_XATTR_B as STORE_XATTR
from pffs.namespace import FsError

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

    @property
    def reader(self) -> BlobReader:
        return self.files.reader

    def path_of(self, ino: int) -> str:
        return self.inodes.path_of(ino)

    def attrs(self, node: ns.Inode) -> pyfuse3.EntryAttributes:
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
        st = self.inodes.states.get(node.id)
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
        return self.attrs(ns.get_inode(self.db.ro, ino))

    # -- lookups and attributes --------------------------------------------

    async def lookup(self, parent, name, ctx):
        if len(name) > ns.NAME_MAX:
            log.info("lookup in %s: name of %d bytes refused (limit %d)", self.path_of(parent),
                     len(name), ns.NAME_MAX)
            raise FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            ino = parent
        elif name == b"..":
            row = self.db.ro.execute("SELECT parent FROM dentries WHERE inode=? LIMIT 1",
                                     (parent,)).fetchone()
            ino = row[0] if row else ns.ROOT_INODE
        else:
            ino = ns.lookup(self.db.ro, parent, name)
            if ino is None:
                ino = await self._lookup_folded(parent, name)
        attr = self._getattr(ino)
        self.inodes.looked_up(ino)
        if name not in (b".", b".."):
            self.prefetch.where[ino] = (parent, name)
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

    async def forget(self, inode, n):
        if not self.inodes.forgot(inode, n):
            return
        self.prefetch.forgot(inode)
        try:
            await self.inodes.maybe_delete(inode)
        except Exception:
            log.exception("forget of inode %d", inode)

    async def getattr(self, inode, ctx):
        return self._getattr(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
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
            st = self.inodes.states.get(inode)
            if st is not None and st.staging is not None:
                # An explicit mtime wins over the time of the staged writes.
                st.staging.mtime_ns = attr.st_mtime_ns
        if changes or fields.update_size:
            changes["ctime_ns"] = attr.st_ctime_ns if fields.update_ctime else t
            await self.db.write_small(lambda c: ns.set_attrs(c, inode, **changes))
        return self._getattr(inode)

    async def readlink(self, inode, ctx):
        node = ns.get_inode(self.db.ro, inode)
        if not stat.S_ISLNK(node.mode):
            raise FUSEError(errno.EINVAL)
        return node.target

    # -- directory changes -------------------------------------------------

    async def _make(self, parent, name, mode, ctx, rdev=0, target=None) -> pyfuse3.EntryAttributes:
        if reserved(parent, name):
            raise FUSEError(errno.EEXIST)
        node = await self.db.write_small(ns.make_inode, parent, name, mode, ctx.uid, ctx.gid, rdev, target)
        self.inodes.looked_up(node.id)
        return self.attrs(node)

    async def mkdir(self, parent, name, mode, ctx):
        mode = stat.S_IFDIR | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make(parent, name, mode, ctx)

    async def mknod(self, parent, name, mode, rdev, ctx):
        if stat.S_IFMT(mode) == 0:
            mode |= stat.S_IFREG
        mode = stat.S_IFMT(mode) | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make(parent, name, mode, ctx, rdev=rdev)

    async def symlink(self, parent, name, target, ctx):
        if len(target) > 4096:
            raise FUSEError(errno.ENAMETOOLONG)
        return await self._make(parent, name, stat.S_IFLNK | 0o777, ctx, target=target)

    async def create(self, parent, name, mode, flags, ctx):
        mode = stat.S_IFREG | (stat.S_IMODE(mode) & ~ctx.umask)
        attr = await self._make(parent, name, mode, ctx)
        fh = self.files.created(attr.st_ino, name, flags, ctx)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), attr

    async def unlink(self, parent, name, ctx):
        await self._remove(ns.unlink, parent, name)

    async def rmdir(self, parent, name, ctx):
        await self._remove(ns.rmdir, parent, name)

    async def _remove(self, remove, parent: int, name: bytes) -> None:
        """A name gone (``ns.unlink`` or ``ns.rmdir``), then its inode unless held.

        The name is a few rows, changed on the loop where nothing else writes
        (write_small); the inode, with what it holds, goes in ``maybe_delete``
        (at once where nothing holds it, else at the kernel's FORGET)."""
        if reserved(parent, name):
            raise FUSEError(errno.EPERM)
        ino, _ = await self.db.write_small(remove, parent, name, _held)
        await self.inodes.maybe_delete(ino)

    async def rename(self, p_old, n_old, p_new, n_new, flags, ctx):
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
        uid, gid = ctx.uid, ctx.gid
        for name_of in ((p_old, n_old), (p_new, n_new)):
            # Both may take a new name (an exchange moves the target too): from
            # now on no flush of theirs skips looking up its names.
            st = self.inodes.states.get(ns.lookup(self.db.ro, *name_of) or 0)
            if st is not None:
                st.plain = False

        def fn(conn):
            ino, replaced, deleted = ns.rename(conn, p_old, n_old, p_new, n_new, flags,
                                               self.inodes.in_use)
            created = []
            if checked is not None:
                created = self.manifests.take_name(conn, ino, checked, p_new, uid, gid)
            return replaced, deleted, created

        replaced, deleted, created = await self.db.write(fn)
        self.invalidate.announce(created)
        if replaced is not None and not deleted:
            await self.inodes.maybe_delete(replaced)

    async def link(self, inode, new_parent, new_name, ctx):
        if reserved(new_parent, new_name):
            raise FUSEError(errno.EPERM)
        checked = None
        if new_name == MANIFEST:
            checked = await self.manifests.validate_existing(inode, new_parent, "link")
        uid, gid = ctx.uid, ctx.gid
        st = self.inodes.states.get(inode)
        if st is not None:
            st.plain = False

        def fn(conn):
            node = ns.link(conn, inode, new_parent, new_name)
            created = []
            if checked is not None:
                created = self.manifests.take_name(conn, inode, checked, new_parent, uid, gid)
            return node, created

        node, created = await self.db.write(fn)
        self.invalidate.announce(created)
        self.inodes.looked_up(inode)
        return self.attrs(node)

    # -- open files: pffs.fs.files ----------------------------------------------

    async def open(self, inode, flags, ctx):
        return await self.files.open(inode, flags, ctx)

    async def read(self, fh, off, size):
        return await self.files.read(fh, off, size)

    async def write(self, fh, off, buf):
        return await self.files.write(fh, off, buf)

    async def flush(self, fh):
        await self.files.flush(fh)

    async def whole_blob(self, fh):
        return self.files.whole_blob(fh)

    async def take_blob(self, fh, digest, size, row):
        return await self.files.take_blob(fh, digest, size, row)

    async def copy_file_range(self, fh_in, off_in, fh_out, off_out, length, flags):
        if flags:
            raise FUSEError(errno.EINVAL)
        return await self.files.copy_range(fh_in, off_in, fh_out, off_out, length)

    async def fsync(self, fh, datasync):
        await self.files.fsync(fh, datasync)

    async def release(self, fh):
        await self.files.release(fh)

    # -- directories ------------------------------------------------------------

    async def opendir(self, inode, ctx):
        node = ns.get_inode(self.db.ro, inode)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        if ns.is_folded(self.db.ro, inode):
            await self.db.write(ns.unfold, inode)
        return inode

    async def readdir(self, fh, start_id, token) -> bool:
        """List folder *fh* from cookie *start_id*: whether every entry fit."""
        if start_id == 0 and ns.is_folded(self.db.ro, fh):
            # A fork folded it since opendir (which unfolds too): its page files
            # are rows again before they are listed.  (Only an empty pages/ is
            # folded, so a listing under way, past its first entry, never is.)
            await self.db.write(ns.unfold, fh)
        cur = self.db.ro.execute(ns.READDIR_SQL, (fh, start_id))
        listing = self.prefetch.listing(fh, start_id)
        for row in cur:
            node = ns.Inode(*row[2:])
            if not pyfuse3.readdir_reply(token, row[1], self.attrs(node), row[0]):
                return False
            self.inodes.looked_up(node.id)
            self.prefetch.where[node.id] = (fh, row[1])
            if len(listing.inos) < LISTING_MAX:
                listing.pos[node.id] = len(listing.inos)
                listing.inos.append(node.id)
        return True

    async def fsyncdir(self, fh, datasync):
        await self.content.sync_pending()
        await self.db.sync_wal()

    async def statfs(self, ctx):
        return self.content.statfs(self.db.ro, self.db.data_version())

    # -- extended attributes ----------------------------------------------------

    async def setxattr(self, inode, name, value, ctx):
        if name in READONLY_XATTRS:
            raise FUSEError(errno.EPERM)
        if name == FORK_XATTR:
            return await self.manifests.fork_into(inode, value, ctx)
        xattr_ns_ok(name)
        if len(value) > XATTR_SIZE_MAX:
            raise FUSEError(errno.E2BIG)
        t = ns.now_ns()

        def fn(conn):
            ns.get_inode(conn, inode)
            conn.execute("INSERT OR REPLACE INTO xattrs (inode, name, value) VALUES (?,?,?)",
                         (inode, name, value))
            conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, inode))
        await self.db.write(fn)

    async def getxattr(self, inode, name, ctx):
        if name == DIGEST_XATTR:
            return await self._digest(inode)
        if name == STORE_XATTR and inode == ROOT:
            return self.store_json  # .pffs/store.json in one request, for bridges
        if name == PAGES_XATTR:
            # A session folder: which page files do not hold what its manifest lists.
            verdict = page_verdict(self.db.ro, inode, self.inodes.dirty())
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

    async def _digest(self, inode: int) -> bytes:
        """DIGEST_XATTR: the sha256 of a file's bytes, its staged ones committed first."""
        node = ns.get_inode(self.db.ro, inode)
        if not node.is_reg:
            raise FUSEError(pyfuse3.ENOATTR)
        st = self.inodes.states.get(inode)
        if st is not None and st.staging is not None and st.staging.dirty:
            async with st.lock:
                await self.files.commit(inode, st)
            node = ns.get_inode(self.db.ro, inode)
        if node.digest is None:
            # Several blocks: no commit hashes every byte (a small write into a
            # large file re-commits one block), so it is reckoned here.
            h = hashlib.sha256()
            for d in ns.blocks_of(self.db.ro, inode):
                await trio.to_thread.run_sync(h.update, await self.reader.blob(d, inode))
            return ("sha256:" + h.hexdigest()).encode()
        return node.digest.encode()

    async def listxattr(self, inode, ctx):
        return [r[0] for r in self.db.ro.execute("SELECT name FROM xattrs WHERE inode=?", (inode,))]

    async def removexattr(self, inode, name, ctx):
        if name in READONLY_XATTRS:
            raise FUSEError(errno.EPERM)
        t = ns.now_ns()

        def fn(conn):
            cur = conn.execute("DELETE FROM xattrs WHERE inode=? AND name=?", (inode, name))
            if cur.rowcount == 0:
                raise FsError(pyfuse3.ENOATTR)
            conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, inode))
        await self.db.write(fn)
