"""The namespace: inodes, names, modes, times, xattrs, and which blobs hold each file.

It lives in one SQLite database beside the blobs (``<store>/namespace.db``)
and is the only index of the store, so it is treated as precious: WAL mode,
a recorded schema version, snapshots, and a repair path (see fsck).

Threading: a mounted filesystem reads through one connection on the trio
thread and makes every change through a second connection owned by a single
writer thread (see :class:`pffs.fs.db.Database`).  The functions here are
plain synchronous code on a given connection, so offline tools (check, gc,
stats, the bridge's store sink) share them.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import PffsError
from .types import Digest, InodeNo

SCHEMA_VERSION = 1
DB_NAME = "namespace.db"
ROOT_INODE = InodeNo(1)
# Files up to this size are one blob named by the file's sha256; larger ones
# are cut into blocks of this size, each its own blob.
BLOCK_SIZE = 64 << 20
EMPTY_DIGEST = Digest("sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")

SCHEMA = """
-- Schema version and store-wide settings.
--   key 'schema_version': integer SCHEMA_VERSION of the tables below.
--   key 'created_ns': when the store was created.
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- One row per inode. Inode 1 is the root directory and always exists.
-- An inode whose nlink is 0 is unlinked but still open or looked up by the
-- kernel; it is deleted at the last forget/release (or at the next mount).
CREATE TABLE inodes (
    id        INTEGER PRIMARY KEY,   -- inode number (FUSE ino)
    mode      INTEGER NOT NULL,      -- st_mode: file type bits | permission bits
    uid       INTEGER NOT NULL,
    gid       INTEGER NOT NULL,
    size      INTEGER NOT NULL DEFAULT 0,  -- apparent size (files: bytes; symlinks: target length)
    atime_ns  INTEGER NOT NULL,
    mtime_ns  INTEGER NOT NULL,
    ctime_ns  INTEGER NOT NULL,
    nlink     INTEGER NOT NULL,      -- directory entries naming it (directories: 2 + subdirectories)
    rdev      INTEGER NOT NULL DEFAULT 0,  -- device number of block/char device nodes, else 0
    digest    TEXT,                  -- regular files: 'sha256:<hex>' of the whole content; NULL otherwise
    target    BLOB                   -- symlinks: the target bytes; NULL otherwise
);

-- Directory entries. The row id is the stable readdir cookie of the entry.
-- Names are raw bytes (never '.', '..', never containing '/' or NUL).
CREATE TABLE dentries (
    id      INTEGER PRIMARY KEY,
    parent  INTEGER NOT NULL REFERENCES inodes(id),  -- a directory inode
    name    BLOB NOT NULL,
    inode   INTEGER NOT NULL REFERENCES inodes(id),
    UNIQUE (parent, name)
);
CREATE INDEX dentries_inode ON dentries(inode);
CREATE INDEX dentries_name ON dentries(name);

-- The bytes of regular files. Block n covers bytes [n*BLOCK_SIZE, (n+1)*BLOCK_SIZE)
-- of the file; every block of [0, size) has a row. A file of at most
-- BLOCK_SIZE bytes has exactly one row (none when empty) and its blob is the
-- file's own digest. Every blob named here has a row in blobs and is stored.
CREATE TABLE blocks (
    inode   INTEGER NOT NULL REFERENCES inodes(id),
    blockno INTEGER NOT NULL,
    blob    TEXT NOT NULL REFERENCES blobs(digest),
    PRIMARY KEY (inode, blockno)
) WITHOUT ROWID;
CREATE INDEX blocks_blob ON blocks(blob);

-- Every blob in the store: inserted after the blob file is written and
-- fsynced, in the same transaction as the first blocks row naming it.
-- A blob no file holds and no manifest lists is garbage until gc removes it.
CREATE TABLE blobs (
    digest      TEXT PRIMARY KEY,    -- 'sha256:<hex>' of the raw bytes
    raw_size    INTEGER NOT NULL,    -- bytes before compression
    stored_size INTEGER NOT NULL,    -- bytes of the frame on disk (header included)
    codec       TEXT NOT NULL,       -- codec of the frame when written ('' if unknown)
    created_ns  INTEGER NOT NULL
) WITHOUT ROWID;

-- User extended attributes (names include their namespace prefix, e.g. b'user.x').
CREATE TABLE xattrs (
    inode INTEGER NOT NULL REFERENCES inodes(id),
    name  BLOB NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (inode, name)
) WITHOUT ROWID;

