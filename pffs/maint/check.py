"""``pffs check``: namespace ↔ blobs consistency, sessions, and optionally every byte.

Damage (exit ≠ 0): a namespace database SQLite finds damaged; a file naming a
blob that is missing, corrupt or of the wrong length; a file whose blocks
disagree with its size or digest; a blob a file holds without a row in
``blobs``; entries naming missing inodes or sitting in non-directories;
inodes no name reaches from the root; wrong link counts; rows of inodes that
no longer exist.  Not damage (reported as notes): garbage and unindexed blobs
(gc's job), unreferenced corrupt blobs, incomplete sessions and sessions whose
pages disagree with their manifest (the user's business, contract §3.5).

:func:`check` returns the findings in a form :mod:`pffs.maint.repair` acts on.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from pffs import manifest as mf
from pffs.errors import IntegrityError
from pffs.namespace import (
    BLOCK_SIZE,
    EMPTY_DIGEST,
    ROOT_INODE,
    files_holding,
    iter_referenced_blobs,
    path_of,
    prefix_index,
    read_file,
    transaction,
    unfold,
)
from pffs.store.local import LocalBlobStore
from pffs.types import Digest


@dataclass
class BlobStatus:
    on_disk: set[str] = field(default_factory=set)
    indexed: dict[str, tuple[int, int]] = field(default_factory=dict)  # digest -> (raw, stored)
    held: set[str] = field(default_factory=set)      # named by blocks rows
    referenced: set[str] = field(default_factory=set)  # the gc roots (iter_referenced_blobs)
    bad: dict[str, str] = field(default_factory=dict)         # held blobs: missing, corrupt, wrong length
    corrupt_unheld: dict[str, str] = field(default_factory=dict)
    raw_len: dict[str, int] = field(default_factory=dict)     # raw length of every readable blob


@dataclass
class Report:
    damage: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    blobs: BlobStatus = field(default_factory=BlobStatus)
    bad_files: dict[int, str] = field(default_factory=dict)   # inode -> why its content is damaged
    db_errors: list[str] = field(default_factory=list)
    index_wrong: bool = False       # the prefix index disagrees with the manifests (repair rebuilds it)

    @property
    def clean(self) -> bool:
        return not self.damage


def database_errors(conn: sqlite3.Connection, limit: int = 20) -> list[str]:
    """What SQLite's integrity check finds wrong with the database file (empty: fine)."""
    try:
        rows = [r[0] for r in conn.execute(f"PRAGMA integrity_check({int(limit)})")]
    except sqlite3.DatabaseError as e:
        return [str(e)]
    return [] if rows == ["ok"] else rows


def _read_blob(blobs: LocalBlobStore, d: str, read_data: bool) -> tuple[str, int, str | None]:
    """(digest, raw length, None), or (digest, 0, why) for a blob that cannot be read."""
    try:
        if read_data:
            size = len(blobs.get(Digest(d), rehash=True))
        else:
            size = blobs.header(Digest(d)).raw_len
        return d, size, None
    except IntegrityError as e:
        return d, 0, e.reason
    except OSError as e:
        return d, 0, f"unreadable ({e.strerror})"


def blob_status(conn: sqlite3.Connection, blobs: LocalBlobStore, *, read_data: bool = False,
                progress: Callable[[int, int], None] | None = None, threads: int | None = None) -> BlobStatus:
    """Which blobs are stored, indexed, named, and which of the named ones are unusable."""
    s = BlobStatus()
    s.on_disk = {str(d) for d in blobs}
    s.indexed = {d: (raw, stored) for d, raw, stored in
                 conn.execute("SELECT digest, raw_size, stored_size FROM blobs")}
    s.held = {d for (d,) in conn.execute("SELECT DISTINCT blob FROM blocks")}
    s.referenced = set(iter_referenced_blobs(conn))
    for d in s.held - s.on_disk:
        s.bad[d] = "is missing"
    todo = sorted(s.on_disk)
    workers = threads or (os.cpu_count() or 2) if read_data else 1
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        # zstd and sha256 release the GIL: read-data runs on every core.
        for i, (d, size, err) in enumerate(pool.map(lambda d: _read_blob(blobs, d, read_data), todo)):
            if err is None and d in s.indexed and s.indexed[d][0] != size:
                err = f"holds {size} bytes, the index says {s.indexed[d][0]}"
            if err is None:
                s.raw_len[d] = size
            elif d in s.held:
                s.bad[d] = err
            else:
                s.corrupt_unheld[d] = err
            if progress:
                progress(i + 1, len(todo))
    return s


