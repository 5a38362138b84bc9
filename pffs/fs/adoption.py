"""The daemon's side of the direct data path: page bytes beside the FUSE loop.

An engine's bridge on this host that may read and write the store folder
puts and gets blob frames itself and uses the mount only for names (see
``docs/architecture.md``).  The daemon's part is small:

- ``.pffs/store.json`` (:func:`store_info`; also the ``user.pffs.store``
  xattr of the mount's root, one request for a bridge) tells a client where
  the store is, which codec to write and whether the direct path is open;
- :class:`LocalAdopter` gives a blob row to each page a new manifest lists
  whose blob file a client put (its frame header checked), so the manifest's
  metadata-only fork makes every page file appear;
- the ``user.pffs.pages`` xattr of a session folder (its answer:
  ``pffs.namespace.page_verdict``) says in one request which page files do
  not hold the blob their manifest lists (and the size the others share),
  so a reader may take every other page straight from the store.

The same holds for an S3 store: a client puts frames into the bucket and
gets them from it (or from the mount's cache folder), and the mount's
adoption (pffs.bucket.lease.RemoteMount.adopt) looks up the pages it lacks.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from pffs import namespace as ns
from pffs.codec import CODEC_RAW
from pffs.errors import IntegrityError
from pffs.fs.content import StoredBytes
from pffs.fs.db import Database
from pffs.names import DIRECT_PROTOCOL
from pffs.namespace import BLOCK_SIZE, BlobRow
from pffs.store.local import LocalBlobStore, PutBatch
from pffs.store.storedir import StoreDir
from pffs.types import Digest, is_digest

log = logging.getLogger("pffs.fs")


def store_info(store: StoreDir, max_size: int | None, *, read_only: bool = False) -> dict:
    """The content of ``.pffs/store.json``: where the store is and whether a client
    may use it directly (``direct``; else ``reason`` says why not).

    A local store gives its folder; an S3 store its URL, the client options
    worth sharing (endpoint, region, addressing: never credentials, which a
    client brings itself) and the mount's cache folder, whose frames a
    client on this host may read.  ``verify`` says what the mount's reads
    check (``-o verify=``), so that a client's reads check the same.
    """
    info: dict = {"protocol": DIRECT_PROTOCOL, "pid": os.getpid(), "verify": store.blobs.verify}
    root = store.root
    st = os.stat(root)
    blobs = store.blobs
    if not blobs.remote:
        info.update(kind="local", root=str(root), blobs=str(blobs.blob_root),
                    pins=str(root / "pins"), codec=blobs.codec.name,
                    dev=st.st_dev, ino=st.st_ino)
    else:
        info.update(kind="s3", url=store.url, cache=str(root), cache_blobs=str(blobs.cache.store.blob_root),
                    codec=blobs.codec.name, dev=st.st_dev, ino=st.st_ino,
                    options={k: v for k, v in (("endpoint", blobs.endpoint), ("region", blobs.region),
                                               ("addressing", blobs.addressing)) if v})
    reason = None
    if max_size is not None:
        reason = "the mount has a store limit (max_size), which only the daemon enforces"
    if read_only:
        reason = "the mount is read-only"
    info["direct"] = reason is None
    if reason is not None:
        info["reason"] = reason
    return info


def store_json(info: dict) -> bytes:
    return (json.dumps(info, sort_keys=True) + "\n").encode()


class LocalAdopter:
    """``adopt(pages)`` for a local store: blob rows for pages a client put itself.

    Runs in a commit thread under the gc lock (held shared by the commit
    that records the manifest), so no gc removes an adopted blob before
    that commit names it.  Only frames whose header parses and whose raw
    length a page can have are adopted; reads verify every byte anyway.
    Returns how many rows it added; their frame bytes join *stored* (the
    content store's count).
    """

    def __init__(self, db: Database, blobs: LocalBlobStore, stored: StoredBytes, *,
                 pending: PutBatch | None = None):
        self.db = db
        self.blobs = blobs
        self.stored = stored
        # Adopted blobs are made durable as the daemon's own are: by its
        # syncer before the WAL fsync that makes their rows durable (pending),
        # else (sync on close) before the rows are committed.
        self.pending = pending

    def __call__(self, pages: Sequence[str]) -> int:
        want = {p for p in pages if is_digest(p)}
        if not want:
            return 0
        with self.db.writing() as conn:
            known = ns.known_blobs(conn, want)
        rows = []
        for d in sorted(want - known.keys()):
            row = self._frame_row(Digest(d))
            if row is not None:
                rows.append(row)
        if not rows:
            return 0
        batch = self.pending if self.pending is not None else self.blobs.batch()
        for r in rows:
            batch.add(str(self.blobs.path(Digest(r.digest))))
        if self.pending is None:
            batch.sync()
        self.db.run_in_transaction(ns.insert_blob_rows, rows)
        self.stored.add(sum(r.stored_size for r in rows))
        log.debug("adopted %d blobs put beside the mount", len(rows))
        return len(rows)

    def _frame_row(self, digest: Digest) -> BlobRow | None:
        try:
            hdr = self.blobs.header(digest)
            size = self.blobs.stored_size(digest)
        except IntegrityError:   # (missing, or a header that does not parse)
            return None
        if hdr.raw_len > BLOCK_SIZE:
            return None
        if hdr.codec.id == CODEC_RAW and size != hdr.payload_at + hdr.raw_len:
            return None
        return BlobRow(digest, hdr.raw_len, size, hdr.codec.name)
