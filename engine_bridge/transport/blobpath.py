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

A mount of an S3 store offers the same: the bridge puts frames into the
bucket (uploads in parallel on the store's upload threads; a page over 1 MiB
is looked for with a HEAD while it is compressed, so one the bucket holds is
not sent again) and gets them back in parallel, from
the mount's cache folder where it holds them, else from the bucket.  There is
no gc lock to hold: the bucket's gc keeps every blob younger than its grace
period, and puts back from its trash any blob a manifest names again (as for
the mount's own puts).  The client brings its own credentials (the usual AWS
variables or files); the daemon shares only the URL, endpoint, region and
addressing.

Either way the session, its bytes and digests are those the mount path gives.
Anything else (not a pffs mount, ``engines/``, a store limit, another host, a
uid without access to the store folder, a bucket this process cannot reach,
``PFFS_DIRECT=0``) goes through the mount; a reason worth knowing is logged
once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Union

from engine_bridge.errors import DamagedPage, PageOutError
from engine_bridge.transport.folders import (
    DirSink,
    DirSource,
    SessionSink,
    SessionSource,
    SinkLike,
    SourceLike,
    new_session_place,
    rename_noreplace,
)
from pffs import codec as codec_mod
from pffs.client.fork import write_new
from pffs.errors import CodecError, IntegrityError, MissingBlob, PffsError
from pffs.manifest import MANIFEST_NAME, PAGES_DIR, Manifest, ManifestError, page_name, parse
from pffs.store.framecache import PeekCache
from pffs.store.local import LocalBlobStore
from pffs.store.s3 import PUT_FIRST_MAX, S3BlobStore, url_of
from pffs.store.storedir import GcLock
from pffs.types import Digest, digest_bytes, digest_of

log = logging.getLogger("engine_bridge.transport.blobpath")

PROTOCOL = 2    # (pffs.fs.adoption.PROTOCOL)
PAGES_XATTR = "user.pffs.pages"
STORE_XATTR = "user.pffs.store"
FSTYPE = "fuse.pffs"


Blobs = Union[LocalBlobStore, "S3BlobStore"]


@dataclass
class StoreAccess:
    """A mounted pffs whose store this process may use directly."""
    mountpoint: str
    root: Path
    codec: str
    info: dict = field(default_factory=dict)
    #: The bucket of an S3 store (None: a local store folder at *root*).
    bucket: "S3BlobStore | None" = None

    @property
    def kind(self) -> str:
        return "local" if self.bucket is None else "s3"

    def blobs(self) -> Blobs:
        if self.bucket is not None:
            return self.bucket
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
    if info.get("kind") == "s3":
        return _probe_s3(mp, info)
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


def _probe_s3(mp: str, info: dict) -> StoreAccess | str:
    """The bucket of an S3 mount if this process can use it (one request to learn so), else why not."""
    url = url_of(info.get("url"))
    if url is None:
        return f"store.json names no s3:// URL ({info.get('url')!r})"
    options = {k: v for k, v in (info.get("options") or {}).items()
               if k in ("endpoint", "region", "addressing") and isinstance(v, str)}
    # The mount's cache folder, read only, where this host sees the daemon's.
    cache = Path(info.get("cache") or "/nonexistent")
    try:
        st = os.stat(cache)
        same = (st.st_dev, st.st_ino) == (info.get("dev"), info.get("ino"))
    except OSError:
        same = False
    peek = PeekCache(cache if same else Path("/nonexistent/pffs-cache"))
    try:
        bucket = S3BlobStore(cache, url, options=options, codec=info.get("codec") or codec_mod.DEFAULT_CODEC,
                             cache=peek)
        bucket.server_time()  # one request: reachable, with these credentials
    except PffsError as e:
        return f"cannot reach the bucket as uid {os.getuid()}: {e}"
    return StoreAccess(mp, cache, bucket.codec.name, info, bucket)


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


def _fetch_frame(blobs: Blobs, bucket: "S3BlobStore | None", d: Digest) -> tuple[bytes, bool]:
    """The frame of blob *d* and whether it came from the mount's cache folder
    (a bucket's frame is read there where it is, else downloaded)."""
    if bucket is None:
        return blobs.get_frame(d), False
    frame = bucket.cache.get(d)
    if frame is not None:
        return frame, True
    return bucket.download(d), False


