"""The blob store on S3: the same frames and names as the local store, in a bucket.

``pffs mount --store s3://BUCKET/PREFIX`` keeps, under ``PREFIX/``::

    blobs/<2 hex>/<64 hex>   one frame per blob, named by the sha256 of its raw bytes
    trash/<2 hex>/<64 hex>   blobs gc has set aside (read back and restored if still needed)
    manifests/<NAME>         manifests published with ``pffs push`` (the user's bytes)
    mounts/<ID>              registrations of the stores using the bucket (pffs.bucket.transfer)

Each mount keeps its namespace in a local folder (the *cache folder*), beside
a bounded cache of frames (``blobs/``, LRU by bytes) so that recently written
or read blobs are read without the network.  The folder's ``remote.json``
binds it to one URL, so every tool given the folder finds the bucket.

Puts are put-if-absent (a HEAD, then a PUT with ``If-None-Match: *``) and,
inside a batch, run on a pool of upload threads: :meth:`S3PutBatch.sync`
returns once every blob of the batch is in the bucket, or raises.  Reads are
verified like the local store's (frame checks, then sha256 against the name).
The network never hides behind another error: an unreachable or refusing
endpoint raises :class:`~pffs.errors.StoreUnavailable` (EIO to a FUSE
caller) after a short timeout and few retries, and changes nothing.

boto3 is imported on first use, so local stores never need it.
"""

from __future__ import annotations

import email.utils
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Literal

from pffs import codec as codec_mod
from pffs.errors import CodecError, CorruptBlob, MissingBlob, PffsError, StoreFull, StoreUnavailable
from pffs.namespace import BlobRow
from pffs.store.base import BlobBatch, PutResult
from pffs.store.framecache import FrameCache, PeekCache
from pffs.store.local import decode_verified, decode_verified_view, sealed
from pffs.store.s3client import DOWN_HOLD, S3Requests
from pffs.store.s3config import (
    BLOBS,
    CONFIG_NAME,
    MANIFESTS,
    MOUNTS,
    OPTIONS,
    PERSISTED,
    SCHEME,
    TRASH,
    bind,
    default_cache_dir,
    is_remote,
    parse_url,
    read_config,
    url_of,
)
from pffs.types import Digest, digest_bytes, digest_hex, digest_of, is_digest

if TYPE_CHECKING:
    from pffs.store.reserve import SpaceReserve

__all__ = ["SCHEME", "CONFIG_NAME", "BLOBS", "TRASH", "MANIFESTS", "MOUNTS", "OPTIONS", "DOWN_HOLD",
           "url_of", "parse_url", "is_remote", "default_cache_dir", "read_config", "bind",
           "open_remote", "open_url", "ObjectInfo", "S3BlobStore", "S3PutBatch", "FrameCache"]

DEFAULT_TIMEOUT = 5.0      # seconds to connect, and to wait for each read
DEFAULT_RETRIES = 2        # attempts in all (botocore "standard" mode)
DEFAULT_UPLOAD_THREADS = 8
DEFAULT_CACHE = 128 << 20
# What a HEAD said about a digest is trusted this long: long enough for the
# contains() and put() of one close to share it, far below any gc grace period
# (a blob seen stored cannot be gone for good before a grace period passes).
_PRESENT_TTL = 2.0
_ABSENT_TTL = 2.0
# Blobs up to this raw size that the mount does not know are put without a
# HEAD first: the conditional PUT answers "already there" itself, and one
# request beats two; larger ones are looked up first, so that a page another
# mount stored is not sent again.
PUT_FIRST_MAX = 1 << 20
_META_RAW = "pffs-raw-size"
_META_CODEC = "pffs-codec"


# -- opening the store of a cache folder -----------------------------------------

