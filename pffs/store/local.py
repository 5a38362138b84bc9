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
bytes; ``rehash`` asks for the sha256 always (``pffs check --read-data``),
as does a store whose ``verify`` is ``sha256`` (``-o verify=sha256``, an S3
store's default) for every read.  Anything else raises :class:`IntegrityError`.

A put of a blob the store holds reuses the stored frame only when it decodes
to the very bytes put (:meth:`LocalBlobStore._reuse`); a damaged one is
written again.  A reader that finds a blob damaged sets it aside
(:meth:`LocalBlobStore.set_aside`, into ``<root>/damaged/``), so the next
put of those bytes stores them afresh: damage heals with the next write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Literal

import numpy as np

from pffs import codec as codec_mod
from pffs.errors import CodecError, CorruptBlob, MissingBlob, StoreFull
from pffs.store.base import BlobBatch, PutResult
from pffs.types import Digest, digest_bytes, digest_hex, digest_of, is_digest

if TYPE_CHECKING:
    from pffs.store.reserve import SpaceReserve

log = logging.getLogger("pffs.store")

BLOB_DIR = "blobs"
# Where damaged blob files are set aside (by readers that find them, and by
# pffs check --repair), under the blob's hex name.
DAMAGED_DIR = "damaged"
TMP_PREFIX = ".tmp-"
# What a read checks (docs/format.md, "What a read checks"): a named frame's
# name and the crc32 of its bytes, or the sha256 of its bytes always.
VERIFY_MODES = ("crc32", "sha256")
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


def decode_verified_view(digest: Digest, frame: bytes, max_raw: int, hold=None, *,
                         rehash: bool = False) -> bytes | memoryview:
    """:func:`decode_verified` (verified), a large page's bytes in a read-only
    view of their own (``codec.decode_view``): for the daemon's reads."""
    return _verified(digest, frame, max_raw, True, hold, rehash, codec_mod.decode_view)


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


def _differs(frame: bytes, digest: Digest, data, max_raw: int) -> str | None:
    """Why *frame*, stored as blob *digest*, does not hold exactly *data*
    (None: it does).  A named frame must name *digest*."""
    try:
        codec_mod.check_name(frame, digest_bytes(digest))
        raw = codec_mod.decode(frame, max_raw, check_crc=False)
    except CodecError as e:
        return str(e)
    want = memoryview(data).cast("B")
    if len(raw) != len(want):
        return f"it holds {len(raw)} bytes, not {len(want)}"
    if not np.array_equal(np.frombuffer(raw, np.uint8), np.frombuffer(want, np.uint8)):
        return "its bytes are not the blob's"
    return None


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
                 max_raw: int = codec_mod.MAX_RAW, *, reserve: SpaceReserve | None = None,
                 verify: str = "crc32"):
        self.root = Path(root)
        self.blob_root = self.root / BLOB_DIR
        self._blob_root_s = str(self.blob_root)
        self.codec = codec_mod.parse_codec(codec)
        self.max_raw = max_raw
        # A mounted daemon's: space kept back so deletions can commit on a
        # full disk (see pffs.store.reserve); puts refuse to eat into it.
        self.reserve = reserve
        #: What every read checks (VERIFY_MODES): "sha256" hashes every blob read.
        self.verify = verify

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
        since another writer may not have synced it yet) if it holds these
        bytes (``_reuse``); a damaged one is replaced.  A put that heals
        (replaces a damaged blob, or one set aside in ``damaged/``) is
        durable when it returns, batch or not: the namespace already has
        the blob's row, so the daemon's adoption of a writer's blobs beside
        the mount, which syncs the blobs it adds rows for, would not.
        """
        pending = batch if isinstance(batch, PutBatch) else None
        if digest is None:
            digest = digest_of(data)
        folder, path = self._where(digest)
        raw_size = memoryview(data).nbytes
        size, heal = self._reuse(path, digest, data)
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
                heal = heal or os.path.exists(self.root / DAMAGED_DIR / digest_hex(digest))
                if pending is None or heal:
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
        if pending is None or heal:
            _fsync_dir(folder)
        else:
            pending._add(path)
        return PutResult(digest, raw_size, len(frame), codec_name, False)

    def _reuse(self, path: str, digest: Digest, data) -> tuple[int | None, bool]:
        """(stored size of an existing blob fit for a dedup hit, else None: write
        it anew; whether a blob was there and is damaged: the put heals it).

        The stored frame must decode to exactly *data*, whose sha256 the
        caller computed as *digest*: so the frame holds the bytes of its name
        (as ``-o verify=sha256`` would check) without hashing them again.
        That costs a decode and a compare on every dedup hit (a 2 MiB page:
        about 0.6 ms and 0.2 ms, against the 1.5 ms of its sha256 the put
        already paid; docs/format.md, "What a put checks").  A hit refreshes
        the blob's mtime, so gc's grace period counts from the last time a
        writer relied on it.
        """
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None, False
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                frame = f.read()
            try:
                os.utime(fd)
            except OSError:
                pass  # a read-only store still dedups; gc then counts from the write
        finally:
            os.close(fd)
        why = _differs(frame, digest, data, self.max_raw)
        if why is None:
            return len(frame), False
        log.warning("blob %s: the stored frame is damaged (%s): storing it again", digest, why)
        return None, True

    def set_aside(self, digest: Digest, why: str) -> bool:
        """Move blob *digest*'s file to ``<root>/damaged/`` if it is still damaged
        (a reader found it so); True if moved.  The next put of its bytes then
        stores them afresh, where a reader would have failed on it forever.

        A writer may heal the blob between the check and the move: the file
        moved is then compared with the damaged one (same inode), and a good
        one is put back.  Errors are logged, never raised (a reader's refusal
        stands either way)."""
        folder, path = self._where(digest)
        aside_dir = self.root / DAMAGED_DIR
        aside = aside_dir / digest_hex(digest)
        try:
            with open(path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                frame = f.read()
            try:
                decode_verified(digest, frame, self.max_raw, rehash=True)
                return False            # (healed since, or the reader's damage was elsewhere)
            except CorruptBlob:
                pass
            aside_dir.mkdir(exist_ok=True)
            os.rename(path, aside)
            if os.stat(aside).st_ino != ino:
                os.rename(aside, path)  # (a writer's good frame landed meanwhile)
                return False
            _fsync_dir(folder)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("blob %s is damaged (%s) and cannot be set aside: %s", digest, why, e)
            return False
        log.warning("blob %s is damaged (%s): set aside in %s/; the next write of its bytes"
                    " stores it again", digest, why, DAMAGED_DIR)
        return True

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
        :func:`decode_verified` for *verify* and *rehash*; a store whose
        ``verify`` is "sha256" always rehashes a verified read).

        *hold*: ``hold(raw_len)``, a context manager the decode runs in (the
        daemon's budget of block-sized buffers)."""
        return decode_verified(digest, self.get_frame(digest), self.max_raw, verify, hold,
                               rehash=rehash or self.verify == "sha256")

    def get_view(self, digest: Digest, *, hold=None) -> bytes | memoryview:
        """:meth:`get`, verified, a large page's bytes in a read-only view
        (:func:`decode_verified_view`): the daemon's reads."""
        return decode_verified_view(digest, self.get_frame(digest), self.max_raw, hold,
                                    rehash=self.verify == "sha256")

    def header(self, digest: Digest) -> codec_mod.FrameHeader:
        """The frame header of *digest*, checked to parse and, where the codec
        says (raw, planes-zstd: codec.frame_extent), to fit the file's size:
        so a truncated frame is damage found without reading its payload."""
        try:
            with open(self.path(digest), "rb") as f:
                head = f.read(codec_mod.HEADER_SIZE)
                try:
                    hdr = codec_mod.read_header(head)
                except CodecError as e:
                    raise CorruptBlob(digest, str(e)) from None
                size = os.fstat(f.fileno()).st_size
                want = codec_mod.frame_extent(hdr, lambda n, at: os.pread(f.fileno(), n, at))
        except FileNotFoundError:
            raise MissingBlob(digest, "not in the store") from None
        if want is not None and want != size:
            raise CorruptBlob(digest, f"frame of {size} bytes where its layout gives {want}"
                              f" ({'truncated' if size < want else 'bytes past its end'})")
        return hdr

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
