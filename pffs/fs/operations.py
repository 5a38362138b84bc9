"""pyfuse3's Operations: each FUSE request routed, by the one table in
pffs.fs.routing, to the tree that owns its inode or handle, with the tree's
errors mapped to errnos in one place (``handler``).

The daemon builds the trees and hands them to Operations
(pffs.daemon.handlers.build).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

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
    StatvfsData,
    XAttrNameT,
)

from pffs import namespace as ns
from pffs.errors import StoreFull, StoreUnavailable
from pffs.fs.copies import copy_pieces
from pffs.fs.namespace_tree import NamespaceTree
from pffs.fs.routing import (
    DIR_HANDLES,
    ENGINES,
    FILE_HANDLES,
    GRAFTS,
    INODES,
    NAMESPACE,
    PFFS,
    ROOT,
    VIRT_BASE,
    Tree,
    tree_of,
)
from pffs.namespace import FsError

log = logging.getLogger("pffs.fs")

# pyfuse3 built with third_party/pyfuse3's patch answers copy_file_range
# (PFFS_STOCK_PYFUSE3=1: as if it were not).
COPY_RANGE = hasattr(pyfuse3.Operations, "copy_file_range") and not os.environ.get("PFFS_STOCK_PYFUSE3")
# pyfuse3 built with the patch's fifth part sends fallocate (without it the
# kernel answers EOPNOTSUPP itself).
FALLOCATE = hasattr(pyfuse3.Operations, "fallocate") and not os.environ.get("PFFS_STOCK_PYFUSE3")
# pyfuse3 built with the patch's fourth part: after answering a request, read
# for the next one for SPIN_US microseconds before waiting (PFFS_SPIN_US; 0: off).
SPIN = hasattr(pyfuse3, "set_spin") and not os.environ.get("PFFS_STOCK_PYFUSE3")
SPIN_US = 30


def spin_us() -> int:
    """Microseconds pyfuse3 reads for a client's next request before it waits:
    a client sending requests one after another (cp) sends its next one
    10-20 us after its reply, sooner than a wait in trio's scheduler takes
    (docs/performance.md)."""
    raw = os.environ.get("PFFS_SPIN_US", "")
    try:
        return max(0, int(raw)) if raw else SPIN_US
    except ValueError:
        log.warning("PFFS_SPIN_US=%r is not a number of microseconds: using %d", raw, SPIN_US)
        return SPIN_US


# PFFS_TIMING=1: count and time every handler; the daemon logs the totals at unmount.
TIMING: dict[str, tuple[int, float]] | None = {} if os.environ.get("PFFS_TIMING") else None


P = ParamSpec("P")
R = TypeVar("R")


def handler(fn: Callable[Concatenate[Operations, P], Awaitable[R]],
            ) -> Callable[Concatenate[Operations, P], Coroutine[Any, Any, R]]:
    """Map namespace errors to errnos; log anything unexpected and answer EIO."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: P.args, **kwargs: P.kwargs) -> R:
        t0 = time.perf_counter()
        self.requests[name] = self.requests.get(name, 0) + 1
        try:
            return await fn(self, *args, **kwargs)
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


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, trees: dict[str, Tree], requests: dict[str, int], copies: dict[str, int],
                 read_only: bool = False):
        super().__init__()
        self.trees = trees
        self.namespace: NamespaceTree = trees[NAMESPACE]   # type: ignore[assignment]
        self.requests = requests   # FUSE requests served, by handler (in stats.json)
        self.copies = copies       # bytes copy_file_range shared and copied (in stats.json)
        # A read-only mount (-o ro): the kernel refuses every change with EROFS
        # before it asks; what reaches a handler that changes something is
        # refused here too, so nothing changes whatever the kernel does.
        self.read_only = read_only

    def _changes(self) -> None:
        """Before a request that changes something: EROFS on a read-only mount."""
        if self.read_only:
            raise FUSEError(errno.EROFS)

    def _by_inode(self, ino: int) -> Tree:
        if ino < VIRT_BASE:
            return self.namespace
        return self._tree(tree_of(INODES, ino))

    def _by_fh(self, fh: int) -> Tree:
        if fh < VIRT_BASE:
            return self.namespace
        return self._tree(tree_of(FILE_HANDLES, fh))

    def _by_dh(self, fh: int) -> Tree:
        if fh < VIRT_BASE:
            return self.namespace
        return self._tree(tree_of(DIR_HANDLES, fh))

    def _tree(self, name: str) -> Tree:
        t = self.trees.get(name)
        if t is None:
            raise FUSEError(errno.ENOENT)
        return t

    # -- names and attributes ------------------------------------------------

    @handler
    async def lookup(self, parent_inode: InodeT, name: FileNameT,
                     ctx: RequestContext | None = None) -> EntryAttributes:
        if parent_inode == ROOT and name in GRAFTS and GRAFTS[name] in self.trees:
            return await self.trees[GRAFTS[name]].lookup(parent_inode, name, ctx)
        return await self._by_inode(parent_inode).lookup(parent_inode, name, ctx)

    @handler
    async def forget(self, inode_list: Sequence[tuple[InodeT, int]]) -> None:
        for ino, n in inode_list:
            if ino < VIRT_BASE:       # (.pffs/ and engines/ count no lookups)
                await self.namespace.forget(ino, n)

    @handler
    async def getattr(self, inode: InodeT, ctx: RequestContext | None = None) -> EntryAttributes:
        return await self._by_inode(inode).getattr(inode, ctx)

    @handler
    async def setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields,
                      fh: FileHandleT | None, ctx: RequestContext) -> EntryAttributes:
        self._changes()
        return await self._by_inode(inode).setattr(inode, attr, fields, fh, ctx)

    @handler
    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        return await self._by_inode(inode).readlink(inode, ctx)

    @handler
    async def mkdir(self, parent_inode: InodeT, name: FileNameT, mode: ModeT,
                    ctx: RequestContext) -> EntryAttributes:
        self._changes()
        return await self._by_inode(parent_inode).mkdir(parent_inode, name, mode, ctx)

    @handler
    async def mknod(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        self._changes()
        return await self._by_inode(parent_inode).mknod(parent_inode, name, mode, rdev, ctx)

    @handler
    async def symlink(self, parent_inode: InodeT, name: FileNameT, target: FileNameT,
                      ctx: RequestContext) -> EntryAttributes:
        self._changes()
        return await self._by_inode(parent_inode).symlink(parent_inode, name, target, ctx)

    @handler
    async def create(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, flags: FlagT,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        self._changes()
        return await self._by_inode(parent_inode).create(parent_inode, name, mode, flags, ctx)

    @handler
    async def unlink(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        self._changes()
        await self._by_inode(parent_inode).unlink(parent_inode, name, ctx)

    @handler
    async def rmdir(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        self._changes()
        await self._by_inode(parent_inode).rmdir(parent_inode, name, ctx)

    @handler
    async def rename(self, parent_inode_old: InodeT, name_old: FileNameT, parent_inode_new: InodeT,
                     name_new: FileNameT, flags: FlagT, ctx: RequestContext) -> None:
        self._changes()
        # Between two trees: the one that is not the namespace says (engines/
        # takes sessions in by name only, .pffs/ nothing).
        tree = self._by_inode(parent_inode_old)
        if tree is self.namespace:
            tree = self._by_inode(parent_inode_new)
        await tree.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx)

    @handler
    async def link(self, inode: InodeT, new_parent_inode: InodeT, new_name: FileNameT,
                   ctx: RequestContext) -> EntryAttributes:
        self._changes()
        if self._by_inode(inode) is not self.namespace \
                or self._by_inode(new_parent_inode) is not self.namespace:
            raise FUSEError(errno.EPERM)
        return await self.namespace.link(inode, new_parent_inode, new_name, ctx)

    # -- files ---------------------------------------------------------------------

    @handler
    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        if (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC:
            self._changes()
        return await self._by_inode(inode).open(inode, flags, ctx)

    @handler  # (a memoryview of a cached blob: pyfuse3 replies from any buffer)
    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        return await self._by_fh(fh).read(fh, off, size)

    @handler
    async def write(self, fh: FileHandleT, off: int, buf: bytes) -> int:
        self._changes()
        return await self._by_fh(fh).write(fh, off, buf)

    @handler
    async def flush(self, fh: FileHandleT) -> None:
        await self._by_fh(fh).flush(fh)

    @handler
    async def copy_file_range(self, fh_in: FileHandleT, off_in: int, fh_out: FileHandleT, off_out: int,
                              length: int, flags: int) -> int:
        self._changes()
        # (Only pyfuse3 built with third_party/pyfuse3's patch sends it.)
        if not COPY_RANGE:
            raise FUSEError(errno.ENOSYS)     # the kernel copies from now on
        tree_in, tree_out = self._by_fh(fh_in), self._by_fh(fh_out)
        if tree_in is tree_out:
            return await tree_in.copy_file_range(fh_in, off_in, fh_out, off_out, length, flags)
        if flags:
            raise FUSEError(errno.EINVAL)
        # Between two trees (a session copied into engines/E/, a live one out
        # of it): a whole committed file goes as its blob's name (the engine
        # reads the blob from the store itself); other bytes go from one tree
        # to the other here, in pieces, instead of crossing FUSE twice.
        if off_in == 0 and off_out == 0:
            blob = await tree_in.whole_blob(fh_in)
            if blob is not None and length >= blob[1] and await tree_out.take_blob(fh_out, *blob):
                self.copies["shared_bytes"] += blob[1]
                return blob[1]
        done = await copy_pieces(tree_in.read, fh_in, off_in, tree_out.write, fh_out, off_out, length)
        self.copies["copied_bytes"] += done
        return done

    @handler
    async def fallocate(self, fh: FileHandleT, mode: int, offset: int, length: int) -> None:
        self._changes()
        # (Only pyfuse3 built with third_party/pyfuse3's patch sends it.)
        if not FALLOCATE:
            raise FUSEError(errno.ENOSYS)     # the kernel answers EOPNOTSUPP from now on
        await self._by_fh(fh).fallocate(fh, mode, offset, length)

    @handler
    async def fsync(self, fh: FileHandleT, datasync: bool) -> None:
        await self._by_fh(fh).fsync(fh, datasync)

    @handler
    async def release(self, fh: FileHandleT) -> None:
        await self._by_fh(fh).release(fh)

    # -- folders ----------------------------------------------------------------------

    @handler
    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        return await self._by_inode(inode).opendir(inode, ctx)

    @handler
    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> None:
        done = await self._by_dh(fh).readdir(fh, start_id, token)
        if fh == ROOT and done:
            for name in (PFFS, ENGINES):
                if name in self.trees:
                    self.trees[name].readdir_root(start_id, token)

    @handler
    async def releasedir(self, fh: FileHandleT) -> None:
        await self._by_dh(fh).releasedir(fh)

    @handler
    async def fsyncdir(self, fh: FileHandleT, datasync: bool) -> None:
        await self.namespace.fsyncdir(fh, datasync)

    @handler
    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        return await self.namespace.statfs(ctx)

    # -- extended attributes -------------------------------------------------------

    @handler
    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: RequestContext) -> None:
        self._changes()
        await self._by_inode(inode).setxattr(inode, name, value, ctx)

    @handler
    async def getxattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> bytes:
        if not (name.startswith(b"user.") or name.startswith(b"trusted.")):
            # Namespaces pffs does not keep (security.*, system.posix_acl_*),
            # answered at once: security.capability is asked before every
            # write, and on EOPNOTSUPP `ls -l` stops asking for SELinux labels
            # and ACLs on this filesystem after its first file.
            raise FUSEError(errno.EOPNOTSUPP)
        return await self._by_inode(inode).getxattr(inode, name, ctx)

    @handler
    async def listxattr(self, inode: InodeT, ctx: RequestContext) -> Sequence[XAttrNameT]:
        return await self._by_inode(inode).listxattr(inode, ctx)

    @handler
    async def removexattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> None:
        self._changes()
        await self._by_inode(inode).removexattr(inode, name, ctx)
