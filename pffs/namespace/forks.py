"""Metadata-only forks: a session's ``pages/`` filled from a recorded manifest's page list."""

from __future__ import annotations

import sqlite3
import stat

from pffs.namespace.pagelists import found_whole, make_pages, unfold
from pffs.namespace.rows import get_inode, lookup, touch_dir
from pffs.namespace.schema import BLOCK_SIZE, now_ns


def fork_pages(conn: sqlite3.Connection, session_dir: int, manifest: str, uid: int, gid: int,
               mode: int = 0o644) -> list[tuple[int, int]]:
    """Metadata-only fork: create every page missing from ``pages/``.

    *manifest* is the digest of a manifest recorded by :func:`record_manifest`
    (its page list is read from ``manifest_pages``).  Only when ``pages/``
    exists (pffs never creates it) and only for pages whose blob is stored.
    Returns [(pages dir inode, number of page files created)], or [] if none.
    An empty ``pages/`` given every page of the manifest is folded: one row,
    whatever the page count (see :func:`unfold`).  Otherwise the page files
    are made at once, by three INSERT ... SELECT statements.
    """
    from pffs.manifest import PAGES_DIR
    pdir = lookup(conn, session_dir, PAGES_DIR.encode())
    if pdir is None or not get_inode(conn, pdir).is_dir:
        return []
    t = now_ns()
    unfold(conn, pdir)
    taken = conn.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (pdir,)).fetchone() is not None
    if not taken:
        listed = conn.execute("SELECT n_pages FROM manifests WHERE digest=? LIMIT 1", (manifest,)).fetchone()
        whole = found_whole(conn, manifest, listed[0]) if listed is not None else None
        if whole is not None:
            n, nbytes = whole
        else:
            n, nbytes = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(b.raw_size), 0) FROM manifest_pages p"
                " JOIN blobs b ON b.digest = p.digest WHERE p.manifest = ? AND b.raw_size <= ?",
                (manifest, BLOCK_SIZE)).fetchone()
        if n == 0:
            return []
        if listed is not None and n == listed[0]:
            if whole is None:
                conn.execute("INSERT OR REPLACE INTO whole_lists (manifest, files, bytes) VALUES (?,?,?)",
                             (manifest, n, nbytes))
            conn.execute("INSERT INTO folds (dir, manifest, uid, gid, mode, t_ns, files, bytes)"
                         " VALUES (?,?,?,?,?,?,?,?)", (pdir, manifest, uid, gid, stat.S_IFREG | mode, t,
                                                       n, nbytes))
            touch_dir(conn, pdir, t)
            return [(pdir, n)]
    n = make_pages(conn, pdir, manifest, uid, gid, stat.S_IFREG | mode, t, taken)
    if not n:
        return []
    touch_dir(conn, pdir, t)
    return [(pdir, n)]
