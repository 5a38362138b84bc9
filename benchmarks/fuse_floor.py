#!/usr/bin/env python3
"""What pyfuse3 itself costs: a filesystem that does no work at all.

Serves one directory of N regular files of SIZE bytes each, all with the
same bytes held in memory (open, read, flush, release and getxattr answered
at once, attributes cached by the kernel), so reading it through the kernel
measures only the round trips that every pyfuse3 filesystem pays per file.
It also takes new folders and files and drops what is written to them, so
`cp -r` into it measures the same for writes, and `cp` of its files into a
new folder within it the same for copies (copy_file_range).
``benchmarks/fs.py`` runs it beside pffs.

    python benchmarks/fuse_floor.py MOUNTPOINT N SIZE     (serves until unmounted)
"""

from __future__ import annotations

import errno
import os
import stat
import sys

import pyfuse3
import trio


class Floor(pyfuse3.Operations):
    def __init__(self, n: int, size: int):
        super().__init__()
        self.n = n
        self.data = os.urandom(size)
        self.made: dict[tuple[int, bytes], int] = {}   # what was created: (parent, name) -> inode
        self.modes: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.next_ino = 1 << 32

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = (stat.S_IFDIR | 0o755) if ino == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o644)
        a.st_size = 0 if ino == pyfuse3.ROOT_INODE else len(self.data)
        a.st_nlink = 1
        a.st_blocks = (a.st_size + 511) // 512    # (not sparse: cp copies it with copy_file_range)
        a.st_blksize = 1 << 20
        a.entry_timeout = a.attr_timeout = 300
        return a

    async def getattr(self, inode, ctx=None):
        if inode in self.modes:
            return self._made_attrs(inode)
        return self._attrs(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if (parent_inode, name) in self.made:
            return self._made_attrs(self.made[(parent_inode, name)])
        try:
            ix = int(name)
        except ValueError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        if parent_inode != pyfuse3.ROOT_INODE or not 0 <= ix < self.n:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(ix + 2)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        for ix in range(start_id, self.n):
            if not pyfuse3.readdir_reply(token, b"%06d" % ix, self._attrs(ix + 2), ix + 1):
                return

    async def releasedir(self, fh):
        pass

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        return self.data[off:off + size]

    async def flush(self, fh):
        pass

    async def release(self, fh):
        pass

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.EOPNOTSUPP)

    # Writes are taken and dropped: `cp -r` into the mount pays only the round trips.

    def _new(self, parent: int, name: bytes, mode: int) -> pyfuse3.EntryAttributes:
        ino = self.next_ino = self.next_ino + 1
        self.made[(parent, name)] = ino
        self.modes[ino] = mode
        return self._made_attrs(ino)

    def _made_attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = self._attrs(ino)
        a.st_mode = self.modes[ino]
        a.st_size = self.sizes.get(ino, 0)
        a.st_blocks = (a.st_size + 511) // 512
        return a

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._new(parent_inode, name, stat.S_IFDIR | 0o755)

    async def create(self, parent_inode, name, mode, flags, ctx):
        a = self._new(parent_inode, name, stat.S_IFREG | 0o644)
        return pyfuse3.FileInfo(fh=a.st_ino), a

    async def write(self, fh, off, buf):
        self.sizes[fh] = max(self.sizes.get(fh, 0), off + len(buf))
        return len(buf)

    # With the patched pyfuse3 (third_party/pyfuse3): `cp` of files within the
    # mount is one copy_file_range a file, answered at once.
    async def copy_file_range(self, fh_in, off_in, fh_out, off_out, length, flags):
        size = self.sizes[fh_in] if fh_in in self.modes else len(self.data)
        n = max(0, min(length, size - off_in))
        self.sizes[fh_out] = max(self.sizes.get(fh_out, 0), off_out + n)
        return n


def main() -> int:
    mountpoint, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pyfuse3.init(Floor(n, size), mountpoint, set(pyfuse3.default_options) | {"fsname=pffs-floor"})
    if hasattr(pyfuse3, "set_spin"):    # (as pffs sets it: pffs.fs.operations.spin_us)
        pyfuse3.set_spin(int(os.environ.get("PFFS_SPIN_US", "30")) * 1000)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()
        if hasattr(pyfuse3, "read_counts"):
            print(f"pffs-floor: requests read {pyfuse3.read_counts()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
