"""A mount's lease on the bucket: its registration at ``PREFIX/mounts/<ID>``, and adoption of known pages.

A mount of an S3 store (pffs.store.s3) registers itself in the bucket at
``PREFIX/mounts/<ID>``: the digests its namespace references (every blob a
file holds, every page a manifest lists), written at mount, rewritten within
``LEASE_CHECK`` of a change and at least every third of its lease, and once
more at unmount.  A registration protects its digests from gc until it
expires: one lease (``-o lease=``, default 1 h) after its last write while
mounted, ``KEEP_UNMOUNTED`` after a clean unmount (the namespace still names
those blobs; a remount renews it).  The ID lives in the cache folder, so a
remount, even after a crash, takes over its own registration.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import zstandard

from pffs import namespace as ns
from pffs.bucket.shared_index import Publisher
from pffs.errors import PffsError, StoreUnavailable
from pffs.store.s3 import MOUNTS, S3BlobStore
from pffs.types import is_digest

if TYPE_CHECKING:
    from pffs.fs.db import Database
    from pffs.store.storedir import StoreDir

log = logging.getLogger("pffs.bucket.transfer")  # the name these messages always had

DEFAULT_LEASE = 3600.0
LEASE_CHECK = 60.0                 # a mount looks for new references at least this often
KEEP_UNMOUNTED = 30 * 86400.0      # a cleanly unmounted store's registration lasts this long
MEMORY_CACHE_MAX = 256 << 20       # decoded blobs kept in memory by an S3 mount
REGISTRATION_FORMAT = "pffs-mount-1"
MOUNT_ID_NAME = "mount-id"


# -- a mount's registration ----------------------------------------------------

def mount_id(root: Path) -> str:
    """This cache folder's registration id (made on first use)."""
    path = root / MOUNT_ID_NAME
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    ident = f"{socket.gethostname()[:40]}-{os.urandom(6).hex()}"
    ident = re.sub(r"[^A-Za-z0-9.\-]", "-", ident)
    tmp = root / f".{MOUNT_ID_NAME}.{os.getpid()}"
    tmp.write_text(ident + "\n")
    os.replace(tmp, path)
    return ident


def encode_registration(reg: dict) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(reg).encode())


def decode_registration(body: bytes) -> dict:
    data = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
    reg = json.loads(data)
    if not isinstance(reg, dict) or reg.get("format") != REGISTRATION_FORMAT:
        raise ValueError("not a pffs mount registration")
    return reg


