"""Where sessions are written and read: sinks and sources of page bytes.

The bridge talks to a small protocol, so the same page-out writes into a
plain directory, a mounted pffs path (also just a directory) or, later,
straight into a blob store.  A directory session appears atomically: it is
built in a hidden ``.<name>.tmp-<random>/`` folder beside its destination,
manifest.json written last, then renamed into place, never over an existing
name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Protocol, Union, runtime_checkable

from pffs.manifest import MANIFEST_NAME, PAGES_DIR, page_name
from pffs.types import Digest, digest_of, is_digest

#: Extended attribute a pffs mount sets on page files: the digest of their bytes.
DIGEST_XATTR = "user.pffs.digest"


@runtime_checkable
class SessionSink(Protocol):
    """Receives one session: pages (any order), then the manifest, then commit.

    ``write_page`` must consume *data* before it returns (the buffer is the
    bridge's staging memory and is reused) and return the page's digest.
    ``commit`` makes the session visible at once and raises FileExistsError
    if the name is taken; ``abort`` discards everything written.  Pages are
    written from one thread, in order, unless the sink sets
    ``concurrent = True``: then several pages may be written at once.
    """

    def write_page(self, ix: int, data: memoryview) -> Digest: ...

    def write_manifest(self, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class SessionSource(Protocol):
    """Gives one session's manifest and page bytes.

    ``read_page`` returns the exact bytes of a page file and raises
    FileNotFoundError for a missing one.  ``page_digest`` may return the
    digest of a page without reading it (a filesystem that knows it), else
    None.  Sources may also offer ``page_size(ix) -> int`` and
    ``read_page_into(ix, out) -> int`` (fill *out* when the page is exactly
    ``len(out)`` bytes; return the page's size); the bridge uses them when
    present to check sizes without reading and to read without copying.
    """

    def read_manifest(self) -> bytes: ...

    def read_page(self, ix: int) -> bytes: ...

    def page_digest(self, ix: int) -> Digest | None: ...


SinkLike = Union[SessionSink, str, os.PathLike]
SourceLike = Union[SessionSource, str, os.PathLike]

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


class DirSink:
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


class DirSource:
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


class MemorySession:
    """A session held in memory: a sink that, once committed, is also a source.

    It knows each page's digest from when it was written, and its bytes
    cannot change, so it offers them as :meth:`page_digest`.
    """

    concurrent = True

    def __init__(self) -> None:
        self.pages: dict[int, bytes] = {}
        self.digests: dict[int, Digest] = {}
        self.manifest: bytes | None = None
        self.committed = False
        self._staged: dict[int, tuple[bytes, Digest]] = {}
        self._manifest: bytes | None = None

    def write_page(self, ix: int, data: memoryview) -> Digest:
        b = bytes(data)
        d = digest_of(b)
        self._staged[ix] = (b, d)
        return d

    def write_manifest(self, data: bytes) -> None:
        self._manifest = bytes(data)

    def commit(self) -> None:
        if self.committed:
            raise FileExistsError(errno.EEXIST, "session exists", "<memory>")
        self.pages = {ix: b for ix, (b, _) in self._staged.items()}
        self.digests = {ix: d for ix, (_, d) in self._staged.items()}
        self.manifest, self.committed = self._manifest, True
        self._staged = {}

    def abort(self) -> None:
        self._staged, self._manifest = {}, None

    def read_manifest(self) -> bytes:
        if self.manifest is None:
            raise FileNotFoundError(errno.ENOENT, "no manifest", MANIFEST_NAME)
        return self.manifest

    def read_page(self, ix: int) -> bytes:
        try:
            return self.pages[ix]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "no such page", page_name(ix)) from None

    def page_size(self, ix: int) -> int:
        return len(self.read_page(ix))

    def page_digest(self, ix: int) -> Digest | None:
        return self.digests.get(ix)
