"""Sessions as folders: a sink and a source of page files in any directory,
a pffs mount's included (through the mount: the way bytes travel when no
other is open).

A folder session appears atomically: it is built in a hidden
``.<name>.tmp-<random>/`` folder beside its destination, manifest.json
written last, then renamed into place, never over an existing name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

from engine_bridge.transport.session_io import SinkBase, SourceBase
from pffs.manifest import page_name
from pffs.names import DIGEST_XATTR, MANIFEST_NAME, PAGES_DIR
from pffs.types import Digest, digest_of, is_digest

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _load_renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None


_renameat2 = _load_renameat2()


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename *src* to *dst*, raising FileExistsError if *dst* exists.

    Uses ``renameat2(RENAME_NOREPLACE)`` (atomic); where the filesystem does
    not support that flag, checks first and renames (a plain rename would
    silently replace an existing empty directory).
    """
    s, d = os.fsencode(src), os.fsencode(dst)
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, s, _AT_FDCWD, d, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(d))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), os.fsdecode(s), None, os.fsdecode(d))
    if os.path.lexists(d):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(d))
    try:
        os.rename(s, d)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(d)) from None
        raise


def new_session_place(dest: str | os.PathLike) -> tuple[Path, Path]:
    """(*dest*, the hidden temp folder beside it a session is built in): ValueError
    for a name that cannot be one, FileExistsError for a name taken."""
    dest = Path(dest)
    name = dest.name
    if not name or name in (".", ".."):
        raise ValueError(f"{dest!s}: not usable as a session name")
    if os.path.lexists(dest):
        raise FileExistsError(errno.EEXIST, "session exists", str(dest))
    return dest, dest.parent / f".{name}.tmp-{secrets.token_hex(6)}"


class DirSink(SinkBase):
    """Writes a session folder at *dest* (any directory, a pffs mount included).

    The destination must not exist; its parent must.  Nothing is visible at
    *dest* until :meth:`commit`.
    """

    concurrent = True  # each page is its own file

    def __init__(self, dest: str | os.PathLike):
        self.dest, self.tmp = new_session_place(dest)
        os.mkdir(self.tmp)
        self._pages = self.tmp / PAGES_DIR
        os.mkdir(self._pages)
        self._done = False

    def write_page(self, ix: int, data: memoryview) -> Digest:
        digest = digest_of(data)
        with open(self._pages / page_name(ix), "wb") as f:
            f.write(data)
        return digest

    def write_manifest(self, data: bytes) -> None:
        with open(self.tmp / MANIFEST_NAME, "wb") as f:
            f.write(data)

    def commit(self) -> None:
        rename_noreplace(self.tmp, self.dest)
        self._done = True

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True


class DirSource(SourceBase):
    """Reads a session folder (plain or on a pffs mount)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._pages = self.path / PAGES_DIR

    def read_manifest(self) -> bytes:
        with open(self.path / MANIFEST_NAME, "rb") as f:
            return f.read()

    def read_page(self, ix: int) -> bytes:
        with open(self._pages / page_name(ix), "rb") as f:
            return f.read()

    def page_size(self, ix: int) -> int:
        return os.stat(self._pages / page_name(ix)).st_size

    def read_page_into(self, ix: int, out: memoryview) -> int:
        with open(self._pages / page_name(ix), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != len(out):
                return size
            got = 0
            while got < size:
                n = f.readinto(out[got:])
                if not n:
                    return got  # shrank while being read
                got += n
            if f.read(1):
                return size + 1  # grew while being read
            return got

    def page_digest(self, ix: int) -> Digest | None:
        try:
            raw = os.getxattr(self._pages / page_name(ix), DIGEST_XATTR)
        except OSError:
            return None
        value = raw.decode("ascii", "replace").strip()
        return Digest(value) if is_digest(value) else None
