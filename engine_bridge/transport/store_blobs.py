"""Pages as blobs of a mount's store, by digest, with no session folder: what
an attached engine's agent stores for a copy out of ``engines/`` and reads
for a session copied into it (pffs.live's ``store`` and ``load_blobs``), and
the frame reading the direct path and the pages decoded ahead share.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine_bridge.errors import DamagedPage
from engine_bridge.transport.mountinfo import StoreAccess
from engine_bridge.transport.session_io import SinkBase, SourceBase
from pffs import codec as codec_mod
from pffs.client.access import Blobs, LocalBlobStore, S3BlobStore
from pffs.errors import CodecError, MissingBlob, PffsError
from pffs.manifest import page_name, parse
from pffs.types import Digest, digest_bytes, digest_of


def fetch_frame(blobs: Blobs, bucket: "S3BlobStore | None", d: Digest) -> tuple[bytes, bool]:
    """The frame of blob *d* and whether it came from the mount's cache folder
    (a bucket's frame is read there where it is, else downloaded)."""
    if bucket is None:
        return blobs.get_frame(d), False
    frame = bucket.cache.get(d)
    if frame is not None:
        return frame, True
    return bucket.download(d), False


def decode_page(blobs: Blobs, bucket: "S3BlobStore | None", ix: int, d: Digest, frame: bytes,
                cached: bool, out: memoryview | list) -> tuple[int, bool]:
    """Decode page *ix*'s *frame* into *out*: (its length, whether the bytes are
    checked to be blob *d*: pffs.codec.decode_into_checked; else the bridge
    hashes them).  *out* may be a list of buffers the page fills in order (a
    page's memory in a few contiguous runs, decoded straight into them:
    pffs.codec.decode_into_runs, the bytes then always checked; a damaged
    page leaves them holding what was decoded).  Where the mount verifies by
    sha256 (``blobs.verify``, from ``.pffs/store.json``), so does this.  A
    damaged frame of the mount's cache is downloaded again, since the bucket
    has the blob; a damaged blob of a local store is set aside, so the next
    write of its bytes heals it."""
    name = digest_bytes(d)
    rehash = blobs.verify == "sha256"

    def decode(frame: bytes) -> tuple[int, bool]:
        if isinstance(out, list):
            return codec_mod.decode_into_runs(frame, out, name, rehash=rehash), True
        return codec_mod.decode_into_checked(frame, out, name, rehash=rehash)
    try:
        return decode(frame)
    except CodecError as e:
        if not cached or bucket is None:
            if isinstance(blobs, LocalBlobStore):
                blobs.set_aside(d, str(e))
            raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None
    frame = bucket.download(d)
    try:
        return decode(frame)
    except CodecError as e:
        raise DamagedPage(ix, f"its blob {d} in the store is damaged: {e}") from None


class BlobSink(SinkBase):
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


class PagesAhead(Protocol):
    """Pages decoded ahead of a load (engine_bridge.attach.warm.WarmPages)."""

    def take_into(self, digest: str, out: memoryview) -> int | None: ...


class BlobSource(SourceBase):
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
            frame, cached = fetch_frame(self.blobs, self.bucket, d)
            n, checked = decode_page(self.blobs, self.bucket, ix, d, frame, cached, out)
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
