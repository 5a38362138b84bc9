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
- :func:`page_verdict` (the ``user.pffs.pages`` xattr of a session folder)
  says in one request which page files do not hold the blob their manifest
  lists (and the size the others share), so a reader may take every other
  page straight from the store.

The same holds for an S3 store: a client puts frames into the bucket and
gets them from it (or from the mount's cache folder), and the mount's
adoption (pffs.bucket.lease.RemoteMount.adopt) looks up the pages it lacks.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
from collections.abc import Sequence

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.codec import CODEC_RAW
from pffs.errors import IntegrityError
from pffs.names import DIRECT_PROTOCOL
from pffs.namespace import BLOCK_SIZE, BlobRow
from pffs.store.local import LocalBlobStore, PutBatch
from pffs.types import Digest, is_digest

log = logging.getLogger("pffs.fs")

#: Bad pages named in one verdict; past that the verdict says "more".
VERDICT_MAX = 256


def store_info(store, opts) -> dict:
    """The content of ``.pffs/store.json``: where the store is and whether a client
    may use it directly (``direct``; else ``reason`` says why not).

    A local store gives its folder; an S3 store its URL, the client options
    worth sharing (endpoint, region, addressing: never credentials, which a
    client brings itself) and the mount's cache folder, whose frames a
    client on this host may read.
    """
    info: dict = {"protocol": DIRECT_PROTOCOL, "pid": os.getpid()}
    root = store.root
    st = os.stat(root)
    blobs = store.blobs
    if isinstance(blobs, LocalBlobStore):
        info.update(kind="local", root=str(root), blobs=str(blobs.blob_root),
                    pins=str(root / "pins"), codec=blobs.codec.name,
                    dev=st.st_dev, ino=st.st_ino)
    else:
        info.update(kind="s3", url=store.url, cache=str(root), cache_blobs=str(blobs.cache.store.blob_root),
                    codec=blobs.codec.name, dev=st.st_dev, ino=st.st_ino,
                    options={k: v for k, v in (("endpoint", blobs.endpoint), ("region", blobs.region),
                                               ("addressing", blobs.addressing)) if v})
    reason = None
    if opts.max_size is not None:
        reason = "the mount has a store limit (max_size), which only the daemon enforces"
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
    Returns how many rows it added; ``on_stored(n)`` hears their frame bytes.
    """

    def __init__(self, db, blobs: LocalBlobStore, *, pending: PutBatch | None = None, on_stored=None):
        self.db = db
        self.blobs = blobs
        # Adopted blobs are made durable as the daemon's own are: by its
        # syncer before the WAL fsync that makes their rows durable (pending),
        # else (sync on close) before the rows are committed.
        self.pending = pending
        self.on_stored = on_stored

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
        if self.on_stored is not None:
            self.on_stored(sum(r.stored_size for r in rows))
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


def page_verdict(conn: sqlite3.Connection, session_dir: int, dirty: set[int]) -> dict | None:
    """Which page files of a session do not hold what its manifest lists.

    ``{"manifest": digest, "pages": n, "bad": [ix, ...], "more": bool}``:
    a page is bad when its file is missing, not a regular file, changed
    (its digest is not the listed one, or it has writes not yet committed:
    inodes in *dirty*) or larger than one blob.  Every other page file holds
    exactly the blob named by the manifest's digest, so its bytes can be read
    from the store by that name.  None when the folder holds no manifest.json
    accepted with its current bytes.  One query, whatever the page count: a
    fold of the manifest's own page list is whole by construction.
    """
    man = ns.lookup(conn, session_dir, mf.MANIFEST_NAME.encode())
    if man is None or man in dirty:
        return None
    row = conn.execute("SELECT m.n_pages, m.digest FROM manifests m JOIN inodes i ON i.id = m.inode"
                       " WHERE m.inode=? AND i.digest = m.digest", (man,)).fetchone()
    if row is None:
        return None
    n_pages, digest = row
    if ns.recorded_count(conn, digest) != n_pages:
        return None  # its page list lacks rows: nothing to check against
    out = {"manifest": digest, "pages": n_pages, "bad": [], "more": False}
    # The size every good page's file has, when they all have one (they do
    # in any session an engine wrote): a reader then needs no look per page.
    sizes = conn.execute("SELECT DISTINCT b.raw_size FROM manifest_pages p JOIN blobs b ON b.digest = p.digest"
                         " WHERE p.manifest=? LIMIT 2", (digest,)).fetchall()
    if len(sizes) == 1:
        out["page_size"] = sizes[0][0]
    pdir = ns.lookup(conn, session_dir, mf.PAGES_DIR.encode())
    if pdir is None:
        out["bad"] = list(range(min(n_pages, VERDICT_MAX)))
        out["more"] = n_pages > VERDICT_MAX
        return out
    fold = conn.execute("SELECT manifest FROM folds WHERE dir=?", (pdir,)).fetchone()
    if fold is not None and fold[0] == digest:
        return out
    if fold is not None:
        # A fold of other bytes: its files are made when something looks in.
        return None
    bad = [ix for (ix,) in conn.execute(
        "SELECT p.page_ix FROM manifest_pages p"
        " LEFT JOIN dentries d ON d.parent = :dir AND d.name = CAST(printf('%06d', p.page_ix) AS BLOB)"
        " LEFT JOIN inodes i ON i.id = d.inode"
        " WHERE p.manifest = :m AND (i.id IS NULL OR (i.mode & :fmt) != :reg OR i.digest IS NOT p.digest"
        "   OR i.size > :bs)"
        " ORDER BY p.page_ix LIMIT :lim",
        dict(dir=pdir, m=digest, fmt=0o170000, reg=stat.S_IFREG, bs=BLOCK_SIZE,
             lim=VERDICT_MAX + 1))]
    for ino in dirty:
        for parent, name in ns.names_of(conn, ino):
            if parent == pdir and name.isdigit() and int(name) < n_pages \
                    and mf.page_name(int(name)).encode() == name:
                bad.append(int(name))
    bad = sorted(set(bad))
    out["bad"] = bad[:VERDICT_MAX]
    out["more"] = len(bad) > VERDICT_MAX
    return out
