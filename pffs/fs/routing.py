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
from collections.abc import Sequence

import pyfuse3
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

    async def lookup(self, parent: InodeT, name: FileNameT, ctx: RequestContext | None) -> EntryAttributes:
        raise FUSEError(errno.ENOENT)

    async def forget(self, inode: InodeT, n: int) -> None:
        """The kernel dropped *n* lookups of *inode* (never raises)."""

    async def getattr(self, inode: InodeT, ctx: RequestContext | None) -> EntryAttributes:
        raise FUSEError(errno.ENOENT)

    async def setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields,
                      fh: FileHandleT | None, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        raise FUSEError(errno.EINVAL)

    async def mkdir(self, parent: InodeT, name: FileNameT, mode: ModeT, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    # (A node or symlink in a made-up folder: there is one of that name already.)
    async def mknod(self, parent: InodeT, name: FileNameT, mode: ModeT, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EEXIST)

    async def symlink(self, parent: InodeT, name: FileNameT, target: FileNameT,
                      ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EEXIST)

    async def create(self, parent: InodeT, name: FileNameT, mode: ModeT, flags: FlagT,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        raise FUSEError(errno.EPERM)

    async def unlink(self, parent: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        raise FUSEError(errno.EPERM)

    async def rmdir(self, parent: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        raise FUSEError(errno.EPERM)

    async def rename(self, p_old: InodeT, n_old: FileNameT, p_new: InodeT, n_new: FileNameT, flags: FlagT,
                     ctx: RequestContext) -> None:
        raise FUSEError(errno.EPERM)

    async def link(self, inode: InodeT, new_parent: InodeT, new_name: FileNameT,
                   ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        raise FUSEError(errno.EACCES)

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes | memoryview:
        raise FUSEError(errno.EBADF)

    async def write(self, fh: FileHandleT, off: int, buf: bytes) -> int:
        raise FUSEError(errno.EBADF)

    async def flush(self, fh: FileHandleT) -> None:
        pass

    async def copy_file_range(self, fh_in: FileHandleT, off_in: int, fh_out: FileHandleT, off_out: int,
                              length: int, flags: FlagT) -> int:
        """(EOPNOTSUPP: the kernel copies the bytes itself, through read and write.)"""
        raise FUSEError(errno.EOPNOTSUPP)

    async def whole_blob(self, fh: FileHandleT) -> tuple[str, int, BlobRow | None] | None:
        """(digest, size, its row if the namespace may lack one) of the one stored
        blob that file handle *fh*'s file is, whole, or None: a copy into another
        tree may then name the blob."""
        return None

    async def take_blob(self, fh: FileHandleT, digest: str, size: int, row: BlobRow | None) -> bool:
        """Make the empty file open as *fh* hold blob *digest* (*size* bytes)
        without moving a byte; False where it cannot (then the bytes are copied)."""
        return False

    async def fallocate(self, fh: FileHandleT, mode: int, offset: int, length: int) -> None:
        raise FUSEError(errno.EOPNOTSUPP)

    async def fsync(self, fh: FileHandleT, datasync: bool) -> None:
        pass

    async def release(self, fh: FileHandleT) -> None:
        pass

    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        return inode

    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> bool:
        """List folder handle *fh* from cookie *start_id*: whether every entry fit."""
        raise FUSEError(errno.ENOTDIR)

    def readdir_root(self, start_id: int, token: ReaddirToken) -> None:
        """A grafted tree's entry in the root's listing (after the namespace's)."""

    async def releasedir(self, fh: FileHandleT) -> None:
        pass

    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.EPERM)

    async def getxattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> bytes:
        raise FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: InodeT, ctx: RequestContext) -> Sequence[XAttrNameT]:
        return []

    async def removexattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> None:
        raise FUSEError(errno.EPERM)