class RemoteMount:
    """A mounted S3 store's registration in the bucket, and its adoption of known pages.

    The registration is renewed by a plain thread with its own read
    connection to the namespace, so neither the event loop nor the writer
    thread waits on the network for it.
    """

    def __init__(self, root: Path, blobs: S3BlobStore, db: Database, lease: float = DEFAULT_LEASE):
        self.root = root
        self.blobs = blobs
        self.db = db
        self.lease = lease
        self.check = min(LEASE_CHECK, lease / 4)
        self.id = mount_id(root)
        self.key = MOUNTS + self.id
        self._pinned: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written: tuple[frozenset, float] | None = None  # (digests, monotonic time) of the last write
        self._reachable = True
        self._conn: sqlite3.Connection | None = None
        # The keys this mount records, published to every mount of the bucket.
        self.publisher = Publisher(blobs)

    def _references(self) -> tuple[set[str], set[str]]:
        """(every digest to list, the pinned ones among them)."""
        if self._conn is None:
            self._conn = ns.connect(self.db.path)
        with self._lock:
            pinned = set(self._pinned)
        return set(ns.iter_referenced_blobs(self._conn)) | pinned, pinned

    def _write(self, digests: set[str], state: str, ttl: float) -> None:
        reg = {"format": REGISTRATION_FORMAT, "id": self.id, "host": socket.gethostname(),
               "pid": os.getpid(), "cache": str(self.root), "state": state, "ttl": ttl,
               "written": time.time(), "digests": sorted(digests)}
        self.blobs.put_object(self.key, encode_registration(reg),
                              {"state": state, "ttl": str(int(ttl)), "digests": str(len(digests))},
                              background=True)

    def renew(self, force: bool = False) -> bool:
        """Rewrite the registration if the references changed or a third of the lease passed."""
        digests, pinned = self._references()
        refs = frozenset(digests)
        last = self._written
        if not force and last is not None and last[0] == refs \
                and time.monotonic() - last[1] < self.lease / 3:
            return False
        self._write(digests, "mounted", self.lease)
        self._written = (refs, time.monotonic())
        with self._lock:
            self._pinned -= pinned
        return True

    def start(self) -> None:
        self.renew(force=True)  # before the mount answers: fails the mount if the bucket does not
        self._thread = threading.Thread(target=self._loop, name="pffs-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.check)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.renew()
            except StoreUnavailable as e:
                if self._reachable:
                    log.warning("registration not renewed, bucket unreachable: %s", e)
                    self._reachable = False
                continue
            except (sqlite3.Error, OSError) as e:
                log.warning("registration not renewed: %s", e)
                continue
            if not self._reachable:
                log.info("bucket reachable again; registration %s renewed", self.key)
                self._reachable = True

    def stop(self) -> None:
        """At unmount: the registration stays, as an unmounted store's, for KEEP_UNMOUNTED."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        try:
            self._write(self._references()[0], "unmounted", KEEP_UNMOUNTED)
        except (StoreUnavailable, sqlite3.Error, OSError) as e:
            log.warning("unmount: registration %s not updated (%s); it expires with its lease",
                        self.key, e)
        if self._conn is not None:
            self._conn.close()
        self.publisher.close()
        self.blobs.close()

    def adopt(self, pages: Sequence[str]) -> int:
        """Give the pages a manifest lists that the namespace lacks a blob row each, if the bucket has them.

        Runs in a content thread, before the transaction that forks them.
        Rows of blobs nothing here references any more are checked too: the
        bucket's gc may have removed them since (our registration no longer
        listed them), and a fork must not bring back a page without bytes.
        The lookups run outside the SQLite write lock; the registration is
        nudged so that what was found is listed in it within moments.
        """
        want = {p for p in pages if is_digest(p)}
        if not want:
            return 0
        with self.db.writing() as conn:
            known = ns.known_blobs(conn, want)
            held = ns.referenced_among(conn, known.keys())
        unknown = want - known.keys()
        unheld = set(known) - held
        if not unknown and not unheld:
            return 0
        rows = self.blobs.lookup_many(unknown | unheld)
        gone = unheld - rows.keys()
        new = [r for d, r in rows.items() if d in unknown]
        if rows:
            with self._lock:
                self._pinned |= rows.keys()
            self._wake.set()
        if new or gone:
            self.db.run_in_transaction(_update_blob_rows, new, sorted(gone))
        if unknown:
            log.info("looked up %d pages in %s: %d found%s", len(unknown), self.blobs.url, len(new),
                     "" if len(new) == len(unknown) else f", {len(unknown) - len(new)} missing")
        if gone:
            log.info("%d pages listed by a manifest are no longer in %s (gc removed them)",
                     len(gone), self.blobs.url)
        return len(new)


def _update_blob_rows(conn: sqlite3.Connection, new: list[ns.BlobRow], gone: list[str]) -> None:
    ns.insert_blob_rows(conn, new)
    for d in gone:
        # Only if still unreferenced: a commit since may have named it (and
        # then its own put or lookup found it stored).
        ns.drop_unreferenced_blob_row(conn, d)


def attach(st: StoreDir, db: Database, *, cache_size: int, lease: str | None) -> RemoteMount:
    """The registration of a mount of S3 store *st* over the mount's namespace
    *db*, with the mount's options ``cache_size`` and ``lease`` (a duration;
    None: DEFAULT_LEASE): started, with the store's frame cache sized.  (The
    store asks the namespace whether it knows a blob before a small upload:
    see StoreDir's *mounted*.)"""
    from pffs.maint.gc import parse_duration
    logging.getLogger("botocore").setLevel(logging.WARNING)  # credentials and endpoint notes each start
    blobs = st.blobs
    if not blobs.remote:
        raise PffsError(f"{st.root}: not an S3 store")
    blobs.set_cache_limit(cache_size)
    seconds = parse_duration(lease) if lease else DEFAULT_LEASE
    if seconds < 1:
        raise PffsError("lease must be at least 1s")
    rm = RemoteMount(st.root, blobs, db, seconds)
    rm.start()
    log.info("blobs in %s (cache %s, up to %d bytes); registered as %s, lease %.0f s",
             blobs.url, st.root, blobs.cache.limit, rm.key, seconds)
    return rm
