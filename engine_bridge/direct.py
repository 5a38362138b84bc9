"""The direct data path: page bytes between the engine and a mounted pffs's store.

A path inside a pffs mount whose daemon offers it (``.pffs/store.json``
says ``direct``) and whose store folder this process may read and write is
served beside the FUSE loop: the bridge's own threads hash, encode and put
blob frames with the store's put protocol (temp file, rename, grouped
fsyncs), and read, decode and verify them back; the mount carries only the
names, in a constant number of requests:

- page out: a hidden temp folder and its ``pages/`` (two mkdirs), the pages
  put as blobs while the gc lock is held shared and each pinned, then
  manifest.json written through the mount (the daemon adopts the blob files
  and its metadata-only fork makes every page file appear), one
  ``user.pffs.pages`` look to confirm it, and the rename into place;
- page in: manifest.json through the mount, one ``user.pffs.pages`` look
  saying which page files do not hold what the manifest lists (those are
  read through the mount, so every refusal reads as before), the rest
  straight from the store by digest.

Either way the session, its bytes and digests are those the mount path gives.
Anything else (not a pffs mount, ``engines/``, an S3 store, a store limit,
another host, a uid without access, ``PFFS_DIRECT=0``) goes through the mount;
a reason worth knowing is logged once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pffs import codec as codec_mod
from pffs.errors import CodecError, IntegrityError, MissingBlob
from pffs.manifest import MANIFEST_NAME, PAGES_DIR, Manifest, ManifestError, page_name, parse
from pffs.store.local import LocalBlobStore
from pffs.storedir import GcLock
from pffs.types import Digest, digest_of

from .errors import DamagedPage, PageOutError
from .sessions import (
    DirSink,
    DirSource,
    SessionSink,
    SessionSource,
    SinkLike,
    SourceLike,
    new_session_place,
    rename_noreplace,
)

log = logging.getLogger("engine_bridge.direct")

PROTOCOL = 1
PAGES_XATTR = "user.pffs.pages"
STORE_XATTR = "user.pffs.store"
FSTYPE = "fuse.pffs"


@dataclass
class StoreAccess:
    """A mounted pffs whose store this process may use directly."""
    mountpoint: str
    root: Path
    codec: str
    info: dict = field(default_factory=dict)

    def blobs(self) -> LocalBlobStore:
        return LocalBlobStore(self.root, codec=self.codec)


_lock = threading.Lock()
_found: dict[tuple[str, str], StoreAccess | str] = {}
_said: set[tuple[str, str]] = set()


def _unescape(field_: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1:i + 4].isdigit() and i + 4 <= len(field_):
            out.append(chr(int(field_[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def pffs_mount_of(path: str | os.PathLike) -> tuple[str, str, str] | None:
    """(mount point, its device as 'major:minor', path inside it) of the pffs
    mount holding *path*, from ``/proc/self/mountinfo`` (no request to any
    filesystem), or None."""
    p = os.path.abspath(os.fspath(path))
    best = None
    dev = ""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        parts = left.split()
        if len(parts) < 5 or right.split()[0] != FSTYPE:
            continue
        mp = _unescape(parts[4])
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best)):
            best, dev = mp, parts[2]
    if best is None:
        return None
    return best, dev, os.path.relpath(p, best)


def _load_getxattr() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).getxattr
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_ssize_t
        return fn
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None


_c_getxattr = _load_getxattr()


def getxattr(path: str | os.PathLike, name: str) -> bytes:
    """An xattr's value in one request (os.getxattr asks with a small buffer first)."""
    if _c_getxattr is None:
        return os.getxattr(path, name)
    buf = ctypes.create_string_buffer(1 << 16)
    n = _c_getxattr(os.fsencode(path), name.encode(), buf, len(buf))
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    return buf.raw[:n]


def _say(mp: str, reason: str, level=logging.INFO) -> None:
    with _lock:
        if (mp, reason) in _said:
            return
        _said.add((mp, reason))
    log.log(level, "%s: pages go through the mount: %s", mp, reason)


def store_access(path: str | os.PathLike) -> StoreAccess | None:
    """Direct access to the store of the pffs mount holding *path*, or None (use the mount)."""
    if os.environ.get("PFFS_DIRECT", "1") == "0":
        return None
    found = pffs_mount_of(path)
    if found is None:
        return None
    mp, dev, rel = found
    first = rel.split("/", 1)[0]
    if first in ("engines", ".pffs"):
        return None  # the live view pages into the engine itself
    key = (mp, dev)  # a new mount at the same place is another device
    with _lock:
        got = _found.get(key)
    if got is None:
        got = _probe(mp)
        with _lock:
            _found[key] = got
    if isinstance(got, str):
        _say(mp, got, logging.WARNING if got.startswith("cannot") else logging.INFO)
        return None
    return got


