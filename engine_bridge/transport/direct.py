"""The direct data path: a session in a pffs mount whose page bytes go
straight between the engine and the mount's store.

Where engine_bridge.transport.mountinfo finds the store usable, the bridge's
own threads hash, encode and put blob frames with the store's put protocol
(temp file, rename, grouped fsyncs), and read, decode and verify them back;
the mount carries only the names, in a constant number of requests:

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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from engine_bridge.errors import DamagedPage, PageOutError
from engine_bridge.transport.folders import DirSource, new_session_place, rename_noreplace
from engine_bridge.transport.mountinfo import StoreAccess, getxattr
from engine_bridge.transport.save_names import BadName, save_place
from engine_bridge.transport.session_io import SinkBase, SourceBase
from engine_bridge.transport.store_blobs import decode_page, fetch_frame
from engine_bridge.transport.store_puts import PagePuts
from pffs import codec as codec_mod
from pffs.client.fork import write_new
from pffs.errors import IntegrityError, MissingBlob, PffsError
from pffs.manifest import Manifest, ManifestError, page_name, parse
from pffs.names import MANIFEST_NAME, PAGES_DIR, PAGES_XATTR
from pffs.types import Digest, digest_of

log = logging.getLogger("engine_bridge.transport.direct")


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


class DirectSink(SinkBase):
    """Writes a session at *dest* in a pffs mount, page bytes straight into its store.

    The pages are put with :class:`~engine_bridge.transport.store_puts.PagePuts`:
    a local store's gc lock is held shared from the first put until the
    pages are all put, and every page is pinned until the session is named,
    so no gc sweeps a page in between (see pffs.store.storedir.GcLock); an
    S3 store's uploads run on the store's threads and are all in the bucket
    before manifest.json is written (the mount's adoption looks them up).
    """

    concurrent = True

    def __init__(self, dest: str | os.PathLike, access: StoreAccess):
        # The name's rules, and its folder reached beneath the mount without a link.
        try:
            save_place(access.mountpoint, os.path.relpath(os.path.abspath(dest), access.mountpoint))
        except BadName as e:
            raise BadName(f"{dest}: {e}") from None
        self.dest, self.tmp = new_session_place(dest)
        self.access = access
        os.mkdir(self.tmp)
        try:
            os.mkdir(self.tmp / PAGES_DIR)
            # (The gc lock is taken after the mkdirs through the mount, as before.)
            self.puts = PagePuts(access)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.blobs: Any = self.puts.blobs
        self.digests: dict[int, Digest] = {}
        self.codec: codec_mod.Codec | None = None   # (the store's own until expect_values)
        self.manifest: bytes | None = None
        self._done = False

    @property
    def batch(self) -> Any:
        """The batch the pages are put in (a bucket: its uploads, waited for at commit)."""
        return self.puts.batch

    @property
    def pins(self) -> Any:
        """The pin file (a local store; None for a bucket)."""
        return self.puts.pins

    @property
    def _hold(self) -> Any:
        """The gc lock held shared until the pages are stored (a local store)."""
        return self.puts.hold

    def expect_values(self, itemsize: int) -> None:
        # (fp8 pages: zstd, not byte planes of 16-bit values; benchmarks/codec.py --fp8)
        self.codec = codec_mod.for_itemsize(self.puts.blobs.codec, itemsize)

    def write_page(self, ix: int, data: memoryview) -> Digest:
        try:
            d = self.puts.put(data, codec=self.codec)
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
        # Every upload in the bucket before the mount looks; then the gc lock
        # goes: the daemon's commit of manifest.json takes it too, behind a
        # waiting gc, so from here on the pins alone keep the pages.  It adopts
        # the blobs into its own group of fsyncs, done before the namespace
        # rows naming them are made durable (as for the blobs of its closes).
        try:
            self.puts.stored()
        except PffsError as e:
            raise PageOutError(f"pages not stored: {e}") from None
        write_new(self.tmp / MANIFEST_NAME, manifest)
        self._fill_missing(manifest)
        rename_noreplace(self.tmp, self.dest)
        self._done = True
        self.puts.close()

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
            self.puts.close()  # (the lock let go, a bucket's uploads waited for, the pins closed)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True


class DirectSource(SourceBase):
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
            return fetch_frame(self.blobs, None, d)
        with self._ahead_lock:
            fut = self._ahead.pop(ix, None)
            # Keep a window of fetches running past the pages asked for so far.
            while self._next < len(self._order) and len(self._ahead) < self.window:
                j = self._order[self._next]
                self._next += 1
                if j != ix and j not in self._ahead:
                    dj = self._digest(j)
                    if dj is not None:
                        self._ahead[j] = bucket.pool.submit(fetch_frame, self.blobs, bucket, dj)
        if fut is not None:
            return fut.result()
        return fetch_frame(self.blobs, bucket, d)

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
            n, checked = decode_page(self.blobs, self.bucket, ix, d, frame, cached, out)
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