-- Page digests listed by the manifest.json files: gc roots, so a metadata-only
-- fork can bring back pages that no file holds any more. Rows belong to the
-- manifest file's inode and are replaced whenever its content changes;
-- manifest_ok marks inodes whose content was a valid manifest when it last
-- took the name manifest.json.
CREATE TABLE manifest_pages (
    inode   INTEGER NOT NULL REFERENCES inodes(id),
    page_ix INTEGER NOT NULL,
    digest  TEXT NOT NULL,
    PRIMARY KEY (inode, page_ix)
) WITHOUT ROWID;
CREATE INDEX manifest_pages_digest ON manifest_pages(digest);
"""


class SchemaError(PffsError):
    pass


def now_ns() -> int:
    return time.time_ns()


def connect(path: str | os.PathLike, *, readonly: bool = False) -> sqlite3.Connection:
    """Open the database with the settings every connection must share."""
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                               check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 10000")
    if not readonly:
        conn.execute("PRAGMA journal_mode = WAL")
    # NORMAL in WAL mode: a commit survives a crash of the process (kill -9)
    # at once, and power loss after the next WAL fsync (user fsync(), the
    # periodic checkpoint, unmount).  Blobs are always fsynced before the
    # commit that names them, so a durable row never names a lost blob.
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = OFF")
    conn.execute("PRAGMA cache_size = -65536")
    return conn


def create(conn: sqlite3.Connection, uid: int | None = None, gid: int | None = None) -> None:
    """Create the tables and the root directory in an empty database."""
    t = now_ns()
    with transaction(conn):
        for statement in _statements(SCHEMA):
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("INSERT INTO meta VALUES ('created_ns', ?)", (str(t),))
        conn.execute(
            "INSERT INTO inodes (id, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink)"
            " VALUES (?, ?, ?, ?, 0, ?, ?, ?, 2)",
            (ROOT_INODE, stat.S_IFDIR | 0o755, os.getuid() if uid is None else uid,
             os.getgid() if gid is None else gid, t, t, t))


def _statements(script: str) -> list[str]:
    out, cur = [], []
    for line in script.splitlines():
        if line.strip().startswith("--") or not line.strip():
            continue
        cur.append(line)
        if line.rstrip().endswith(";"):
            out.append("\n".join(cur))
            cur = []
    return out


class transaction:
    """``with transaction(conn):`` — BEGIN IMMEDIATE … COMMIT, ROLLBACK on error."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")
        return False


def schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None:
        raise SchemaError("namespace has no schema version")
    return int(row[0])


def open_db(store_root: str | os.PathLike, *, create_missing: bool = True,
            readonly: bool = False) -> sqlite3.Connection:
    """Open (creating if asked) the namespace of a store; refuse other schema versions."""
    path = Path(store_root) / DB_NAME
    exists = path.exists()
    if not exists and not create_missing:
        raise SchemaError(f"{path}: no namespace database (not a pffs store?)")
    if not exists and readonly:
        raise SchemaError(f"{path}: no namespace database")
    conn = connect(path, readonly=readonly)
    if not exists:
        create(conn)
    try:
        v = schema_version(conn)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise SchemaError(f"{path}: not a readable namespace database ({e})") from None
    if v > SCHEMA_VERSION:
        conn.close()
        raise SchemaError(f"{path}: schema version {v} is newer than this pffs ({SCHEMA_VERSION});"
                          " upgrade pffs")
    if v < SCHEMA_VERSION:
        migrate(conn, v)
    return conn


# Forward migrations: MIGRATIONS[v] turns schema v into v+1.
MIGRATIONS: dict[int, list[str]] = {}


def migrate(conn: sqlite3.Connection, version: int) -> None:
    with transaction(conn):
        while version < SCHEMA_VERSION:
            for s in MIGRATIONS[version]:
                conn.execute(s)
            version += 1
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))


# -- figures ---------------------------------------------------------------

@dataclass
class Stats:
    sessions: int
    files: int
    logical_bytes: int
    unique_blobs: int
    unique_bytes: int
    stored_bytes: int

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_json(self) -> dict:
        return {"sessions": self.sessions, "files": self.files,
                "logical_bytes": self.logical_bytes, "unique_blobs": self.unique_blobs,
                "unique_bytes": self.unique_bytes, "stored_bytes": self.stored_bytes,
                "dedup_ratio": round(self.dedup_ratio, 4),
                "compression_ratio": round(self.compression_ratio, 4)}


def stats(conn: sqlite3.Connection) -> Stats:
    """SPEC §4 figures. Files count links (a hard-linked file counts once per name)."""
    sessions = conn.execute(
        "SELECT COUNT(*) FROM dentries d JOIN inodes i ON i.id = d.inode"
        " WHERE d.name = ? AND (i.mode & 61440) = 32768", (b"manifest.json",)).fetchone()[0]
    files, logical = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(i.size), 0) FROM dentries d JOIN inodes i ON i.id = d.inode"
        " WHERE (i.mode & 61440) = 32768").fetchone()
    blobs, unique, stored = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(raw_size), 0), COALESCE(SUM(stored_size), 0) FROM blobs"
    ).fetchone()
    return Stats(sessions, files, logical, blobs, unique, stored)


def iter_referenced_blobs(conn: sqlite3.Connection) -> Iterable[Digest]:
    """gc roots: every blob a file holds and every digest a manifest lists."""
    for (d,) in conn.execute("SELECT blob FROM blocks UNION SELECT digest FROM manifest_pages"):
        yield Digest(d)


def read_file(conn: sqlite3.Connection, blobs, ino: int, max_size: int | None = None) -> bytes:
    """The whole committed content of a regular file (verified blob reads)."""
    size = conn.execute("SELECT size FROM inodes WHERE id=?", (ino,)).fetchone()[0]
    if max_size is not None and size > max_size:
        raise ValueError(f"file of {size} bytes exceeds {max_size}")
    parts = [blobs.get(Digest(d)) for (d,) in
             conn.execute("SELECT blob FROM blocks WHERE inode=? ORDER BY blockno", (ino,))]
    return b"".join(parts)