def _probe(mp: str) -> StoreAccess | str:
    """The store of mount *mp* if this process may use it, else why not."""
    try:
        # .pffs/store.json's bytes, in one request.
        info = json.loads(getxattr(mp, STORE_XATTR))
    except (OSError, ValueError) as e:
        return f"no usable .pffs/store.json ({e})"
    if info.get("protocol") != PROTOCOL:
        return f"the daemon speaks direct protocol {info.get('protocol')!r}, this bridge {PROTOCOL}"
    if not info.get("direct"):
        return info.get("reason") or "the daemon does not offer the direct path"
    if info.get("kind") != "local":
        return f"a store of kind {info.get('kind')!r}"
    root = Path(info["root"])
    try:
        st = os.stat(root)
    except PermissionError:
        return f"cannot reach the store folder {root} as uid {os.getuid()} (permission denied)"
    except OSError as e:
        return f"cannot reach the store folder {root} ({e.strerror}): another host or namespace?"
    if (st.st_dev, st.st_ino) != (info.get("dev"), info.get("ino")):
        return f"cannot use {root}: not the folder the daemon uses (another host or namespace)"
    blobs = Path(info["blobs"])
    pins = Path(info["pins"])
    for what, p in (("blob folder", blobs), ("pin folder", pins)):
        if not os.access(p, os.R_OK | os.W_OK | os.X_OK):
            return f"cannot write the store's {what} {p} as uid {os.getuid()}"
    for name in ("gc.lock", "gc.intent"):
        p = root / name
        if os.path.exists(p) and not os.access(p, os.R_OK | os.W_OK):
            return f"cannot take the store's gc lock {p} as uid {os.getuid()}"
        if not os.path.exists(p) and not os.access(root, os.W_OK):
            return f"cannot create the store's gc lock {p} as uid {os.getuid()}"
    some = blobs / "00"
    if not os.access(some, os.W_OK | os.X_OK):
        return f"cannot write the store's blob folders ({some}) as uid {os.getuid()}"
    return StoreAccess(mp, root, info.get("codec") or codec_mod.DEFAULT_CODEC, info)


def sink_for(dest: str | os.PathLike):
    """A sink writing a session at *dest*: direct where it can be, else a DirSink."""
    access = store_access(Path(dest).parent)
    if access is None:
        return DirSink(dest)
    return DirectSink(dest, access)


def source_for(path: str | os.PathLike):
    """A source reading the session at *path*: direct where it can be, else a DirSource."""
    access = store_access(path)
    if access is None:
        return DirSource(path)
    return DirectSource(path, access)


def _verdict(folder: Path) -> dict | None:
    try:
        raw = getxattr(folder, PAGES_XATTR)
    except OSError:
        return None
    try:
        v = json.loads(raw)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