def check(conn: sqlite3.Connection, blobs: LocalBlobStore, *, read_data: bool = False,
          progress: Callable[[int, int], None] | None = None) -> Report:
    r = Report()
    r.db_errors = database_errors(conn)
    if r.db_errors:
        r.damage += [f"namespace database: {e}" for e in r.db_errors]
        r.damage.append("the namespace database is damaged; pffs check --repair restores the newest snapshot")
        return r
    # Folded forks become the rows every check below reads; one whose page
    # list lost rows stays folded (repair records the list again first).
    with transaction(conn):
        short = folds_short(conn)
        for (d,) in conn.execute("SELECT dir FROM folds").fetchall():
            if d not in short:
                unfold(conn, d)
    for d, (files, gives) in sorted(short.items()):
        r.damage.append(f"{path_of(conn, d)}: a fork's {files} page files are folded here, and the"
                        f" page list they come from gives {gives}")
    s = r.blobs = blob_status(conn, blobs, read_data=read_data, progress=progress)
    r.counts["blobs_on_disk"] = len(s.on_disk)
    r.counts["blobs_indexed"] = len(s.indexed)

    for d, why in sorted(s.bad.items()):
        for ino in files_holding(conn, d):
            r.bad_files.setdefault(ino, f"blob {d} {why}")
    for d in sorted(s.held - set(s.indexed) - set(s.bad)):
        r.damage.append(f"blob {d} is held by a file but has no row in blobs")
    for d in sorted(set(s.indexed) - s.on_disk - s.held):
        r.notes.append(f"blob {d} is indexed but not stored (not held by any file)")
    for d, why in sorted(s.corrupt_unheld.items()):
        r.notes.append(f"unreferenced blob {d} {why}")
    orphans = s.on_disk - set(s.indexed)
    if orphans:
        r.notes.append(f"{len(orphans)} stored blobs are not indexed"
                       " (left by interrupted writes; gc removes them)")
    r.counts["garbage_blobs"] = len(set(s.indexed) - s.referenced)

    _check_files(conn, r)
    _check_tree(conn, r)
    for ino, why in sorted(r.bad_files.items()):
        r.damage.append(f"{path_of(conn, ino)}: {why}")

    n_sessions = 0
    for dir_ino, ino in conn.execute(
            "SELECT d.parent, d.inode FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE d.name = ? AND (i.mode & 61440) = 32768", (mf.MANIFEST_NAME.encode(),)):
        n_sessions += 1
        if ino in r.bad_files:
            continue
        r.notes.extend(check_session(conn, dir_ino, ino, blobs))
    r.counts["sessions"] = n_sessions
    _check_index(conn, blobs, r)
    return r


def _check_index(conn: sqlite3.Connection, blobs: LocalBlobStore, r: Report) -> None:
    """The prefix index against the manifests (SPEC §7): each recorded manifest's keys."""
    if not prefix_index.is_built(conn):
        r.notes.append("the prefix index is not built yet (the next mount or pffs check --repair"
                       " builds it from the manifests)")
        return
    wrong = prefix_index.disagreements(
        conn, lambda ino: read_file(conn, blobs, ino, mf.MAX_MANIFEST_BYTES))
    for ino, why in wrong:
        r.damage.append(f"{path_of(conn, ino)}: {why}" if ino else why)
    r.index_wrong = bool(wrong)
    r.counts["prefix_keys"] = conn.execute("SELECT COUNT(*) FROM manifest_pages WHERE key IS NOT NULL"
                                           ).fetchone()[0]


# A fork's blocks row (via set) whose pageset does not list its blob: gc
# would not see that blob held.
# (The + keeps SQLite on manifest_pages' digest index, not on every page of the manifest.)
UNPINNED_FORK_ROW = ("via IS NOT NULL AND NOT EXISTS (SELECT 1 FROM manifest_pages p JOIN pagesets ps"
                     " ON ps.id = blocks.via WHERE p.digest = blocks.blob AND +p.manifest = ps.manifest)")


def folds_short(conn: sqlite3.Connection) -> dict[int, tuple[int, int]]:
    """Folded forks whose page list no longer gives each of their files: {folder: (files, pages
    it gives)}."""
    return {d: (files, gives) for d, files, gives in conn.execute(
        "SELECT f.dir, f.files, (SELECT COUNT(*) FROM manifest_pages p JOIN blobs b ON b.digest = p.digest"
        " WHERE p.manifest = f.manifest AND b.raw_size <= ?) FROM folds f", (BLOCK_SIZE,))
        if files != gives}


def wrong_whole_lists(conn: sqlite3.Connection) -> int:
    """Rows of ``whole_lists`` that their page list and the blob rows no longer bear out."""
    return conn.execute(
        "SELECT COUNT(*) FROM whole_lists w LEFT JOIN (SELECT p.manifest, COUNT(b.digest) AS files,"
        " COALESCE(SUM(b.raw_size), 0) AS bytes, COUNT(*) AS rows FROM manifest_pages p"
        " LEFT JOIN blobs b ON b.digest = p.digest AND b.raw_size <= ? GROUP BY p.manifest) l"
        " ON l.manifest = w.manifest"
        " WHERE l.manifest IS NULL OR l.files != w.files OR l.rows != w.files OR l.bytes != w.bytes",
        (BLOCK_SIZE,)).fetchone()[0]