def _decode_page(bucket: "S3BlobStore | None", ix: int, d: Digest, frame: bytes, cached: bool,
                 out: memoryview) -> tuple[int, bool]:
    """Decode page *ix*'s *frame* into *out*: (its length, whether the bytes are
    checked to be blob *d*: pffs.codec.decode_into_checked; else the bridge
    hashes them).  A damaged frame of the mount's cache is downloaded again,
    since the bucket has the blob."""
    name = digest_bytes(d)
    try:
        return codec_mod.decode_into_checked(frame, out, name)
    except CodecError as e:
        if not cached or bucket is None:
            raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None
    frame = bucket.download(d)
    try:
        return codec_mod.decode_into_checked(frame, out, name)
    except CodecError as e:
        raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None


class DirectSink:
    """Writes a session at *dest* in a pffs mount, page bytes straight into its store.

    A local store: the gc lock is held shared from the first put until the
    pages are all put, and every page is pinned until the session is named,
    so no gc sweeps a page in between (see pffs.store.storedir.GcLock).  An S3
    store: uploads run on the store's threads and are all in the bucket
    before manifest.json is written (the mount's adoption looks them up).
    """

    concurrent = True

    def __init__(self, dest: str | os.PathLike, access: StoreAccess):
        self.dest, self.tmp = new_session_place(dest)
        self.access = access
        self.blobs = access.blobs()
        # Puts with a batch skip their own fsyncs (see commit()), or (S3) run
        # on the upload threads until commit() waits for them.
        self.batch: Any = self.blobs.batch()
        self.pins: Any = None
        self._hold: Any = None
        gc = GcLock(access.root) if access.bucket is None else None
        if gc is not None:
            self.pins = gc.pin()
        try:
            os.mkdir(self.tmp)
            os.mkdir(self.tmp / PAGES_DIR)
            if gc is not None:
                self._hold = gc.hold_shared()
        except BaseException:
            if self.pins is not None:
                self.pins.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.digests: dict[int, Digest] = {}
        self.manifest: bytes | None = None
        self._done = False

    def write_page(self, ix: int, data: memoryview) -> Digest:
        d = digest_of(data)
        if self.pins is not None:
            self.pins.add((d,))
        try:
            bucket = self.access.bucket
            if bucket is None or memoryview(data).nbytes <= PUT_FIRST_MAX:
                # (A small page: the bucket's conditional PUT says whether it has it.)
                self.blobs.put(data, d, batch=self.batch)
            else:
                # Whether the bucket holds the page already (a HEAD) is asked on the
                # store's threads while this one compresses it.
                head = bucket.pool.submit(bucket.stat, d)
                frame = codec_mod.encode_parts(data, bucket.codec)
                if head.result() is None:
                    bucket.put(data, d, batch=self.batch, frame=frame)
        except PffsError as e:  # (the bucket: unreachable, refusing)
            raise PageOutError(f"page {page_name(ix)}: {e}") from None
        self.digests[ix] = d
        return d

    def write_manifest(self, data: bytes) -> None:
        self.manifest = bytes(data)

    def commit(self) -> None:
        manifest = self.manifest
        if manifest is None:
            raise PageOutError("commit before write_manifest")
        if self.access.bucket is not None:
            try:
                self.batch.sync()  # every upload in the bucket before the mount looks
            except PffsError as e:
                raise PageOutError(f"pages not stored: {e}") from None
        # The daemon's commit of manifest.json takes the lock too, behind a
        # waiting gc: from here on the pins alone keep the pages.  It adopts
        # the blobs into its own group of fsyncs, done before the namespace
        # rows naming them are made durable (as for the blobs of its closes).
        if self._hold is not None:
            self._hold.release()
            self._hold = None
        write_new(self.tmp / MANIFEST_NAME, manifest)
        self._fill_missing(manifest)
        rename_noreplace(self.tmp, self.dest)
        self._done = True
        if self.pins is not None:
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
            except (PffsError, OSError) as e:
                raise PageOutError(f"page {page_name(ix)}: its blob could not be read back from the"
                                   f" store ({e})") from None
            with open(p, "wb") as f:
                f.write(data)
        if v is not None:
            log.info("%s: %d pages written through the mount", self.dest, len(bad))

    def abort(self) -> None:
        if not self._done:
            if self._hold is not None:
                self._hold.release()
                self._hold = None
            if self.access.bucket is not None:
                try:
                    self.batch.sync()  # no upload outlives the page-out (what landed, gc takes)
                except PffsError:
                    pass
            if self.pins is not None:
                self.pins.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True