class DirectSink:
    """Writes a session at *dest* in a pffs mount, page bytes straight into its store.

    The store's gc lock is held shared from the first put until the pages are
    all put, and every page is pinned until the session is named, so no gc
    sweeps a page in between (see pffs.storedir.GcLock).
    """

    concurrent = True

    def __init__(self, dest: str | os.PathLike, access: StoreAccess):
        self.dest, self.tmp = new_session_place(dest)
        self.access = access
        self.blobs = access.blobs()
        # Puts with a batch skip their own fsyncs: see commit().
        self.batch = self.blobs.batch()
        gc = GcLock(access.root)
        self.pins = gc.pin()
        try:
            os.mkdir(self.tmp)
            os.mkdir(self.tmp / PAGES_DIR)
            self._hold = gc.hold_shared()
        except BaseException:
            self.pins.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.digests: dict[int, Digest] = {}
        self.manifest: bytes | None = None
        self._done = False

    def write_page(self, ix: int, data: memoryview) -> Digest:
        d = digest_of(data)
        self.pins.add((d,))
        self.blobs.put(data, d, batch=self.batch)
        self.digests[ix] = d
        return d

    def write_manifest(self, data: bytes) -> None:
        self.manifest = bytes(data)

    def commit(self) -> None:
        manifest = self.manifest
        if manifest is None:
            raise PageOutError("commit before write_manifest")
        # The daemon's commit of manifest.json takes the lock too, behind a
        # waiting gc: from here on the pins alone keep the pages.  It adopts
        # the blobs into its own group of fsyncs, done before the namespace
        # rows naming them are made durable (as for the blobs of its closes).
        self._hold.release()
        fd = os.open(self.tmp / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(manifest)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        self._fill_missing(manifest)
        rename_noreplace(self.tmp, self.dest)
        self._done = True
        self.pins.close()

    def _fill_missing(self, manifest: bytes) -> None:
        """Pages the daemon did not make appear (it refused a frame): write them through the mount."""
        v = _verdict(self.tmp)
        if v is not None and not v.get("bad"):
            return
        m = parse(manifest)
        bad = range(len(m.pages)) if v is None or v.get("more") else v["bad"]
        pages = self.tmp / PAGES_DIR
        for ix in bad:
            p = pages / page_name(ix)
            if os.path.exists(p):
                continue
            try:
                data = self.blobs.get(Digest(m.pages[ix]))
            except (IntegrityError, OSError) as e:
                raise PageOutError(f"page {page_name(ix)}: its blob could not be read back from the"
                                   f" store ({e})") from None
            with open(p, "wb") as f:
                f.write(data)
        if v is not None:
            log.info("%s: %d pages written through the mount", self.dest, len(bad))

    def abort(self) -> None:
        if not self._done:
            self._hold.release()
            self.pins.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True


class DirectSource:
    """Reads a session in a pffs mount, page bytes straight from its store.

    Pages the daemon does not vouch for (missing, changed, not one blob) are
    read through the mount, so the bridge's refusals name them as before.
    """

    def __init__(self, path: str | os.PathLike, access: StoreAccess):
        self.path = Path(path)
        self.mount = DirSource(path)
        self.blobs = access.blobs()
        self._manifest: Manifest | None = None
        self._good: frozenset[int] = frozenset()

    def read_manifest(self) -> bytes:
        data = self.mount.read_manifest()
        v = _verdict(self.path)
        self._manifest, self._good = None, frozenset()
        if v is None or v.get("manifest") != digest_of(data) or v.get("more"):
            return data
        try:
            m = parse(data)
        except ManifestError:
            return data
        self._manifest = m
        self._good = frozenset(range(len(m.pages))) - set(v.get("bad", ()))
        return data

    def _digest(self, ix: int) -> Digest | None:
        m = self._manifest  # set whenever _good is not empty
        return Digest(m.pages[ix]) if m is not None and ix in self._good else None

    def page_size(self, ix: int) -> int:
        d = self._digest(ix)
        if d is None:
            return self.mount.page_size(ix)
        try:
            return self.blobs.header(d).raw_len
        except MissingBlob:
            return self.mount.page_size(ix)  # (its file went since: the mount says so)
        except IntegrityError as e:
            raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None

    def read_page_into(self, ix: int, out: memoryview) -> int:
        d = self._digest(ix)
        if d is None:
            return self.mount.read_page_into(ix, out)
        try:
            frame = self.blobs.get_frame(d)
        except MissingBlob:
            return self.mount.read_page_into(ix, out)
        try:
            # The bridge checks the sha256 of what lands in *out*.
            return codec_mod.decode_into(frame, out, check_crc=False)
        except CodecError as e:
            raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None

    def why_mismatch(self, ix: int) -> str | None:
        """Why a page read straight from the store has the wrong sha256 (None: read through the mount)."""
        d = self._digest(ix)
        return None if d is None else f"its blob {d} in the store is damaged (its bytes' sha256 differs)"

    def read_page(self, ix: int) -> bytes:
        d = self._digest(ix)
        if d is None:
            return self.mount.read_page(ix)
        try:
            return self.blobs.get(d, verify=False)
        except MissingBlob:
            return self.mount.read_page(ix)
        except IntegrityError as e:
            raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None

    def page_digest(self, ix: int) -> Digest | None:
        d = self._digest(ix)
        return d if d is not None else self.mount.page_digest(ix)


def as_sink(dest: SinkLike) -> SessionSink:
    """A sink for *dest*: itself if it is one; for a path a DirSink, or a
    :class:`DirectSink` in a pffs mount that allows it."""
    if isinstance(dest, (str, os.PathLike)):
        return sink_for(dest)
    if isinstance(dest, SessionSink):
        return dest
    raise TypeError(f"not a session sink or path: {dest!r}")


def as_source(src: SourceLike) -> SessionSource:
    """A source for *src*: itself if it is one; for a path a DirSource, or a
    :class:`DirectSource` in a pffs mount that allows it."""
    if isinstance(src, (str, os.PathLike)):
        return source_for(src)
    if isinstance(src, SessionSource):
        return src
    raise TypeError(f"not a session source or path: {src!r}")
