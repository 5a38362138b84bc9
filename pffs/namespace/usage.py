"""What places of the tree hold on their own: ``pffs du``'s figures, read from the namespace.

The question is "what would ``rm -r`` of these places, then gc, give back?".
gc keeps a blob while it is referenced (:mod:`pffs.namespace.references`):
a file holds it, a page list lists it, or the prefix cache keeps it; a page list stays
while a recorded manifest, a fork's page files or a folded fork holds it
(:mod:`pffs.namespace.pagelists`).  So a blob the places hold is their own
(*exclusive*) when every holder of it goes with them: each file holding it
has all its names inside (a hard link outside keeps it), and each page list
listing it is held by nothing that stays.  The rest of what they hold is
*shared*.

Everything is read in one read transaction, with a few statements over
temporary tables whatever the number of files: no row passes through Python.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from pffs.namespace.references import referenced_sql
from pffs.namespace.schema import ROOT_INODE

S_IFMT, S_IFDIR, S_IFREG = 0o170000, 0o040000, 0o100000


@dataclass(frozen=True)
class Place:
    """A file or folder to measure: its inode and the entry that names it
    (*parent* None for the root, which no entry names)."""

    ino: int
    parent: int | None
    name: bytes | None


class PlaceMoved(LookupError):
    """The entry of *place* no longer names its inode (it changed since it was looked up)."""

    def __init__(self, place: Place):
        super().__init__(place)
        self.place = place


@dataclass
class Usage:
    """``pffs du``'s figures of some places (each blob and each file counted once)."""

    files: int                   # regular files, each inode once (a folded fork's page files too)
    logical_bytes: int           # their sizes summed
    blobs: int                   # distinct stored blobs they hold: their files' and their page lists'
    unique_bytes: int            # those blobs' bytes before compression
    stored_bytes: int            # those blobs' bytes on disk
    exclusive_blobs: int         # the blobs nothing outside holds: what rm -r and gc remove
    exclusive_bytes: int         # their bytes before compression
    exclusive_stored_bytes: int  # their bytes on disk: what rm -r and gc give back

    @property
    def shared_bytes(self) -> int:
        """Bytes (before compression) of the blobs something outside holds too."""
        return self.unique_bytes - self.exclusive_bytes

    def to_json(self) -> dict:
        return {"files": self.files, "logical_bytes": self.logical_bytes, "blobs": self.blobs,
                "unique_bytes": self.unique_bytes, "stored_bytes": self.stored_bytes,
                "shared_bytes": self.shared_bytes, "exclusive_blobs": self.exclusive_blobs,
                "exclusive_bytes": self.exclusive_bytes,
                "exclusive_stored_bytes": self.exclusive_stored_bytes}


# Temporary tables of one measure (the connection's own; dropped at its end): name, columns.
_TABLES = (
    # The places, as the entries an rm -r of them removes first.
    ("du_places", "ino INTEGER NOT NULL, parent INTEGER, name BLOB"),
    # Every inode inside the places (named in one of their folders), the places' own included.
    ("du_in", "ino INTEGER PRIMARY KEY, mode INTEGER NOT NULL, size INTEGER NOT NULL"),
    # Those whose every name is inside: the inodes rm -r deletes.
    ("du_gone", "ino INTEGER PRIMARY KEY"),
    # Page lists (manifest_pages.manifest) held by something inside ...
    ("du_lists", "manifest TEXT PRIMARY KEY"),
    # ... and those of them nothing outside holds: they go with the places.
    ("du_dead", "manifest TEXT PRIMARY KEY"),
    # Blobs held inside: by a file or by a page list.
    ("du_held", "digest TEXT PRIMARY KEY"),
)