class BlobSink:
    """Pages put straight into a local pffs store as blobs, no session made:
    the pages of a live snapshot stored for a copy out of ``engines/``
    (the agent's ``store`` request), which the daemon then adopts and names.
    ``rows[i]``: (digest, raw size, stored size, codec) of the page written
    as *i*.  Nothing here is fsynced: the daemon makes the blobs durable as it
    does those of a direct page-out, before rows naming them are."""

    concurrent = True

    def __init__(self, access: StoreAccess):
        self.blobs = access.blobs()
        self.batch: Any = self.blobs.batch()
        self.rows: dict[int, tuple[str, int, int, str]] = {}

    def write_page(self, ix: int, data: memoryview) -> Digest:
        d = digest_of(data)
        r = self.blobs.put(data, d, batch=self.batch)
        self.rows[ix] = (d, r.raw_size, r.stored_size, r.codec)
        return d


class DirectSource:
    """Reads a session in a pffs mount, page bytes straight from its store.

    Pages the daemon does not vouch for (missing, changed, not one blob) are
    read through the mount, so the bridge's refusals name them as before.
    From a bucket, the frames of the next pages are fetched ahead on the
    store's threads (a window of them, however large the session), each from
    the mount's cache folder where it holds it, else from the bucket.
    """

    def __init__(self, path: str | os.PathLike, access: StoreAccess):
        self.path = Path(path)
        self.mount = DirSource(path)
        self.blobs = access.blobs()
        self.bucket = access.bucket
        self._manifest: Manifest | None = None
        self._good: frozenset[int] = frozenset()
        self._page_size: int | None = None
        # (S3) frames fetched ahead: page index → future of (frame, from the cache)
        self._ahead: dict[int, Future] = {}
        self._order: list[int] = []
        self._next = 0
        self._ahead_lock = threading.Lock()
        self.window = 2 * self.bucket.threads if self.bucket is not None else 0

    def read_manifest(self) -> bytes:
        data = self.mount.read_manifest()
        v = _verdict(self.path)
        self._manifest, self._good, self._page_size = None, frozenset(), None
        self._cancel_ahead()
        if v is None or v.get("manifest") != digest_of(data) or v.get("more"):
            return data
        try:
            m = parse(data)
        except ManifestError:
            return data
        self._manifest = m
        self._good = frozenset(range(len(m.pages))) - set(v.get("bad", ()))
        size = v.get("page_size")
        self._page_size = size if isinstance(size, int) else None
        self._order = sorted(self._good)
        return data

    def _digest(self, ix: int) -> Digest | None:
        m = self._manifest  # set whenever _good is not empty
        return Digest(m.pages[ix]) if m is not None and ix in self._good else None

    def page_size(self, ix: int) -> int:
        d = self._digest(ix)
        if d is None:
            return self.mount.page_size(ix)
        if self._page_size is not None:
            return self._page_size  # (the daemon vouches that every good page's file has it)
        try:
            return self.blobs.header(d).raw_len
        except MissingBlob:
            return self.mount.page_size(ix)  # (its file went since: the mount says so)
        except IntegrityError as e:
            raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None
        except PffsError as e:
            raise DamagedPage(ix, f"its blob {d} could not be read: {e}") from None

    # -- frames from a bucket, fetched ahead ---------------------------------

    def _frame(self, ix: int, d: Digest) -> tuple[bytes, bool]:
        """The frame of good page *ix* (and fetches of the pages after it started)."""
        bucket = self.bucket
        if bucket is None:
            return _fetch_frame(self.blobs, None, d)
        with self._ahead_lock:
            fut = self._ahead.pop(ix, None)
            # Keep a window of fetches running past the pages asked for so far.
            while self._next < len(self._order) and len(self._ahead) < self.window:
                j = self._order[self._next]
                self._next += 1
                if j != ix and j not in self._ahead:
                    dj = self._digest(j)
                    if dj is not None:
                        self._ahead[j] = bucket.pool.submit(_fetch_frame, self.blobs, bucket, dj)
        if fut is not None:
            return fut.result()
        return _fetch_frame(self.blobs, bucket, d)

    def _cancel_ahead(self) -> None:
        with self._ahead_lock:
            ahead, self._ahead = self._ahead, {}
            self._order, self._next = [], 0
        for f in ahead.values():
            f.cancel()

    def read_page_into(self, ix: int, out: memoryview) -> int:
        return self.read_page_into_checked(ix, out)[0]

    def read_page_into_checked(self, ix: int, out: memoryview) -> tuple[int, Digest | None]:
        """Page *ix* into *out*: (its length, the digest its bytes are checked to
        have, or None when the bridge must hash them)."""
        d = self._digest(ix)
        if d is None:
            return self.mount.read_page_into(ix, out), None
        try:
            frame, cached = self._frame(ix, d)
            n, checked = _decode_page(self.bucket, ix, d, frame, cached, out)
            return n, d if checked else None
        except MissingBlob:
            return self.mount.read_page_into(ix, out), None   # (its file went since: the mount says so)
        except PffsError as e:
            raise DamagedPage(ix, f"its blob {d} could not be read: {e}") from None

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
        except PffsError as e:
            raise DamagedPage(ix, f"its blob {d} could not be read: {e}") from None

    def page_digest(self, ix: int) -> Digest | None:
        d = self._digest(ix)
        return d if d is not None else self.mount.page_digest(ix)