def open_remote(root: Path, url: str | None, options: dict | None = None,
                **kwargs) -> "S3BlobStore | None":
    """The S3 store of the cache folder *root* (binding it to *url* if given), or None if local."""
    options = dict(options or {})
    cfg = bind(root, url, options) if url is not None else read_config(root)
    if cfg is None:
        return None
    for k in PERSISTED:
        if not options.get(k) and cfg.get(k):
            options[k] = cfg[k]
    store_url = url_of(cfg["url"])
    if store_url is None:  # read_config refuses such a remote.json; bind is given S3 URLs
        raise PffsError(f"{root / CONFIG_NAME}: no s3:// url in it")
    return S3BlobStore(root, store_url, options=options, **kwargs)


def open_url(url: str) -> "S3BlobStore":
    """The bucket of *url* for a tool, with the endpoint its default cache folder remembers.

    Binds nothing and writes nothing: only the bucket is needed.
    """
    root = default_cache_dir(url)
    options = {}
    try:
        cfg = read_config(root)
    except PffsError:
        cfg = None
    if cfg is not None and url_of(cfg["url"]) == url:
        options = {k: cfg[k] for k in PERSISTED if cfg.get(k)}
    return S3BlobStore(root, url, options=options)


# -- the store ----------------------------------------------------------------