_FILL = (
    # Folders are followed down; an inode reached twice (hard links) is one row.
    "INSERT OR IGNORE INTO du_in (ino, mode, size)"
    " WITH RECURSIVE inside(ino, mode, size) AS ("
    "  SELECT i.id, i.mode, i.size FROM du_places p JOIN inodes i ON i.id = p.ino"
    "  UNION"
    "  SELECT i.id, i.mode, i.size FROM inside JOIN dentries d ON d.parent = inside.ino"
    "   JOIN inodes i ON i.id = d.inode WHERE (inside.mode & :fmt) = :dir)"
    " SELECT ino, mode, size FROM inside",
    "INSERT INTO du_gone SELECT n.ino FROM du_in n WHERE NOT EXISTS ("
    " SELECT 1 FROM dentries d WHERE d.inode = n.ino"
    "  AND NOT EXISTS (SELECT 1 FROM du_in f WHERE f.ino = d.parent AND (f.mode & :fmt) = :dir)"
    "  AND NOT EXISTS (SELECT 1 FROM du_places p WHERE p.parent = d.parent AND p.name = d.name))",
    # A page list is held by a recorded manifest, a folded fork, or a fork's page files (pagesets).
    "INSERT OR IGNORE INTO du_lists SELECT m.digest FROM du_in n JOIN manifests m ON m.inode = n.ino",
    "INSERT OR IGNORE INTO du_lists SELECT f.manifest FROM du_in n JOIN folds f ON f.dir = n.ino",
    "INSERT OR IGNORE INTO du_lists SELECT ps.manifest FROM du_in n JOIN blocks b ON b.inode = n.ino"
    " JOIN pagesets ps ON ps.id = b.via",
    "INSERT INTO du_dead SELECT l.manifest FROM du_lists l"
    " WHERE NOT EXISTS (SELECT 1 FROM manifests m WHERE m.digest = l.manifest"
    "                   AND m.inode NOT IN (SELECT ino FROM du_gone))"
    " AND NOT EXISTS (SELECT 1 FROM folds f WHERE f.manifest = l.manifest"
    "                 AND f.dir NOT IN (SELECT ino FROM du_gone))"
    " AND NOT EXISTS (SELECT 1 FROM pagesets ps JOIN blocks b ON b.via = ps.id"
    "                 WHERE ps.manifest = l.manifest AND b.inode NOT IN (SELECT ino FROM du_gone))",
    "INSERT OR IGNORE INTO du_held SELECT b.blob FROM du_in n JOIN blocks b ON b.inode = n.ino",
    "INSERT OR IGNORE INTO du_held SELECT p.digest FROM du_lists l JOIN manifest_pages p"
    " ON p.manifest = l.manifest",
)

# A held blob is exclusive unless it stays referenced once the places are
# gone: their files and the page lists that go with them do not count.  (A
# fork's page file that stays keeps its pageset's list, which lists its blob.)
_EXCLUSIVE = " WHERE NOT " + referenced_sql("h.digest", files_gone="SELECT ino FROM du_gone",
                                            lists_gone="SELECT manifest FROM du_dead")
_SUMS = ("SELECT COUNT(*), COALESCE(SUM(b.raw_size), 0), COALESCE(SUM(b.stored_size), 0)"
         " FROM du_held h JOIN blobs b ON b.digest = h.digest")


def _check_place(conn: sqlite3.Connection, place: Place) -> None:
    if place.parent is None:
        found = place.ino if place.ino == ROOT_INODE else None
    else:
        row = conn.execute("SELECT inode FROM dentries WHERE parent=? AND name=?",
                           (place.parent, place.name)).fetchone()
        found = row[0] if row is not None else None
    if found != place.ino:
        raise PlaceMoved(place)


def usage_of(conn: sqlite3.Connection, places: Sequence[Place]) -> Usage:
    """The figures of *places* taken together (PlaceMoved if an entry no longer names its inode)."""
    conn.execute("BEGIN")
    try:
        for place in places:
            _check_place(conn, place)
        for table, columns in _TABLES:
            conn.execute(f"DROP TABLE IF EXISTS temp.{table}")
            conn.execute(f"CREATE TEMP TABLE {table} ({columns})")
        try:
            conn.executemany("INSERT INTO du_places (ino, parent, name) VALUES (?,?,?)",
                             [(p.ino, p.parent, p.name) for p in places])
            args = {"fmt": S_IFMT, "dir": S_IFDIR}
            for statement in _FILL:
                conn.execute(statement, args if ":fmt" in statement else {})
            files, logical = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM du_in"
                                          " WHERE (mode & ?) = ?", (S_IFMT, S_IFREG)).fetchone()
            folded, folded_bytes = conn.execute(
                "SELECT COALESCE(SUM(f.files), 0), COALESCE(SUM(f.bytes), 0)"
                " FROM du_in n JOIN folds f ON f.dir = n.ino").fetchone()
            blobs, unique, stored = conn.execute(_SUMS).fetchone()
            ex_blobs, ex_bytes, ex_stored = conn.execute(_SUMS + _EXCLUSIVE).fetchone()
        finally:
            for table, _ in _TABLES:
                conn.execute(f"DROP TABLE IF EXISTS temp.{table}")
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")
    return Usage(files + folded, logical + folded_bytes, blobs, unique, stored,
                 ex_blobs, ex_bytes, ex_stored)