class PagesAhead(Protocol):
    """Pages decoded ahead of a load (engine_bridge.attach.warm.WarmPages)."""

    def take_into(self, digest: str, out: memoryview) -> int | None: ...


class BlobSource:
    """A session whose every page is the blob its manifest names, read from a
    mount's store by those names (the pages of a session copied into
    ``engines/E/`` whole from the mount: pffs.live's ``load_blobs``).

    *sizes* are the page files' sizes the daemon gives; the bridge checks
    every page's sha256 against the manifest as always, so a blob that is
    missing or damaged is refused naming its page, never loaded.
    """

    def __init__(self, manifest: bytes, sizes: list[int], access: StoreAccess,
                 warm: "PagesAhead | None" = None):
        self.manifest = bytes(manifest)
        self.pages = parse(self.manifest).pages
        self.sizes = list(sizes)
        self.blobs = access.blobs()
        self.bucket = access.bucket
        #: pages decoded ahead while the session was being copied in (engine_bridge.attach.warm)
        self.warm = warm

    def read_manifest(self) -> bytes:
        return self.manifest

    def page_size(self, ix: int) -> int:
        if not 0 <= ix < len(self.sizes):
            raise FileNotFoundError(f"page {page_name(ix)}")
        return self.sizes[ix]

    def read_page_into(self, ix: int, out: memoryview) -> int:
        return self.read_page_into_checked(ix, out)[0]

    def read_page_into_checked(self, ix: int, out: memoryview) -> tuple[int, Digest | None]:
        """As DirectSource's; a page decoded ahead is taken from *warm*."""
        d = Digest(self.pages[ix])
        if self.warm is not None:
            n = self.warm.take_into(d, out)
            if n is not None:
                return n, d
        try:
            frame, cached = _fetch_frame(self.blobs, self.bucket, d)
            n, checked = _decode_page(self.bucket, ix, d, frame, cached, out)
            return n, d if checked else None
        except MissingBlob:
            raise DamagedPage(ix, f"its blob {d} is not in the store") from None
        except PffsError as e:
            raise DamagedPage(ix, f"its blob {d} could not be read: {e}") from None

    def read_page(self, ix: int) -> bytes:
        d = Digest(self.pages[ix])
        try:
            return self.blobs.get(d, verify=False)
        except MissingBlob:
            raise DamagedPage(ix, f"its blob {d} is not in the store") from None
        except PffsError as e:
            raise DamagedPage(ix, f"its blob {d} could not be read: {e}") from None

    def why_mismatch(self, ix: int) -> str | None:
        return f"its blob {self.pages[ix]} in the store is damaged (its bytes' sha256 differs)"

    def page_digest(self, ix: int) -> Digest | None:
        return Digest(self.pages[ix])


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