@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD tells about a blob object."""
    stored_size: int
    raw_size: int | None
    codec: str
    last_modified: float = 0.0


class S3BlobStore(S3Requests):
    """Blobs in ``s3://bucket/prefix/blobs``, with a local frame cache; thread-safe."""

    remote: ClassVar[Literal[True]] = True       # (pffs.store.base.BlobStore)

    def __init__(self, root: str | os.PathLike, url: str, *, options: dict | None = None,
                 codec: str = codec_mod.DEFAULT_CODEC, max_raw: int = codec_mod.MAX_RAW,
                 cache: "FrameCache | PeekCache | None" = None, reserve: SpaceReserve | None = None,
                 likely_stored: Callable[[str], bool] | None = None):
        opts = options or {}
        self.root = Path(root)
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self.codec = codec_mod.parse_codec(codec)
        self.max_raw = max_raw
        self.verify = "sha256"  # what reads check: a bucket many hosts write is a trust boundary
        # A mounted daemon's (pffs.store.reserve); the cache never eats into it.
        self.reserve = reserve
        # A mount's: whether its namespace knows the digest (then a HEAD
        # before the upload is worth it, however small the blob).
        self.likely_stored = likely_stored
        # A mount's own LRU cache of frames, or (a client beside a mount) a
        # read-only look into the mount's.
        self.cache: FrameCache | PeekCache = cache if cache is not None else FrameCache(self.root, DEFAULT_CACHE)
        self.endpoint = opts.get("endpoint") or None
        self.region = opts.get("region") or None
        self.access_key = opts.get("access_key") or None
        self.secret_key = opts.get("secret_key") or None
        self.addressing = opts.get("addressing") or ("path" if self.endpoint
                                                      or os.environ.get("AWS_ENDPOINT_URL") else "auto")
        try:
            self.timeout = float(opts.get("s3_timeout") or DEFAULT_TIMEOUT)
            self.retries = int(opts.get("s3_retries") or DEFAULT_RETRIES)
            self.threads = int(opts.get("upload_threads") or DEFAULT_UPLOAD_THREADS)
        except ValueError as e:
            raise PffsError(f"bad S3 option: {e}") from None
        if bool(self.access_key) != bool(self.secret_key):
            raise PffsError("access_key and secret_key go together (or come from AWS_ACCESS_KEY_ID"
                            " and AWS_SECRET_ACCESS_KEY)")
        if self.timeout <= 0 or self.retries < 1 or self.threads < 1:
            raise PffsError("s3_timeout must be > 0, s3_retries and upload_threads >= 1")
        self._client = None
        self._lean = None
        self._client_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Frames handed to the pool and not yet uploaded: bounds the memory a
        # fast writer can queue ahead of the network.
        self._inflight = threading.BoundedSemaphore(2 * self.threads)
        self._seen: dict[str, tuple[float, ObjectInfo | None]] = {}
        self._seen_lock = threading.Lock()
        self._conditional_put = True
        # After a request found the endpoint silent (no connection or no answer
        # in time), requests fail at once for DOWN_HOLD seconds: the kernel's
        # parallel reads of one page, a prefetch, the next block of a write
        # do not each wait out the timeouts again.
        self._down_until = 0.0
        self._down_reason = ""
        # A timeout only marks the endpoint silent if nothing answered since
        # that request began: a slow request that straddles a restart must
        # not fail the requests the endpoint is answering by then.
        self._last_answer = 0.0
        self._began = threading.local()

    # -- plumbing ------------------------------------------------------------

    def set_cache_limit(self, limit: int) -> None:
        self.cache.limit = limit

    def key(self, digest: Digest, area: str = BLOBS) -> str:
        h = digest_hex(digest)
        return f"{self.prefix}{area}{h[:2]}/{h}"

    def create_dirs(self) -> None:
        """The local cache folder's fan-out directories (the bucket needs none)."""
        self.cache.store.create_dirs()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- existence -------------------------------------------------------------

    def _remember(self, digest: str, info: ObjectInfo | None) -> None:
        with self._seen_lock:
            if len(self._seen) > 200_000:
                self._seen.clear()
            self._seen[digest] = (time.monotonic(), info)

    def _recall(self, digest: Digest) -> tuple[bool, ObjectInfo | None]:
        """(True, what a recent HEAD or put said) or (False, None)."""
        with self._seen_lock:
            hit = self._seen.get(digest)
        if hit is not None and time.monotonic() - hit[0] < (_PRESENT_TTL if hit[1] is not None
                                                            else _ABSENT_TTL):
            return True, hit[1]
        return False, None

    def stat(self, digest: Digest, *, fresh: bool = False) -> ObjectInfo | None:
        """HEAD of the blob (None if absent); recent answers are reused unless *fresh*."""
        if not fresh:
            known, info = self._recall(digest)
            if known:
                return info
        info = self._head(self.key(digest))
        self._remember(digest, info)
        return info

    def _head(self, key: str) -> ObjectInfo | None:
        a = self._send("HEAD", key, f"HEAD {key}")
        if a.status == 404:
            return None
        if a.status != 200:
            raise self._refused(f"HEAD {key}", a)
        meta = a.metadata()
        try:
            raw = int(meta[_META_RAW])
        except (KeyError, ValueError):
            raw = None
        return ObjectInfo(int(a.headers.get("content-length", 0)), raw, meta.get(_META_CODEC, ""),
                          _modified(a))

    def contains(self, digest: Digest) -> bool:
        """Whether the bucket is known to hold *digest*; False when it cannot be asked.

        Callers use it to skip work (dedup, size limits) and then put, and a
        put of an unreachable bucket raises: an unanswered question must not
        raise while the caller still has a compression running on its buffer.
        """
        try:
            return self.stat(digest) is not None
        except StoreUnavailable:
            return False

    def stored_size(self, digest: Digest) -> int:
        info = self.stat(digest, fresh=True)
        if info is None:
            raise MissingBlob(digest, f"not in {self.url}")
        return info.stored_size

    def lookup(self, digest: Digest) -> BlobRow | None:
        """A blob row for *digest* if the bucket holds it (restored from trash if need be)."""
        info = self.stat(digest, fresh=True)
        if info is None and self._restore(digest):
            info = self.stat(digest, fresh=True)
        if info is None:
            return None
        raw, codec = info.raw_size, info.codec
        if raw is None:
            # Put by something other than pffs: the frame header says.
            hdr = self.header(digest)
            raw, codec = hdr.raw_len, hdr.codec.name
        return BlobRow(digest, raw, info.stored_size, codec)

    def lookup_many(self, digests: Iterable[str]) -> dict[str, BlobRow]:
        """:meth:`lookup` of many digests at once (HEADs in parallel)."""
        todo = sorted({d for d in digests if is_digest(d)})
        if not todo:
            return {}
        if len(todo) == 1:
            row = self.lookup(Digest(todo[0]))
            return {todo[0]: row} if row is not None else {}
        rows = self.pool.map(lambda d: self.lookup(Digest(d)), todo)
        return {d: r for d, r in zip(todo, rows) if r is not None}

    def _restore(self, digest: Digest) -> bool:
        """Copy a blob gc set aside back into place; True if there was one."""
        src = self.key(digest, TRASH)
        r = self._call("copy_object", f"restoring {src}", Key=self.key(digest),
                       CopySource={"Bucket": self.bucket, "Key": src}, MetadataDirective="COPY")
        if r is None:
            return False
        self._remember(digest, None)
        return True

    # -- writing -------------------------------------------------------------------

    def batch(self) -> "S3PutBatch":
        return S3PutBatch()

    def put(self, data, digest: Digest | None = None, *, batch: BlobBatch | None = None,
            codec: codec_mod.Codec | None = None, frame=None) -> PutResult:
        """Store *data* under its digest unless the bucket has it.

        Without an :class:`S3PutBatch` the blob is in the bucket when this
        returns; with one, once ``batch.sync()`` returns (the upload runs on
        the store's pool meanwhile).  *frame*, when given, is ``data`` already
        encoded, or a callable returning it (called only if the blob is new).
        """
        if digest is None:
            digest = digest_of(data)
        raw_size = memoryview(data).nbytes
        known, info = self._recall(digest)
        if not known and (raw_size > PUT_FIRST_MAX or (self.likely_stored is not None
                                                       and self.likely_stored(digest))):
            info = self.stat(digest)  # a HEAD may spare the upload
        if info is not None:
            return PutResult(digest, raw_size, info.stored_size, info.codec, True)
        # New, or small enough that the conditional PUT itself is the cheaper question.
        if frame is None:
            frame = codec_mod.encode(data, codec or self.codec, name=digest_bytes(digest))
        elif callable(frame):
            frame = frame()  # a compression already under way, wanted now that the blob is new
        frame = sealed(frame, digest)
        codec_name = codec_mod.read_header(frame).codec.name
        if isinstance(batch, S3PutBatch):
            self._inflight.acquire()
            try:
                fut = self.pool.submit(self._upload, digest, frame, raw_size, codec_name)
            except BaseException:
                self._inflight.release()
                raise
            fut.add_done_callback(lambda _f: self._inflight.release())
            batch._add(fut)
            return PutResult(digest, raw_size, len(frame), codec_name, False)
        existed = self._upload(digest, frame, raw_size, codec_name)
        return PutResult(digest, raw_size, len(frame), codec_name, existed)

    def _upload(self, digest: Digest, frame: bytes, raw_size: int, codec_name: str) -> bool:
        """PUT the frame unless the key exists; True if it did (someone stored the blob first)."""
        existed = False
        key = self.key(digest)
        headers = {"content-type": "application/octet-stream", "x-amz-meta-" + _META_RAW: str(raw_size),
                   "x-amz-meta-" + _META_CODEC: codec_name}
        for attempt in range(4):
            if self._conditional_put:
                headers["if-none-match"] = "*"
            a = self._send("PUT", key, f"PUT {key}", body=frame, headers=headers)
            if a.status == 200:
                break
            if a.status == 412:
                existed = True  # stored before (by us or another writer): same bytes
                break
            if a.status == 501 and self._conditional_put:
                self._conditional_put = False  # no conditional puts here: overwrite alike bytes
                headers.pop("if-none-match")
                continue
            if a.status == 409 and attempt < 3:
                # A concurrent conditional put of the same key: let it finish, look again.
                time.sleep(0.1 * (attempt + 1))
                if self._head(key) is not None:
                    existed = True
                    break
                continue
            raise self._refused(f"PUT {key}", a)
        self._remember(digest, ObjectInfo(len(frame), raw_size, codec_name, time.time()))
        self._cache_frame(digest, frame)
        return existed

    def _cache_frame(self, digest: Digest, frame: bytes) -> None:
        if self.reserve is not None:
            try:
                self.reserve.before_put(len(frame))
            except StoreFull:
                return  # the cache gives way to the reserve
        self.cache.put(digest, frame)

    def delete(self, digest: Digest) -> bool:
        """Remove a blob from the bucket (and the cache); True if it was there."""
        had = self.stat(digest, fresh=True) is not None
        self._call("delete_object", f"DELETE {self.key(digest)}", Key=self.key(digest))
        self._remember(digest, None)
        self.cache.discard(digest)
        return had

    # -- reading -------------------------------------------------------------------

    def _download(self, digest: Digest) -> bytes:
        for area in (BLOBS, TRASH):
            key = self.key(digest, area)
            a = self._get_body(key, f"GET {key}")
            if a is None:
                continue
            frame = a.body
            if area == TRASH:
                self._restore(digest)
            return frame
        raise MissingBlob(digest, f"not in {self.url}")

    def download(self, digest: Digest) -> bytes:
        """The frame of *digest* from the bucket (or its trash), never from the cache."""
        return self._download(digest)

    def get_frame(self, digest: Digest) -> bytes:
        frame = self.cache.get(digest)
        return frame if frame is not None else self._download(digest)

    def get(self, digest: Digest, *, verify: bool = True, hold=None, rehash: bool = False) -> bytes:
        """The raw bytes of *digest*, verified: from the cache, else from the bucket
        (*verify*, *hold* and *rehash* as for LocalBlobStore.get)."""
        return self._get(digest, lambda frame: decode_verified(digest, frame, self.max_raw, verify, hold,
                                                               rehash=rehash or self.verify == "sha256"))

    def get_view(self, digest: Digest, *, hold=None) -> bytes | memoryview:
        """:meth:`get`, verified, a large page's bytes in a read-only view (LocalBlobStore.get_view)."""
        return self._get(digest, lambda frame: decode_verified_view(
            digest, frame, self.max_raw, hold, rehash=self.verify == "sha256"))

    def set_aside(self, digest: Digest, why: str) -> bool:
        """Nothing: ``_get`` fetches a damaged cached frame again; the bucket's puts are put-if-absent."""
        return False

    def _get(self, digest: Digest, decode: Callable[[bytes], Any]) -> Any:
        frame = self.cache.get(digest)
        if frame is not None:
            try:
                return decode(frame)
            except CorruptBlob:
                self.cache.discard(digest)  # a damaged cache entry: the bucket has the blob
        frame = self._download(digest)
        raw = decode(frame)
        self._cache_frame(digest, frame)
        return raw

    def header(self, digest: Digest) -> codec_mod.FrameHeader:
        head = self.cache.head(digest)
        if head is None:
            key = self.key(digest)
            r = self._call("get_object", f"GET {key}", Key=key, Range=f"bytes=0-{codec_mod.HEADER_SIZE - 1}")
            if r is None:
                raise MissingBlob(digest, f"not in {self.url}")
            try:
                head = r["Body"].read()
            except Exception as e:
                raise self._error(f"GET {key}", e) from None
        try:
            return codec_mod.read_header(head)
        except CodecError as e:
            raise CorruptBlob(digest, str(e)) from None

    # -- listing -------------------------------------------------------------------

    def list_area(self, area: str) -> Iterator[tuple[str, int, float]]:
        """(key below PREFIX/area, size, last-modified epoch seconds) of every object there."""
        from botocore.exceptions import BotoCoreError, ClientError
        base = self.prefix + area
        self._check_up(f"listing {base}")
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                               Prefix=base):
                for o in page.get("Contents", ()):
                    yield o["Key"][len(base):], int(o["Size"]), o["LastModified"].timestamp()
        except (BotoCoreError, ClientError, OSError) as e:
            raise self._error(f"listing {base}", e) from None

    def iter_blobs(self, area: str = BLOBS) -> Iterator[tuple[Digest, int, float]]:
        """(digest, stored size, last modified) of every blob object (or trash entry)."""
        for rest, size, mtime in self.list_area(area):
            sub, _, name = rest.partition("/")
            d = "sha256:" + name
            if is_digest(d) and name.startswith(sub) and len(sub) == 2:
                yield Digest(d), size, mtime

    def __iter__(self) -> Iterator[Digest]:
        for d, _size, _mtime in self.iter_blobs():
            yield d

    def temp_files(self) -> Iterator[Path]:
        """Leftover temp files of the local cache (uploads leave none in the bucket)."""
        return self.cache.store.temp_files()

    def path(self, digest: Digest) -> Path:
        """Where the cache keeps the frame of *digest* (the bucket is the real home)."""
        return self.cache.store.path(digest)

    def server_time(self) -> float:
        """The object store's clock (epoch seconds), from the Date header of a cheap request."""
        from botocore.exceptions import BotoCoreError, ClientError
        self._check_up("listing the bucket")
        try:
            r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + MOUNTS, MaxKeys=1)
        except (BotoCoreError, ClientError, OSError) as e:
            raise self._error("listing the bucket", e) from None
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return time.time()

    # -- small objects (manifests, registrations) -------------------------------

    def get_object(self, key: str) -> tuple[bytes, dict] | None:
        """(body, metadata) of PREFIX/key, or None."""
        full = self.prefix + key
        a = self._get_body(full, f"GET {full}")
        if a is None:
            return None
        meta: dict[str, Any] = dict(a.metadata())
        meta["last_modified"] = _modified(a)
        return a.body, meta

    def put_object(self, key: str, body: bytes, metadata: dict | None = None, *,
                   if_absent: bool = False, background: bool = False) -> bool:
        """Write PREFIX/key; with *if_absent*, False (and nothing written) if it exists.

        A *background* write (a mount's registration) that times out does not
        hold the endpoint: nobody waits on it, and a server restarting under
        it may answer everyone else a moment later.
        """
        full = self.prefix + key
        headers = {"x-amz-meta-" + k.lower(): str(v) for k, v in (metadata or {}).items()}
        if if_absent:   # (a HEAD first only where the server ignores conditional PUTs)
            if not self._conditional_put and self._head(full) is not None:
                return False
            if self._conditional_put:
                headers["if-none-match"] = "*"
        a = self._send("PUT", full, f"PUT {full}", body=body, headers=headers, hold=not background)
        if a.status == 412:
            return False
        if a.status != 200:
            raise self._refused(f"PUT {full}", a)
        return True

    def delete_object(self, key: str) -> None:
        full = self.prefix + key
        self._call("delete_object", f"DELETE {full}", Key=full)

    def copy_object(self, src: str, dst: str) -> bool:
        """Server-side copy PREFIX/src → PREFIX/dst; False if src is gone."""
        r = self._call("copy_object", f"copying {self.prefix + src}", Key=self.prefix + dst,
                       CopySource={"Bucket": self.bucket, "Key": self.prefix + src},
                       MetadataDirective="COPY")
        return r is not None


def _modified(a) -> float:
    """An answer's Last-Modified, in epoch seconds (0.0 where it has none)."""
    try:
        return email.utils.parsedate_to_datetime(a.headers["last-modified"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return 0.0


class S3PutBatch:
    """Uploads running on the store's pool; :meth:`sync` waits for every one of them."""

    def __init__(self) -> None:
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def _add(self, fut: Future) -> None:
        with self._lock:
            self._futures.append(fut)

    def __len__(self) -> int:
        return len(self._futures)

    def sync(self) -> list[Digest]:
        """Return once every upload so far is in the bucket; raise the first failure."""
        with self._lock:
            futures, self._futures = self._futures, []
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # wait for all, so no upload outlives the caller
                error = error or e
        if error is not None:
            raise error
        return []
