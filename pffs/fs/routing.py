"""The trees a mount serves, the one handler protocol they share, and the one
table of which inode and handle numbers belong to which tree.

Three trees answer FUSE requests: the namespace (``pffs.fs.namespace_tree``: sessions,
pages and every other file, rows in SQLite), ``.pffs/`` (``pffs.fs.virtual``:
figures made up on the fly) and ``engines/`` (``pffs.live.view``: live
engines' sessions).  ``pffs.fs.operations.Operations`` routes each request to
one of them by the numbers below, and no tree looks at another's numbers.
"""

from __future__ import annotations

import errno

import pyfuse3
from pyfuse3 import FUSEError

from pffs.names import CONTROL_DIR_B, ENGINES_DIR_B
from pffs.namespace import BlobRow
from pffs.types import InodeNo

NAMESPACE, PFFS, ENGINES = "namespace", "pffs", "engines"

VIRT_BASE = 1 << 62
LIVE_BASE = VIRT_BASE + (1 << 60)
LIVE_END = VIRT_BASE + (1 << 61)
LIVE_HANDLES = VIRT_BASE + (1 << 61)
TOP = 1 << 63

# (first, end, tree): inode numbers ...
INODES = ((1, VIRT_BASE, NAMESPACE), (VIRT_BASE, LIVE_BASE, PFFS), (LIVE_BASE, LIVE_END, ENGINES))
# ... file handles (open, create) ...
FILE_HANDLES = ((1, VIRT_BASE, NAMESPACE), (VIRT_BASE, LIVE_HANDLES, PFFS),
                (LIVE_HANDLES, TOP, ENGINES))
# ... and folder handles (opendir): the namespace's and .pffs/'s are the
# folder's inode number, engines/' a number space of its own.
DIR_HANDLES = ((1, VIRT_BASE, NAMESPACE), (VIRT_BASE, LIVE_BASE, PFFS), (LIVE_HANDLES, TOP, ENGINES))

# Names in the namespace's root that are other trees' (never rows).
GRAFTS = {CONTROL_DIR_B: PFFS, ENGINES_DIR_B: ENGINES}
ROOT = InodeNo(1)


def tree_of(table: tuple[tuple[int, int, str], ...], number: int) -> str:
    """The tree that *table* gives *number* to (ENOENT for none)."""
    for first, end, name in table:
        if first <= number < end:
            return name
    raise FUSEError(errno.ENOENT)


def is_namespace(ino: int) -> bool:
    return ino < VIRT_BASE


def reserved(parent: int, name: bytes) -> bool:
    """Whether the namespace must not hold *name* in *parent*: a graft, or a
    folder of another tree."""
    return (parent == ROOT and name in GRAFTS) or not is_namespace(parent)


class Tree:
    """The handler protocol of a tree: the FUSE requests routed to it, with
    the arguments pyfuse3 gives (file and folder handles already this tree's).

    What a tree does not serve is refused as made-up files are: EPERM for a
    change, no extended attributes.
    """

    async def lookup(self, parent, name, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.ENOENT)

    def forget(self, inode: int, n: int) -> None:
        """The kernel dropped *n* lookups of *inode* (never raises)."""

    async def getattr(self, inode, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.ENOENT)

    async def setattr(self, inode, attr, fields, fh, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def readlink(self, inode, ctx) -> bytes:
        raise FUSEError(errno.EINVAL)

    async def mkdir(self, parent, name, mode, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EPERM)

    # (A node or symlink in a made-up folder: there is one of that name already.)
    async def mknod(self, parent, name, mode, rdev, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EEXIST)

    async def symlink(self, parent, name, target, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EEXIST)

    async def create(self, parent, name, mode, flags, ctx):
        raise FUSEError(errno.EPERM)

    async def unlink(self, parent, name, ctx) -> None:
        raise FUSEError(errno.EPERM)

    async def rmdir(self, parent, name, ctx) -> None:
        raise FUSEError(errno.EPERM)

    async def rename(self, p_old, n_old, p_new, n_new, flags, ctx) -> None:
        raise FUSEError(errno.EPERM)

    async def link(self, inode, new_parent, new_name, ctx) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def open(self, inode, flags, ctx) -> pyfuse3.FileInfo:
        raise FUSEError(errno.EACCES)

    async def read(self, fh, off, size) -> bytes | memoryview:
        raise FUSEError(errno.EBADF)

    async def write(self, fh, off, buf) -> int:
        raise FUSEError(errno.EBADF)

    async def flush(self, fh) -> None:
        pass

    async def copy_file_range(self, fh_in, off_in, fh_out, off_out, length, flags) -> int:
        """(EOPNOTSUPP: the kernel copies the bytes itself, through read and write.)"""
        raise FUSEError(errno.EOPNOTSUPP)

    async def whole_blob(self, fh) -> tuple[str, int, BlobRow | None] | None:
        """(digest, size, its row if the namespace may lack one) of the one stored
        blob that file handle *fh*'s file is, whole, or None: a copy into another
        tree may then name the blob."""
        return None

    async def take_blob(self, fh, digest: str, size: int, row: BlobRow | None) -> bool:
        """Make the empty file open as *fh* hold blob *digest* (*size* bytes)
        without moving a byte; False where it cannot (then the bytes are copied)."""
        return False

    async def fsync(self, fh, datasync) -> None:
        pass

    async def release(self, fh) -> None:
        pass

    async def opendir(self, inode, ctx) -> int:
        return inode

    async def readdir(self, fh, start_id, token) -> bool:
        """List folder handle *fh* from cookie *start_id*: whether every entry fit."""
        raise FUSEError(errno.ENOTDIR)

    def readdir_root(self, start_id, token) -> None:
        """A grafted tree's entry in the root's listing (after the namespace's)."""

    async def releasedir(self, fh) -> None:
        pass

    async def setxattr(self, inode, name, value, ctx) -> None:
        raise FUSEError(errno.EPERM)

    async def getxattr(self, inode, name, ctx) -> bytes:
        raise FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode, ctx) -> list[bytes]:
        return []

    async def removexattr(self, inode, name, ctx) -> None:
        raise FUSEError(errno.EPERM)
