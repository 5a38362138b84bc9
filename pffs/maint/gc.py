"""``pffs gc``: remove blobs that no file holds and no manifest lists (contract §4 gc roots).

Mark: every referenced blob is live (:mod:`pffs.namespace.references`: held
by a file, open or not, listed by a manifest.json, or kept by the prefix
cache).  Sweep: the
other blob files, their ``blobs`` rows, rows whose blob file is gone, and
temp files of interrupted puts.  Nothing younger than the grace period is
swept (a dedup hit refreshes a blob's mtime), which covers writers that do not
take part in the gc lock, such as a session sink that has put its pages but
not yet committed them.

Safe while the store is mounted and busy: the daemon holds the store's
:class:`~pffs.store.storedir.GcLock` shared from "is this blob stored?" to the
commit naming it; gc takes it exclusively for each batch, re-checks every
candidate (still unnamed, still old) in the same SQLite transaction that
drops its row, commits, and only then unlinks the files.  A crash after the
commit leaves unindexed blob files, which the next gc sweeps and which a
writer may meanwhile reuse intact.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pffs import namespace as ns
from pffs.errors import PffsError, StoreFull
from pffs.store.local import TMP_PREFIX, LocalBlobStore
from pffs.store.reserve import SpaceReserve
from pffs.store.storedir import StoreBusy, StoreDir
from pffs.types import Digest, is_digest

DEFAULT_GRACE = 600.0
BATCH = 512


@dataclass
class GcResult:
    dry_run: bool
    mounted: bool
    blobs_on_disk: int = 0
    live: int = 0
    removed: int = 0              # blob files removed
    removed_bytes: int = 0        # their bytes on disk
    rows_dropped: int = 0         # blobs rows dropped (with or without a file)
    temp_removed: int = 0
    young: int = 0                # unnamed blobs kept because they are within the grace period
    raced: int = 0                # candidates a writer named (or refreshed) before gc got to them
    pinned: int = 0               # candidates a writer outside the daemon pinned (see GcLock.pin)
    removed_digests: list[str] = field(default_factory=list)

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        parts = [f"{verb} {self.removed} blobs ({self.removed_bytes} bytes)",
                 f"{self.live} live blobs kept"]
        if self.young:
            parts.append(f"{self.young} unnamed blobs younger than the grace period kept")
        if self.pinned:
            parts.append(f"{self.pinned} blobs pinned by a writer about to commit kept")
        stale = self.rows_dropped - self.removed
        if stale > 0:
            parts.append(f"{'would drop' if self.dry_run else 'dropped'} {stale} rows of missing blobs")
        if self.temp_removed:
            parts.append(f"{verb} {self.temp_removed} temp files")
        return ", ".join(parts)


def _scan(blob_root: Path, cutoff: float, progress) -> tuple[dict[str, tuple[float, int]], list[Path]]:
    """Blob files on disk (digest → (mtime, size)) and old temp files."""
    blobs: dict[str, tuple[float, int]] = {}
    temps: list[Path] = []
    if not blob_root.is_dir():
        return blobs, temps
    subs = sorted(e.name for e in os.scandir(blob_root) if e.is_dir() and len(e.name) == 2)
    for i, sub in enumerate(subs):
        for ent in os.scandir(blob_root / sub):
            try:
                st = ent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if ent.name.startswith(TMP_PREFIX):
                if st.st_mtime < cutoff:
                    temps.append(Path(ent.path))
                continue
            d = "sha256:" + ent.name
            if is_digest(d) and ent.name.startswith(sub):
                blobs[d] = (st.st_mtime, st.st_size)
        if progress:
            progress(i + 1, len(subs))
    return blobs, temps


def _open(store: StoreDir) -> tuple[LocalBlobStore, bool, sqlite3.Connection]:
    """(blobs, mounted, connection); takes the store lock when nobody mounts the store."""
    if not store.exists():
        raise PffsError(f"{store.root}: no pffs store here")
    blobs = store.blobs
    if blobs.remote:
        raise PffsError(f"{store.root}: gc works on a local store only (this one keeps its blobs elsewhere)")
    try:
        store.lock("pffs gc")
        mounted = False
    except StoreBusy:
        holder = store.in_use() or ""
        if "pffs mount" not in holder:
            raise
        mounted = True
    try:
        conn = ns.open_db(store.root, create_missing=False)
    except BaseException:
        store.unlock()
        raise
    return blobs, mounted, conn


def collect(store: StoreDir, *, grace: float = DEFAULT_GRACE, dry_run: bool = False,
            progress: Callable[[int, int], None] | None = None) -> GcResult:
    """Run one gc over *store* (mounted or not) and say what it removed."""
    blobs, mounted, conn = _open(store)
    try:
        return _collect(store, blobs, conn, mounted, grace, dry_run, progress)
    finally:
        conn.close()
        store.unlock()


def _collect(store: StoreDir, blobs: LocalBlobStore, conn: sqlite3.Connection, mounted: bool,
             grace: float, dry_run: bool, progress) -> GcResult:
    r = GcResult(dry_run=dry_run, mounted=mounted)
    cutoff = time.time() - grace
    on_disk, temps = _scan(blobs.blob_root, cutoff, None)
    r.blobs_on_disk = len(on_disk)
    # One read transaction: a consistent view of the roots and the index.
    conn.execute("BEGIN")
    try:
        live = set(ns.iter_referenced_blobs(conn))
        indexed = {d: size for d, size in conn.execute("SELECT digest, stored_size FROM blobs")}
    finally:
        conn.execute("COMMIT")
    r.live = len(live & (set(on_disk) | set(indexed)))
    candidates: list[str] = []
    for d, (mtime, _size) in on_disk.items():
        if d in live:
            continue
        if mtime >= cutoff:
            r.young += 1
            continue
        candidates.append(d)
    stale_rows = [d for d in indexed if d not in on_disk and d not in live]
    candidates.sort()
    todo = candidates + sorted(stale_rows)
    if dry_run:
        r.removed = len(candidates)
        r.removed_bytes = sum(on_disk[d][1] for d in candidates)
        r.rows_dropped = sum(1 for d in candidates if d in indexed) + len(stale_rows)
        r.temp_removed = len(temps)
        r.removed_digests = candidates
        return r
    if temps:
        # A daemon's put writes its temp file under the shared gc lock.
        with store.gc_lock.exclusive():
            for p in temps:
                try:
                    if p.stat().st_mtime < cutoff:
                        p.unlink()
                        r.temp_removed += 1
                except FileNotFoundError:
                    pass
    done = 0
    for i in range(0, len(todo), BATCH):
        _sweep(store, conn, todo[i:i + BATCH], cutoff, r)
        done += len(todo[i:i + BATCH])
        if progress:
            progress(done, len(todo))
    return r


def _sweep(store: StoreDir, conn: sqlite3.Connection, batch: list[str], cutoff: float,
           r: GcResult) -> None:
    """Re-check and remove one batch under the exclusive gc lock."""
    reserve = SpaceReserve(store.reserve_path)
    with store.gc_lock.exclusive():
        # Blobs a writer outside the daemon put and will name at its commit.
        pinned = store.gc_lock.pinned()
        kept = [d for d in batch if d in pinned]
        if kept:
            r.pinned += len(kept)
            batch = [d for d in batch if d not in pinned]
        for attempt in range(2):
            try:
                with ns.transaction(conn):
                    gone = _drop_rows(store, conn, batch, cutoff)
                break
            except sqlite3.OperationalError as e:
                if not ns.is_disk_full(e):
                    raise
                # Unindexed blob files need no commit: removing them first
                # may make room for the transaction that drops the rest.
                freed = _drop_unindexed(store, conn, batch, cutoff, r)
                if attempt or not (freed or reserve.release()):
                    raise StoreFull(f"{store.root}: disk full, cannot commit gc's changes") from None
        r.raced += len(batch) - len(gone)
        # Committed: nothing can name these blobs any more.
        for d, path, size, had_row in gone:
            r.rows_dropped += had_row
            if path is None:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            r.removed += 1
            r.removed_bytes += size
            r.removed_digests.append(d)


def _candidate_ok(store: StoreDir, conn: sqlite3.Connection, d: str, cutoff: float):
    """(path, size) of a blob still fit to sweep, (None, None) if its file is gone, or False."""
    if ns.is_referenced(conn, d):
        return False
    path = store.blobs.path(Digest(d))
    try:
        st = path.stat()
    except FileNotFoundError:
        return None, None
    if st.st_mtime >= cutoff:
        return False
    return path, st.st_size


def _drop_rows(store: StoreDir, conn: sqlite3.Connection, batch: list[str], cutoff: float):
    """Drop the rows of the batch's blobs still fit to sweep: [(digest, path|None, size, had_row)]."""
    gone = []
    for d in batch:
        ok = _candidate_ok(store, conn, d, cutoff)
        if ok is False:
            continue  # named or refreshed since the scan: kept
        path, size = ok
        had_row = conn.execute("DELETE FROM blobs WHERE digest=?", (d,)).rowcount > 0
        if path is not None or had_row:
            gone.append((d, path, size, had_row))
    return gone


def _drop_unindexed(store: StoreDir, conn: sqlite3.Connection, batch: list[str], cutoff: float,
                    r: GcResult) -> bool:
    freed = False
    for d in batch:
        if conn.execute("SELECT 1 FROM blobs WHERE digest=?", (d,)).fetchone():
            continue
        ok = _candidate_ok(store, conn, d, cutoff)
        if not ok or ok[0] is None:
            continue
        path, size = ok
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        r.removed += 1
        r.removed_bytes += size
        r.removed_digests.append(d)
        freed = True
    return freed


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '12h', '7d', '2w' → seconds."""
    t = text.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    mult = 1
    if t and t[-1] in units:
        mult = units[t[-1]]
        t = t[:-1]
    try:
        v = float(t)
    except ValueError:
        raise PffsError(f"bad duration {text!r} (use e.g. 90s, 10m, 12h, 7d)") from None
    if v < 0:
        raise PffsError(f"bad duration {text!r}: negative")
    return v * mult
