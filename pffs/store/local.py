"""The embedded blob store: content-addressed frames in a local directory.

Layout: ``<root>/blobs/<2 hex>/<64 hex>``, one frame (see :mod:`pffs.codec`)
per blob, named by the sha256 of the raw bytes it holds.  A put writes a
temp file in the blob's own directory, fsyncs it, renames it into place and
fsyncs the directory; :class:`PutBatch` defers the fsyncs so that many puts
share one round of them before a namespace commit.  Two writers putting the
same digest at once each rename a complete temp file over the name, so one
good blob remains whoever wins.

Reads verify the frame header (length), then that the bytes are the blob of
that name: by the name a frame holds and the crc32 of the decoded bytes
(frames written since frames are named), else by the sha256 of the decoded
bytes; ``rehash`` asks for the sha256 always (``pffs check --read-data``).
Anything else raises :class:`IntegrityError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Literal

from pffs import codec as codec_mod
from pffs.errors import CodecError, CorruptBlob, MissingBlob, StoreFull
from pffs.store.base import BlobBatch, PutResult
from pffs.types import Digest, digest_bytes, digest_hex, digest_of, is_digest

if TYPE_CHECKING:
    from pffs.store.reserve import SpaceReserve

BLOB_DIR = "blobs"
TMP_PREFIX = ".tmp-"
# Batches of more blobs than this are made durable by one syncfs().
SYNCFS_MIN = 16


def _load_syncfs():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
        fn.argtypes = [ctypes.c_int]
        return fn
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def decode_verified(digest: Digest, frame: bytes, max_raw: int, verify: bool = True,
                    hold=None, *, rehash: bool = False) -> bytes:
    """The raw bytes of a blob's *frame*, checked against its name *digest*
    (CorruptBlob otherwise); decoded inside ``hold(raw_len)`` when given.

    A named frame must name *digest*, and its decoded bytes must match its
    crc32: the sha256 was computed by the frame's writer, from the same
    bytes.  Others, or any with *rehash*, are hashed again.  *verify* False
    (a caller that hashes the result itself) checks neither.
    """
    return _verified(digest, frame, max_raw, verify, hold, rehash, codec_mod.decode)


def decode_verified_view(digest: Digest, frame: bytes, max_raw: int, hold=None) -> bytes | memoryview:
    """:func:`decode_verified` (verified), a large page's bytes in a read-only
    view of their own (``codec.decode_view``): for the daemon's reads."""
    return _verified(digest, frame, max_raw, True, hold, False, codec_mod.decode_view)


def _verified(digest: Digest, frame: bytes, max_raw: int, verify: bool, hold, rehash: bool,
              decode: Callable[..., Any]) -> Any:
    try:
        hdr = codec_mod.read_header(frame)
        held = contextlib.nullcontext() if hold is None else hold(hdr.raw_len)
        with held:
            if verify and codec_mod.check_name(frame, digest_bytes(digest)) and not rehash:
                return decode(frame, max_raw)
            # The sha256 check below is stronger than the frame's crc32.
            raw = decode(frame, max_raw, check_crc=not verify)
            if verify and digest_of(raw) != digest:
                raise CorruptBlob(digest, "sha256 of the stored bytes does not match its name")
            return raw
    except CodecError as e:
        raise CorruptBlob(digest, str(e)) from None


def sealed(frame, digest: Digest) -> bytes:
    """*frame* as a put takes it (a frame, or a :class:`pffs.codec.Encoded`),
    as the frame to store: an Encoded is named *digest*."""
    if isinstance(frame, codec_mod.Encoded):
        return codec_mod.seal(frame, digest_bytes(digest))
    return frame


