"""Manifests and forks: what a file must hold to take the name manifest.json,
and the forks made without a byte of a page crossing FUSE.

A session's manifest.json is accepted (parsed and checked, pffs.manifest)
before the name is given; accepting it gives its folder's ``pages/`` the
page files it lists as a metadata-only fork (``namespace.fork_pages``).
``pffs fork`` asks for such a fork with one setxattr on the new folder
(FORK_XATTR), or has a live engine's bridge page a session out or in
(SAVE_XATTR, LOAD_XATTR: set on a folder of ``engines/``, answered by
pffs.live.view.EnginesTree with the checks of resolve_new and
resolve_readable).
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import trio
from pyfuse3 import FUSEError

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.fs.blobcache import BlobReader
from pffs.fs.content import ContentStore
from pffs.fs.db import Database
from pffs.fs.files import Files
from pffs.fs.inodes import InodeTable, Invalidator
from pffs.fs.routing import reserved
from pffs.namespace import FsError

log = logging.getLogger("pffs.fs")

MANIFEST = mf.MANIFEST_NAME.encode()


def _may(node: ns.Inode, ctx, bit: int) -> bool:
    """Whether the caller of *ctx* has permission *bit* (4 read, 1 search) on *node*."""
    if ctx.uid == 0:
        return True
    if ctx.uid == node.uid:
        return bool(node.mode & (bit << 6))
    if ctx.gid == node.gid:
        return bool(node.mode & (bit << 3))
    return bool(node.mode & bit)


@dataclass
class Manifests:
    db: Database
    content: ContentStore
    inodes: InodeTable
    files: Files
    reader: BlobReader
    invalidate: Invalidator

    async def validate_existing(self, ino: int, new_parent: int, op: str) -> ns.CheckedManifest | None:
        """Validate the content of *ino* before it takes the name manifest.json
        (None: not a regular file, nothing to check)."""
        node = ns.get_inode(self.db.ro, ino)
        if not node.is_reg:
            return None
        if await self.files.commit_staged(ino, check_manifest=False):
            node = ns.get_inode(self.db.ro, ino)
        blocks = ns.blocks_of(self.db.ro, ino)
        where = f"{self.inodes.path_of(new_parent).rstrip('/')}/manifest.json"
        if node.size > mf.MAX_MANIFEST_BYTES:
            log.warning("%s %s: refused manifest: %d bytes exceed the %d-byte cap", op, where,
                        node.size, mf.MAX_MANIFEST_BYTES)
            raise FUSEError(errno.EINVAL)
        try:
            data = b"".join([await self.reader.blob(d, ino) for d in blocks])
            m = await trio.to_thread.run_sync(mf.parse, data, limiter=self.content.limiter)
            keys = await trio.to_thread.run_sync(ns.manifest_keys, m, limiter=self.content.limiter)
            if self.content.adopt is not None:
                await trio.to_thread.run_sync(self.content.adopt, m.pages, limiter=self.content.limiter)
            if self.content.publisher is not None and keys is not None:
                self.content.publisher.publish(keys[0], [(k, m.pages[ix]) for ix, k in keys[1]])
        except mf.ManifestError as e:
            log.warning("%s %s: refused manifest: %s", op, where, e)
            raise FUSEError(errno.EINVAL) from None
        return (node.digest, m.pages, keys)

    def resolve_readable(self, path: bytes, ctx, folder: bool = False) -> int:
        """The inode at *path* (from the mount's root) that the caller may read:
        search permission on every folder on the way, read permission on the
        file, as the kernel would check them (the caller's supplementary
        groups are not known here: they do not count).  With *folder*, a
        folder the caller may search."""
        ino: int = ns.ROOT_INODE
        for name in (n for n in path.split(b"/") if n and n != b"."):
            node = ns.get_inode(self.db.ro, ino)
            if not node.is_dir:
                raise FsError(errno.ENOTDIR)
            if not _may(node, ctx, 1):
                raise FsError(errno.EACCES)
            if name == b".." or reserved(ino, name):
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

    async def fork_into(self, folder: int, value: bytes, ctx) -> None:
        """``setxattr(folder, user.pffs.fork, path)``: see FORK_XATTR.

        EINVAL when *path* is not a manifest.json accepted as valid (the
        caller then copies its bytes, whose close says why), EEXIST when the
        folder has a manifest.json, EOPNOTSUPP on an S3 store (whose forks
        adopt pages from the bucket as the manifest's close does).
        """
        if self.content.blobs.remote:
            raise FUSEError(errno.EOPNOTSUPP)
        src = self.resolve_readable(value, ctx)
        await self.files.commit_staged(src)
        created = await self.db.write(ns.fork_manifest, src, folder, ctx.uid, ctx.gid)
        self.invalidate.inode(folder, True)
        self.invalidate.announce(created)

    def resolve_new(self, path: bytes, ctx) -> int:
        """The folder that will hold a new entry at *path* (from the mount's root),
        which the caller may search and write, as the kernel would check."""
        parts = [n for n in path.split(b"/") if n and n != b"."]
        if not parts:
            raise FsError(errno.EINVAL)
        ns.check_name(parts[-1])
        parent = self.resolve_readable(b"/".join(parts[:-1]), ctx, folder=True)
        node = ns.get_inode(self.db.ro, parent)
        if not (_may(node, ctx, 2) and _may(node, ctx, 1)):
            raise FsError(errno.EACCES)
        if reserved(parent, parts[-1]):
            raise FsError(errno.EINVAL)
        if ns.lookup(self.db.ro, parent, parts[-1]) is not None:
            raise FsError(errno.EEXIST)
        return parent
