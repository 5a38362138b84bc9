"""Manifests' page lists and what holds them: manifest records, pagesets, folds, whole lists.

A page list (``manifest_pages``) belongs to a manifest's bytes and stays
while a recorded manifest (``manifests``), a fork's page files (through
their ``pagesets`` row) or a folded fork (``folds``) holds it.  The tree's
changes call in here to keep that true; this module calls nothing of the
tree's.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from pffs.namespace.prefix_index import IndexKeys, ensure_keys, page_rows
from pffs.namespace.schema import BLOCK_SIZE


def record_manifest(conn: sqlite3.Connection, ino: int, pages: Sequence[str], digest: str,
                    keys: IndexKeys | None = None) -> None:
    """Remember that *ino*, whose bytes have *digest*, holds a valid manifest listing *pages*
    (whose token chain keys are *keys*, prefix_index.manifest_keys).

    The pages (gc roots) and their keys (the prefix index) are rows of the
    manifest's bytes: a fork's manifest, byte for byte its source's, adds
    one ``manifests`` row and no page rows.
    """
    _record(conn, ino, len(pages), digest)
    have = conn.execute("SELECT COUNT(*) FROM manifest_pages WHERE manifest=?", (digest,)).fetchone()[0]
    if have == len(pages):
        ensure_keys(conn, digest, keys)
        return
    conn.execute("DELETE FROM manifest_pages WHERE manifest=?", (digest,))
    conn.execute("DELETE FROM whole_lists WHERE manifest=?", (digest,))
    conn.executemany("INSERT INTO manifest_pages (manifest, page_ix, digest, space, key) VALUES (?,?,?,?,?)",
                     page_rows(conn, digest, pages, keys))


def record_known_manifest(conn: sqlite3.Connection, ino: int, digest: str, n_pages: int) -> bool:
    """:func:`record_manifest` for bytes whose page list of *n_pages* is recorded whole, without
    reading it.  False, recording nothing, if that list is not whole (any more)."""
    if recorded_count(conn, digest) != n_pages:
        return False
    _record(conn, ino, n_pages, digest)
    return True


def _record(conn: sqlite3.Connection, ino: int, n_pages: int, digest: str) -> None:
    old = conn.execute("SELECT digest FROM manifests WHERE inode=?", (ino,)).fetchone()
    conn.execute("INSERT OR REPLACE INTO manifests (inode, n_pages, digest) VALUES (?,?,?)",
                 (ino, n_pages, digest))
    if old is not None and old[0] != digest:
        drop_unheld_pages(conn, old[0])


def forget_manifest(conn: sqlite3.Connection, ino: int) -> None:
    """*ino* holds no recorded manifest any more; its page rows go with the last holder of its bytes."""
    row = conn.execute("SELECT digest FROM manifests WHERE inode=?", (ino,)).fetchone()
    if row is None:
        return
    conn.execute("DELETE FROM manifests WHERE inode=?", (ino,))
    drop_unheld_pages(conn, row[0])


def drop_unheld_pages(conn: sqlite3.Connection, digest: str) -> None:
    """Drop the page list of manifest bytes *digest* unless a manifest or a fork's pages
    (page files or a fold) hold it."""
    if conn.execute("SELECT 1 FROM manifests WHERE digest=? LIMIT 1", (digest,)).fetchone() is not None:
        return
    if conn.execute("SELECT 1 FROM folds WHERE manifest=? LIMIT 1", (digest,)).fetchone() is not None:
        return
    ps = conn.execute("SELECT id FROM pagesets WHERE manifest=?", (digest,)).fetchone()
    if ps is not None:
        if conn.execute("SELECT 1 FROM blocks WHERE via=? LIMIT 1", (ps[0],)).fetchone() is not None:
            return
        conn.execute("DELETE FROM pagesets WHERE id=?", (ps[0],))
    conn.execute("DELETE FROM manifest_pages WHERE manifest=?", (digest,))
    conn.execute("DELETE FROM whole_lists WHERE manifest=?", (digest,))


def recorded_count(conn: sqlite3.Connection, digest: str) -> int | None:
    """The page count of a recorded manifest whose bytes have *digest*, if its page list is
    whole (None: none recorded, or its list lacks rows)."""
    found = conn.execute("SELECT n_pages FROM manifests WHERE digest=? LIMIT 1", (digest,)).fetchone()
    if found is None:
        return None
    if found_whole(conn, digest, found[0]) is not None:
        return found[0]  # (found whole: one row a page, and the list goes only at once)
    have = conn.execute("SELECT COUNT(*) FROM manifest_pages WHERE manifest=?", (digest,)).fetchone()[0]
    return found[0] if have == found[0] else None


def found_whole(conn: sqlite3.Connection, digest: str, n_pages: int) -> tuple[int, int] | None:
    """(files, bytes) of the page list of *digest* if it was found whole with *n_pages* pages."""
    row = conn.execute("SELECT files, bytes FROM whole_lists WHERE manifest=?", (digest,)).fetchone()
    return row if row is not None and row[0] == n_pages else None


def recorded_pages(conn: sqlite3.Connection, digest: str) -> list[str] | None:
    """The pages of a recorded manifest whose bytes have *digest* (None: none recorded)."""
    found = conn.execute("SELECT n_pages FROM manifests WHERE digest=? LIMIT 1", (digest,)).fetchone()
    if found is None:
        return None
    pages = [d for (d,) in conn.execute(
        "SELECT digest FROM manifest_pages WHERE manifest=? ORDER BY page_ix", (digest,))]
    return pages if len(pages) == found[0] else None


def _pageset(conn: sqlite3.Connection, manifest: str) -> int:
    conn.execute("INSERT OR IGNORE INTO pagesets (manifest) VALUES (?)", (manifest,))
    return conn.execute("SELECT id FROM pagesets WHERE manifest=?", (manifest,)).fetchone()[0]


def make_pages(conn: sqlite3.Connection, pdir: int, manifest: str, uid: int, gid: int, mode: int,
               t: int, taken: bool) -> int:
    """The page files of *manifest* in *pdir* whose blobs are stored: their inodes, blocks and
    dentries rows, by three INSERT ... SELECT statements with no row passing through Python.

    *taken*: *pdir* has entries already, whose names are left alone.  Returns how many were made.
    """
    # This runs inside the writer's transaction: nobody else allocates ids
    # meanwhile.  Page i gets inode first + i (a page left out leaves a gap),
    # so the rows inserted are the ids from first on, and each one's page
    # index is its id - first.
    # (Past every id ever given, not only the live ones: ids are never reused.)
    first = conn.execute("SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name='inodes'), 0),"
                         " COALESCE((SELECT MAX(id) FROM inodes), 0)) + 1").fetchone()[0]
    args = dict(m=manifest, bs=BLOCK_SIZE, dir=pdir, first=first, mode=mode, uid=uid, gid=gid, t=t)
    # Pages not stored (the session stays incomplete) or too large to be one
    # blob (never a page) are left out, as are names pages/ holds already.
    # Names as page_name() spells them: six digits, more when needed.
    where_free = (" AND NOT EXISTS (SELECT 1 FROM dentries d WHERE d.parent = :dir"
                  " AND d.name = CAST(printf('%06d', p.page_ix) AS BLOB))") if taken else ""
    n = conn.execute(
        "INSERT INTO inodes (id, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink, rdev, digest)"
        " SELECT :first + p.page_ix, :mode, :uid, :gid, b.raw_size, :t, :t, :t, 1, 0, p.digest"
        " FROM manifest_pages p JOIN blobs b ON b.digest = p.digest"
        " WHERE p.manifest = :m AND b.raw_size <= :bs" + where_free, args).rowcount
    if not n:
        return 0
    args["via"] = _pageset(conn, manifest)
    conn.execute("INSERT INTO blocks (inode, blockno, blob, via)"
                 " SELECT id, 0, digest, :via FROM inodes WHERE id >= :first AND size > 0", args)
    conn.execute("INSERT INTO dentries (parent, name, inode)"
                 " SELECT :dir, CAST(printf('%06d', id - :first) AS BLOB), id FROM inodes"
                 " WHERE id >= :first", args)
    return n


def is_folded(conn: sqlite3.Connection, pdir: int) -> bool:
    return conn.execute("SELECT 1 FROM folds WHERE dir=?", (pdir,)).fetchone() is not None


def unfold(conn: sqlite3.Connection, pdir: int) -> int:
    """Make the page files of the folded fork in *pdir*, if it is one; returns how many.

    Their inode numbers are given now (nobody has seen them), their owner,
    mode and times are the fork's.  Nothing else changes: the folder's
    times stay those of the fork.
    """
    row = conn.execute("SELECT manifest, uid, gid, mode, t_ns FROM folds WHERE dir=?", (pdir,)).fetchone()
    if row is None:
        return 0
    manifest, uid, gid, mode, t = row
    conn.execute("DELETE FROM folds WHERE dir=?", (pdir,))
    n = make_pages(conn, pdir, manifest, uid, gid, mode, t, False)
    if not n:
        drop_unheld_pages(conn, manifest)
    return n


def drop_fold(conn: sqlite3.Connection, pdir: int) -> None:
    row = conn.execute("SELECT manifest FROM folds WHERE dir=?", (pdir,)).fetchone()
    if row is not None:
        conn.execute("DELETE FROM folds WHERE dir=?", (pdir,))
        drop_unheld_pages(conn, row[0])