class LocalBlobStore:
    """Blobs under ``root/blobs``; safe to share between threads and processes."""

    remote: ClassVar[Literal[False]] = False      # (pffs.store.base.BlobStore)

    def __init__(self, root: str | os.PathLike, codec: str = codec_mod.DEFAULT_CODEC,
                 max_raw: int = codec_mod.MAX_RAW, *, reserve: SpaceReserve | None = None):
        self.root = Path(root)
        self.blob_root = self.root / BLOB_DIR
        self._blob_root_s = str(self.blob_root)
        self.codec = codec_mod.parse_codec(codec)
        self.max_raw = max_raw
        # A mounted daemon's: space kept back so deletions can commit on a
        # full disk (see pffs.store.reserve); puts refuse to eat into it.
        self.reserve = reserve

    def create_dirs(self) -> None:
        """Create the 256 fan-out directories once, so puts never mkdir."""
        self.blob_root.mkdir(parents=True, exist_ok=True)
        made = False
        for i in range(256):
            d = self.blob_root / f"{i:02x}"
            if not d.is_dir():
                d.mkdir()
                made = True
        if made:
            _fsync_dir(self.blob_root)
            _fsync_dir(self.root)

    def path(self, digest: Digest) -> Path:
        return Path(self._where(digest)[1])

    def _where(self, digest: Digest) -> tuple[str, str]:
        """(fan-out folder, blob file) of *digest*, as strings: a put is on every close's path."""
        h = digest_hex(digest)
        folder = f"{self._blob_root_s}/{h[:2]}"
        return folder, f"{folder}/{h}"

    def contains(self, digest: Digest) -> bool:
        # (A string, not a Path: asked on the event loop once a file of a copy out of engines/.)
        return os.path.exists(self._where(digest)[1])

    def stored_size(self, digest: Digest) -> int:
        """Bytes the blob takes on disk (MissingBlob if absent)."""
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            raise MissingBlob(digest, "not in the store") from None

    # -- writing ---------------------------------------------------------

    def put(self, data, digest: Digest | None = None, *, batch: BlobBatch | None = None,
            codec: codec_mod.Codec | None = None, frame=None) -> PutResult:
        """Store *data* under its digest (computed if not given).

        *frame*, when given, is ``data`` already encoded (a frame, or an
        :class:`pffs.codec.Encoded` that this names), or a callable that
        returns it (a caller that compressed while it hashed); it is used
        only if the blob is new.

        Without a *batch* of this store's (``batch()``) the blob is durable
        when this returns; with one, it is durable once ``batch.sync()``
        returns.  An existing blob is kept (and still synced by the batch,
        since another writer may not have synced it yet).
        """
        pending = batch if isinstance(batch, PutBatch) else None
        if digest is None:
            digest = digest_of(data)
        folder, path = self._where(digest)
        raw_size = memoryview(data).nbytes
        size = self._reuse(path, digest, raw_size)
        if size is not None:
            if pending is not None:
                pending._add(path)
            return PutResult(digest, raw_size, size, "", True)
        if frame is None:
            frame = codec_mod.encode(data, codec or self.codec, name=digest_bytes(digest))
        elif callable(frame):
            frame = frame()
        frame = sealed(frame, digest)
        codec_name = codec_mod.read_header(frame).codec.name
        if self.reserve is not None:
            self.reserve.before_put(len(frame))
        tmp = f"{folder}/{TMP_PREFIX}{digest_hex(digest)[:16]}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(frame)
                while view:
                    view = view[os.write(fd, view):]
                if pending is None:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"no space left for blob {digest}") from e
            raise
        if pending is None:
            _fsync_dir(folder)
        else:
            pending._add(path)
        return PutResult(digest, raw_size, len(frame), codec_name, False)

    def _reuse(self, path: str, digest: Digest, raw_size: int) -> int | None:
        """Stored size of an existing blob fit for a dedup hit, else None (write it anew).

        A hit refreshes the blob's mtime, so gc's grace period counts from the
        last time a writer relied on it.  The header must promise the right
        length: a truncated or planted frame is replaced rather than reused.
        """
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = os.pread(fd, codec_mod.NAMED_HEADER_SIZE, 0)
            size = os.fstat(fd).st_size
            try:
                os.utime(fd)
            except OSError:
                pass  # a read-only store still dedups; gc then counts from the write
        finally:
            os.close(fd)
        try:
            hdr = codec_mod.read_header(head)
            codec_mod.check_name(head, digest_bytes(digest))   # (a frame of another blob: replaced)
        except CodecError:
            return None
        if hdr.raw_len != raw_size or (hdr.codec.id == codec_mod.CODEC_RAW
                                       and size != hdr.payload_at + raw_size):
            return None
        return size

    def batch(self) -> PutBatch:
        return PutBatch()

    def delete(self, digest: Digest) -> bool:
        """Remove a blob; True if it was there."""
        try:
            os.unlink(self.path(digest))
            return True
        except FileNotFoundError:
            return False

    # -- reading ---------------------------------------------------------

    def get_frame(self, digest: Digest) -> bytes:
        try:
            with open(self.path(digest), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise MissingBlob(digest, "not in the store") from None

    def get(self, digest: Digest, *, verify: bool = True, hold=None, rehash: bool = False) -> bytes:
        """The raw bytes of *digest*, verified (IntegrityError otherwise; see
        :func:`decode_verified` for *verify* and *rehash*).

        *hold*: ``hold(raw_len)``, a context manager the decode runs in (the
        daemon's budget of block-sized buffers)."""
        return decode_verified(digest, self.get_frame(digest), self.max_raw, verify, hold,
                               rehash=rehash)

    def get_view(self, digest: Digest, *, hold=None) -> bytes | memoryview:
        """:meth:`get`, verified, a large page's bytes in a read-only view
        (:func:`decode_verified_view`): the daemon's reads."""
        return decode_verified_view(digest, self.get_frame(digest), self.max_raw, hold)

    def header(self, digest: Digest) -> codec_mod.FrameHeader:
        try:
            with open(self.path(digest), "rb") as f:
                head = f.read(codec_mod.HEADER_SIZE)
        except FileNotFoundError:
            raise MissingBlob(digest, "not in the store") from None
        try:
            return codec_mod.read_header(head)
        except CodecError as e:
            raise CorruptBlob(digest, str(e)) from None

    def __iter__(self) -> Iterator[Digest]:
        """Every stored digest (temp files skipped), in no particular order."""
        if not self.blob_root.is_dir():
            return
        for sub in sorted(os.scandir(self.blob_root), key=lambda e: e.name):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for ent in os.scandir(sub.path):
                d = Digest("sha256:" + ent.name)
                if is_digest(d) and ent.name.startswith(sub.name):
                    yield d

    def temp_files(self) -> Iterator[Path]:
        """Leftover temp files of interrupted puts."""
        if not self.blob_root.is_dir():
            return
        for sub in os.scandir(self.blob_root):
            if sub.is_dir():
                for ent in os.scandir(sub.path):
                    if ent.name.startswith(TMP_PREFIX):
                        yield Path(ent.path)


class PutBatch:
    """Puts whose fsyncs are done together by :meth:`sync` (one per file and dir).

    Thread-safe: puts from several threads may add to one batch while another
    thread syncs it; a sync covers every put that returned before it began.
    """

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._lock = threading.Lock()

    def _add(self, path: str) -> None:
        with self._lock:
            self._files.add(path)

    def add(self, path: str) -> None:
        """Have the next sync cover a blob file written by someone else."""
        self._add(path)

    def __len__(self) -> int:
        return len(self._files)

    def sync(self) -> list[Digest]:
        """fsync every blob put so far and its directory; returns the digests found missing.

        A blob can only go missing between put and sync if gc removed it, and
        gc removes only blobs that no committed row names and that no writer
        holds under the gc lock.  So a caller that syncs *after* its commit
        (the daemon's syncer) ignores them, and one that syncs *before* its
        commit must not commit rows naming them.
        """
        with self._lock:
            names, self._files = self._files, set()

        def sync_file(p: Path) -> bool:
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                return False
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return True

        files = sorted(map(Path, names))
        if len(files) > SYNCFS_MIN and _syncfs is not None:
            # One syncfs() makes every file and directory of the store's
            # filesystem durable in a single journal commit, where one fsync
            # a file would force one commit each.
            found = [os.path.exists(p) for p in files]
            fd = os.open(files[0].parent, os.O_RDONLY | os.O_DIRECTORY) if any(found) else -1
            if fd >= 0:
                try:
                    if _syncfs(fd) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, os.strerror(err))
                finally:
                    os.close(fd)
            return [Digest("sha256:" + p.name) for p, ok in zip(files, found) if not ok]
        found = [sync_file(p) for p in files]
        missing = [Digest("sha256:" + p.name) for p, ok in zip(files, found) if not ok]
        dirs = {p.parent for p, ok in zip(files, found) if ok}
        for d in dirs:
            _fsync_dir(d)
        return missing
