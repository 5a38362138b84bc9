"""Bucket gc: ``pffs gc`` on an S3 store, safe while mounts use the bucket.

Bucket gc (``pffs gc`` on an S3 store) keeps every blob a published manifest
or an unexpired registration lists, and anything younger than the grace
period.  It deletes in two steps: an unreferenced blob is first moved to
``PREFIX/trash/`` (reads fall back to it and put it back), and only a trash
entry still unreferenced a grace period later is deleted.  So a reference
that appears while gc runs (a pull, a fork, a dedup hit in another mount) is
healed rather than lost: it reaches a registration within a lease check,
long before the grace period ends.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zstandard

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.bucket.lease import decode_registration
from pffs.errors import PffsError
from pffs.store.s3 import BLOBS, MANIFESTS, MOUNTS, TRASH, S3BlobStore, open_url, url_of
from pffs.types import Digest, is_digest

log = logging.getLogger("pffs.bucket.transfer")  # the name these messages always had


@dataclass
class BucketGcResult:
    dry_run: bool
    manifests: int = 0
    registrations: int = 0          # unexpired registrations honoured
    expired: list[str] = field(default_factory=list)  # registrations that no longer protect anything
    blobs: int = 0
    live: int = 0
    young: int = 0
    trashed: int = 0
    trashed_bytes: int = 0
    restored: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    trash_kept: int = 0
    deleted_digests: list[str] = field(default_factory=list)
    trashed_digests: list[str] = field(default_factory=list)

    def summary(self) -> str:
        would = "would " if self.dry_run else ""
        parts = [f"{self.live} of {self.blobs} blobs referenced by {self.manifests} published manifests"
                 f" and {self.registrations} registered stores",
                 f"{would}set aside {self.trashed} unreferenced blobs ({self.trashed_bytes} bytes)",
                 f"{would}delete {self.deleted} set aside a grace period ago ({self.deleted_bytes} bytes)"]
        if self.restored:
            parts.append(f"{would}put back {self.restored} set-aside blobs that are referenced again")
        if self.young:
            parts.append(f"{self.young} unreferenced blobs younger than the grace period kept")
        if self.trash_kept:
            parts.append(f"{self.trash_kept} set-aside blobs kept until their grace period ends")
        if self.expired:
            parts.append(f"{would}drop {len(self.expired)} expired registrations")
        return ", ".join(parts)


def bucket_references(blobs: S3BlobStore, now: float, r: BucketGcResult) -> set[str]:
    """Digests listed by published manifests and unexpired registrations."""
    refs: set[str] = set()
    names = [n for n, _, _ in blobs.list_area(MANIFESTS)]
    for name, got in zip(names, blobs.pool.map(lambda n: blobs.get_object(MANIFESTS + n), names)):
        if got is None:
            continue
        try:
            refs.update(mf.parse(got[0]).pages)
        except mf.ManifestError as e:
            log.warning("published manifest %s is not valid (%s); it protects nothing", name, e)
            continue
        r.manifests += 1
    for ident, _size, _mtime in list(blobs.list_area(MOUNTS)):
        got = blobs.get_object(MOUNTS + ident)
        if got is None:
            continue
        body, meta = got
        try:
            reg = decode_registration(body)
            ttl = float(reg["ttl"])
        except (ValueError, KeyError, TypeError, zstandard.ZstdError) as e:
            log.warning("registration %s is unreadable (%s); it protects nothing", ident, e)
            continue
        if meta["last_modified"] + ttl < now:
            r.expired.append(ident)
            continue
        refs.update(d for d in reg.get("digests", ()) if is_digest(d))
        r.registrations += 1
    return refs


def collect_cli(store: str | os.PathLike, **kw) -> BucketGcResult:
    """``pffs gc --store s3://…`` (the bucket alone) or ``--store CACHE_FOLDER`` (its namespace too)."""
    from pffs.store.storedir import StoreDir
    url = url_of(store)
    if url is not None:
        return collect(open_url(url), **kw)
    sd = StoreDir(store)
    if not sd.blobs.remote:  # the caller checked is_remote(store)
        raise PffsError(f"{store} is a local store; bucket gc needs an s3:// store")
    return collect(sd.blobs, namespace_root=sd.root if sd.exists() else None, **kw)


def collect(blobs: S3BlobStore, *, grace: float, dry_run: bool = False,
            progress: Callable[[int, int], None] | None = None,
            namespace_root: Path | None = None) -> BucketGcResult:
    """gc of the bucket, safe while mounts use it (see the module's docstring)."""
    r = BucketGcResult(dry_run=dry_run)
    now = blobs.server_time()
    cutoff = now - grace
    refs = bucket_references(blobs, now, r)
    if namespace_root is not None:
        # A cache folder's own namespace counts, mounted or not.
        conn = ns.open_db(namespace_root, create_missing=False)
        try:
            refs.update(ns.iter_referenced_blobs(conn))
        finally:
            conn.close()
    listed = list(blobs.iter_blobs(BLOBS))
    trash = list(blobs.iter_blobs(TRASH))
    present = {d for d, _, _ in listed}
    r.blobs = len(listed)
    total, done = len(listed) + len(trash), 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    for d, size, mtime in trash:
        tick()
        if d in present:
            if not dry_run:
                blobs.delete_object(_rel(blobs, d, TRASH))  # already back in place
        elif d in refs:
            r.restored += 1
            if not dry_run and blobs.copy_object(_rel(blobs, d, TRASH), _rel(blobs, d, BLOBS)):
                blobs.delete_object(_rel(blobs, d, TRASH))
        elif mtime <= cutoff:
            r.deleted += 1
            r.deleted_bytes += size
            r.deleted_digests.append(d)
            if not dry_run:
                blobs.delete_object(_rel(blobs, d, TRASH))
        else:
            r.trash_kept += 1
    for d, size, mtime in listed:
        tick()
        if d in refs:
            r.live += 1
        elif mtime > cutoff:
            r.young += 1
        else:
            r.trashed += 1
            r.trashed_bytes += size
            r.trashed_digests.append(d)
            if not dry_run and blobs.copy_object(_rel(blobs, d, BLOBS), _rel(blobs, d, TRASH)):
                blobs.delete_object(_rel(blobs, d, BLOBS))
    if not dry_run:
        for ident in r.expired:
            blobs.delete_object(MOUNTS + ident)
    return r


def _rel(blobs: S3BlobStore, d: Digest, area: str) -> str:
    """A blob's key relative to the prefix."""
    return blobs.key(d, area)[len(blobs.prefix):]