def short_page_lists(conn: sqlite3.Connection) -> list[tuple[str, int, int, int]]:
    """Recorded manifests whose page list has not one row per page: (digest, an inode holding it,
    pages, rows)."""
    return [row for row in conn.execute(
        "SELECT m.digest, MIN(m.inode), MAX(m.n_pages),"
        " (SELECT COUNT(*) FROM manifest_pages p WHERE p.manifest = m.digest) AS have"
        " FROM manifests m JOIN inodes i ON i.id = m.inode WHERE i.digest IS m.digest"
        " GROUP BY m.digest") if row[2] != row[3]]


def _check_files(conn: sqlite3.Connection, r: Report) -> None:
    """Regular files: blocks cover the size, sizes add up, the digest column agrees."""
    s = r.blobs
    for ino, size, digest, blobs_csv, nblocks, maxno in conn.execute(
            "SELECT i.id, i.size, i.digest, GROUP_CONCAT(b.blob, ','), COUNT(b.blob), MAX(b.blockno)"
            " FROM inodes i LEFT JOIN (SELECT * FROM blocks ORDER BY inode, blockno) b ON b.inode = i.id"
            " WHERE (i.mode & 61440) = 32768 GROUP BY i.id"):
        if ino in r.bad_files:
            continue
        blocks = blobs_csv.split(",") if blobs_csv else []
        want = -(-size // BLOCK_SIZE)
        total = sum(s.raw_len.get(d, s.indexed.get(d, (0, 0))[0]) for d in blocks)
        if nblocks != want or (want and (maxno != want - 1 or total != size)):
            r.bad_files[ino] = f"{nblocks} blocks of {total} bytes for a size of {size}"
        elif want <= 1 and digest != (blocks[0] if blocks else EMPTY_DIGEST):
            r.bad_files[ino] = f"digest {digest} disagrees with its blob"
    for table in ("blocks", "xattrs", "manifests"):
        n = conn.execute(f"SELECT COUNT(*) FROM {table} t LEFT JOIN inodes i ON i.id = t.inode"
                         " WHERE i.id IS NULL").fetchone()[0]
        if n:
            r.damage.append(f"{n} {table} rows belong to inodes that do not exist")
    n = conn.execute("SELECT COUNT(*) FROM manifests m JOIN inodes i ON i.id = m.inode"
                     " WHERE i.digest IS NOT m.digest").fetchone()[0]
    if n:
        r.damage.append(f"{n} manifests rows name bytes their files no longer hold")
    n = conn.execute("SELECT COUNT(*) FROM manifest_pages p WHERE NOT EXISTS"
                     " (SELECT 1 FROM manifests m WHERE m.digest = p.manifest) AND NOT EXISTS"
                     " (SELECT 1 FROM pagesets ps JOIN blocks b ON b.via = ps.id"
                     "  WHERE ps.manifest = p.manifest) AND NOT EXISTS"
                     " (SELECT 1 FROM folds f WHERE f.manifest = p.manifest)").fetchone()[0]
    if n:
        r.damage.append(f"{n} manifest_pages rows belong to manifests no file holds")
    n = wrong_whole_lists(conn)
    if n:
        r.damage.append(f"{n} whole_lists rows say a page list is stored whole when it is not")
    n = conn.execute(f"SELECT COUNT(*) FROM blocks WHERE {UNPINNED_FORK_ROW}").fetchone()[0]
    if n:
        r.damage.append(f"{n} blocks rows of forked pages name a blob their manifest's page list lacks")
    for _digest, ino, want, have in short_page_lists(conn):
        r.damage.append(f"{path_of(conn, ino)}: the page list recorded for its bytes has {have} rows for"
                        f" its {want} pages (gc keeps a session's pages through it)")
    n = conn.execute("SELECT COUNT(*) FROM blocks b JOIN inodes i ON i.id = b.inode"
                     " WHERE (i.mode & 61440) != 32768").fetchone()[0]
    if n:
        r.damage.append(f"{n} blocks rows belong to inodes that are not regular files")


def _check_tree(conn: sqlite3.Connection, r: Report) -> None:
    """Entries, names, link counts, and reachability from the root."""
    root = conn.execute("SELECT mode FROM inodes WHERE id=?", (ROOT_INODE,)).fetchone()
    if root is None or not stat.S_ISDIR(root[0]):
        r.damage.append("the root directory is missing")
        return
    for (_did, parent, name, ino) in conn.execute(
            "SELECT d.id, d.parent, d.name, d.inode FROM dentries d LEFT JOIN inodes i ON i.id = d.inode"
            " WHERE i.id IS NULL"):
        r.damage.append(f"entry {name!r} in {path_of(conn, parent)} names missing inode {ino}")
    for (_did, parent, name) in conn.execute(
            "SELECT d.id, d.parent, d.name FROM dentries d LEFT JOIN inodes i ON i.id = d.parent"
            " WHERE i.id IS NULL OR (i.mode & 61440) != 16384"):
        r.damage.append(f"entry {name!r} sits in inode {parent}, which is not a directory")
    n = conn.execute("SELECT COUNT(*) FROM dentries WHERE inode=?", (ROOT_INODE,)).fetchone()[0]
    if n:
        r.damage.append(f"the root directory has {n} names")
    for ino, mode, nlink, names, subdirs in conn.execute(
            "SELECT i.id, i.mode, i.nlink,"
            " (SELECT COUNT(*) FROM dentries d WHERE d.inode = i.id),"
            " (SELECT COUNT(*) FROM dentries d JOIN inodes c ON c.id = d.inode"
            "   WHERE d.parent = i.id AND (c.mode & 61440) = 16384)"
            " FROM inodes i"):
        if stat.S_ISDIR(mode):
            want = 2 + subdirs
            if ino != ROOT_INODE and names > 1:
                r.damage.append(f"directory {path_of(conn, ino)} has {names} names")
        else:
            want = names
        if names == 0 and ino != ROOT_INODE:
            if nlink == 0:
                r.notes.append(f"inode {ino} is unlinked (was open at a crash; the next mount drops it)")
            else:
                r.damage.append(f"inode {ino} has no name (orphan)")
        elif nlink != want:
            r.damage.append(f"{path_of(conn, ino)}: link count {nlink}, should be {want}")
    unreachable = unreachable_inodes(conn)
    if unreachable:
        r.damage.append(f"{len(unreachable)} named inodes cannot be reached from the root"
                        f" (a directory cycle; first: inode {min(unreachable)})")


def unreachable_inodes(conn: sqlite3.Connection) -> set[int]:
    """Inodes that have names, none of which a walk from the root reaches."""
    children: dict[int, list[int]] = {}
    for parent, ino in conn.execute("SELECT parent, inode FROM dentries"):
        children.setdefault(parent, []).append(ino)
    seen: set[int] = {ROOT_INODE}
    stack: list[int] = [ROOT_INODE]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    named = {ino for (ino,) in conn.execute("SELECT DISTINCT d.inode FROM dentries d"
                                           " JOIN inodes i ON i.id = d.inode")}
    return named - seen


def check_session(conn: sqlite3.Connection, dir_ino: int, man_ino: int,
                  blobs: LocalBlobStore, bad_blobs: set[str] | None = None) -> list[str]:
    """Notes on one session: invalid manifest, missing or disagreeing pages."""
    where = path_of(conn, dir_ino)
    try:
        m = mf.parse(read_file(conn, blobs, man_ino, mf.MAX_MANIFEST_BYTES))
    except mf.ManifestError as e:
        return [f"session {where}: manifest.json is not valid ({e})"]
    except (IntegrityError, ValueError) as e:
        return [f"session {where}: manifest.json unreadable ({e})"]
    row = conn.execute("SELECT d.inode FROM dentries d JOIN inodes i ON i.id = d.inode"
                       " WHERE d.parent=? AND d.name=? AND (i.mode & 61440) = 16384",
                       (dir_ino, mf.PAGES_DIR.encode())).fetchone()
    if row is None:
        return [f"session {where}: incomplete (no pages/ folder)"] if m.pages else []
    pages_ino = row[0]
    have: dict[int, tuple[str, int]] = {}
    for name, digest, size in conn.execute(
            "SELECT d.name, i.digest, i.size FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE d.parent=? AND (i.mode & 61440) = 32768", (pages_ino,)):
        ix = mf.parse_page_name(name)
        if ix is not None:
            have[ix] = (digest, size)
    notes = []
    missing = [i for i in range(len(m.pages)) if i not in have]
    if missing:
        notes.append(f"session {where}: incomplete, {len(missing)} of {len(m.pages)} pages missing"
                     f" (first: {mf.page_name(missing[0])})")
    for i, want in enumerate(m.pages):
        if i in have:
            digest, size = have[i]
            if size != m.page_bytes:
                notes.append(f"session {where}: page {mf.page_name(i)} has {size} bytes,"
                             f" the geometry says {m.page_bytes}")
            elif digest != want:
                notes.append(f"session {where}: page {mf.page_name(i)} disagrees with manifest.json")
    extra = sorted(i for i in have if i >= len(m.pages))
    if extra:
        notes.append(f"session {where}: {len(extra)} page files beyond the manifest's {len(m.pages)}")
    return notes
