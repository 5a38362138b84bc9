"""Reads of the namespace that the mounted daemon makes: short indexed queries
on the event loop's read connection (names, listings, counts, what prefetch
reads ahead, which page files hold their manifest's blobs), and one asked
from any thread (``KnownBlobs``).

Each is a function of a connection, so that the daemon's own modules hold
no SQL (tests/t1_module_graph.py checks).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from collections.abc import Iterator, Sequence

from pffs import manifest as mf
from pffs.namespace.pagelists import recorded_count
from pffs.namespace.rows import READDIR_SQL, Inode, has_blob, lookup, names_of
from pffs.namespace.schema import BLOCK_SIZE, connect

#: Bad pages named in one verdict (``page_verdict``); past that the verdict says "more".
VERDICT_MAX = 256


def first_entry(conn: sqlite3.Connection, ino: int) -> tuple[int, bytes] | None:
    """(parent, name) of a name of *ino* (its only one but for a hard link), or None."""
    return conn.execute("SELECT parent, name FROM dentries WHERE inode=? LIMIT 1", (ino,)).fetchone()


def lookup_or_folded(conn: sqlite3.Connection, parent: int, name: bytes) -> tuple[int | None, bool]:
    """(the inode *name* in *parent* names, or None; whether *parent* holds a
    folded fork), in one statement: one snapshot, so that an unfold committed
    between a lookup and a look at folds cannot hide the name."""
    ino, folded = conn.execute(
        "SELECT (SELECT inode FROM dentries WHERE parent=:p AND name=:n),"
        " EXISTS (SELECT 1 FROM folds WHERE dir=:p)", dict(p=parent, n=name)).fetchone()
    return ino, bool(folded)


def readdir(conn: sqlite3.Connection, folder: int, after: int) -> Iterator[tuple[int, bytes, Inode]]:
    """The entries of *folder* after cookie *after*, in cookie order: (cookie, name, inode)."""
    for row in conn.execute(READDIR_SQL, (folder, after)):
        yield row[0], row[1], Inode(*row[2:])


def entry_count(conn: sqlite3.Connection, folder: int) -> int:
    """How many names *folder* holds, those of a folded fork counted."""
    return conn.execute(
        "SELECT (SELECT COUNT(*) FROM dentries WHERE parent=:d)"
        " + COALESCE((SELECT files FROM folds WHERE dir=:d), 0)", dict(d=folder)).fetchone()[0]


def nlink_of(conn: sqlite3.Connection, ino: int) -> int | None:
    """The link count of *ino*, or None where there is no such inode."""
    row = conn.execute("SELECT nlink FROM inodes WHERE id=?", (ino,)).fetchone()
    return None if row is None else row[0]


def size_of(conn: sqlite3.Connection, ino: int) -> int:
    """The committed size of *ino*."""
    return conn.execute("SELECT size FROM inodes WHERE id=?", (ino,)).fetchone()[0]


def inode_count(conn: sqlite3.Connection) -> int:
    """Inodes the namespace holds, the page files of folded forks counted."""
    return conn.execute("SELECT (SELECT COUNT(*) FROM inodes)"
                        " + (SELECT COALESCE(SUM(files), 0) FROM folds)").fetchone()[0]


def stored_bytes(conn: sqlite3.Connection) -> int:
    """The stored size of every blob the namespace has a row for."""
    return conn.execute("SELECT COALESCE(SUM(stored_size), 0) FROM blobs").fetchone()[0]


def files_content(conn: sqlite3.Connection,
                  inos: Sequence[int]) -> Iterator[tuple[int, int, str | None, int | None]]:
    """The committed content of the regular files among *inos*: (inode, size,
    blob, raw size) a block, in block order (blob None for an empty file)."""
    return conn.execute(
        "SELECT i.id, i.size, b.blob, bl.raw_size FROM inodes i"
        " LEFT JOIN blocks b ON b.inode = i.id LEFT JOIN blobs bl ON bl.digest = b.blob"
        f" WHERE i.id IN ({','.join('?' * len(inos))}) AND (i.mode & 61440) = 32768"
        " ORDER BY i.id, b.blockno", list(inos))


def named_files_content(conn: sqlite3.Connection, folder: int, names: Sequence[bytes],
                        ) -> Iterator[tuple[bytes, int, int, str | None, int | None]]:
    """The committed content of the regular files *names* in *folder*: (name,
    inode, size, blob, raw size) a block, by name and block order."""
    return conn.execute(
        "SELECT e.name, i.id, i.size, b.blob, bl.raw_size FROM dentries e"
        " JOIN inodes i ON i.id = e.inode LEFT JOIN blocks b ON b.inode = i.id"
        " LEFT JOIN blobs bl ON bl.digest = b.blob"
        f" WHERE e.parent=? AND e.name IN ({','.join('?' * len(names))})"
        " AND (i.mode & 61440) = 32768 ORDER BY e.name, b.blockno", (folder, *names))


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
    man = lookup(conn, session_dir, mf.MANIFEST_NAME.encode())
    if man is None or man in dirty:
        return None
    row = conn.execute("SELECT m.n_pages, m.digest FROM manifests m JOIN inodes i ON i.id = m.inode"
                       " WHERE m.inode=? AND i.digest = m.digest", (man,)).fetchone()
    if row is None:
        return None
    n_pages, digest = row
    if recorded_count(conn, digest) != n_pages:
        return None  # its page list lacks rows: nothing to check against
    out = {"manifest": digest, "pages": n_pages, "bad": [], "more": False}
    # The size every good page's file has, when they all have one (they do
    # in any session an engine wrote): a reader then needs no look per page.
    sizes = conn.execute("SELECT DISTINCT b.raw_size FROM manifest_pages p JOIN blobs b ON b.digest = p.digest"
                         " WHERE p.manifest=? LIMIT 2", (digest,)).fetchall()
    if len(sizes) == 1:
        out["page_size"] = sizes[0][0]
    pdir = lookup(conn, session_dir, mf.PAGES_DIR.encode())
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
        for parent, name in names_of(conn, ino):
            if parent == pdir and name.isdigit() and int(name) < n_pages \
                    and mf.page_name(int(name)).encode() == name:
                bad.append(int(name))
    bad = sorted(set(bad))
    out["bad"] = bad[:VERDICT_MAX]
    out["more"] = len(bad) > VERDICT_MAX
    return out


class KnownBlobs:
    """Whether the namespace at *path* has a row for a blob, asked from any
    thread: each asking thread opens a read connection of its own, once."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self._local = threading.local()

    def __call__(self, digest: str) -> bool:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.path, readonly=True)
        return has_blob(conn, digest)
