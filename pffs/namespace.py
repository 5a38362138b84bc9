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

SCHEMA_VERSION = 8
DB_NAME = "namespace.db"
ROOT_INODE = InodeNo(1)
# Files up to this size are one blob named by the file's sha256; larger ones
# are cut into blocks of this size, each its own blob.
BLOCK_SIZE = 64 << 20
# The largest file pffs keeps (ext4's with 4 KiB blocks); past it writes and truncates get EFBIG.
MAX_FILE_SIZE = 16 << 40
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
    id        INTEGER PRIMARY KEY AUTOINCREMENT,  -- inode number (FUSE ino); never reused
    mode      INTEGER NOT NULL,      -- st_mode: file type bits | permission bits
    uid       INTEGER NOT NULL,
    gid       INTEGER NOT NULL,
    size      INTEGER NOT NULL DEFAULT 0,  -- apparent size (files: bytes; symlinks: target length)
    atime_ns  INTEGER NOT NULL,
    mtime_ns  INTEGER NOT NULL,
    ctime_ns  INTEGER NOT NULL,
    nlink     INTEGER NOT NULL,      -- directory entries naming it (directories: 2 + subdirectories)
    rdev      INTEGER NOT NULL DEFAULT 0,  -- device number of block/char device nodes, else 0
    digest    TEXT,                  -- regular files of at most one block: 'sha256:<hex>' of the content
                                     -- (its blob's name); NULL otherwise (larger files: reckoned when asked)
    target    BLOB                   -- symlinks: the target bytes; NULL otherwise
);

-- Directory entries. The row id is the stable readdir cookie of the entry.
-- Names are raw bytes (never '.', '..', never containing '/' or NUL).
CREATE TABLE dentries (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,  -- readdir cookie; never reused
    parent  INTEGER NOT NULL REFERENCES inodes(id),  -- a directory inode
    name    BLOB NOT NULL,
    inode   INTEGER NOT NULL REFERENCES inodes(id),
    UNIQUE (parent, name)
);
CREATE INDEX dentries_inode ON dentries(inode);
-- A folder's entries in cookie order: readdir resumes at a cookie without a scan or a sort.
CREATE INDEX dentries_parent_id ON dentries(parent, id);

-- The bytes of regular files. Block n covers bytes [n*BLOCK_SIZE, (n+1)*BLOCK_SIZE)
-- of the file; every block of [0, size) has a row. A file of at most
-- BLOCK_SIZE bytes has exactly one row (none when empty) and its blob is the
-- file's own digest. Every blob named here has a row in blobs and is stored.
--
-- Page files made by a metadata-only fork keep the pageset of the manifest
-- that listed them in via; other rows have via NULL. Only via-NULL rows are
-- in the by-blob index: a fork's rows are held through their pageset (which
-- keeps that manifest's page list, gc roots, while it holds rows), so a fork
-- appends to every index instead of inserting at one random place per page.
-- Look blobs up by `blob=? AND via IS NULL` together with manifest_pages.
CREATE TABLE blocks (
    inode   INTEGER NOT NULL REFERENCES inodes(id),
    blockno INTEGER NOT NULL,
    blob    TEXT NOT NULL REFERENCES blobs(digest),
    via     INTEGER REFERENCES pagesets(id),
    PRIMARY KEY (inode, blockno)
) WITHOUT ROWID;
CREATE INDEX blocks_blob ON blocks(blob) WHERE via IS NULL;
CREATE INDEX blocks_via ON blocks(via) WHERE via IS NOT NULL;

-- The manifests whose pages a metadata-only fork created (one row per
-- manifest's bytes, shared by all its forks). While blocks rows name a
-- pageset, the manifest_pages rows of its manifest stay.
CREATE TABLE pagesets (
    id       INTEGER PRIMARY KEY,
    manifest TEXT NOT NULL UNIQUE    -- manifests.digest / manifest_pages.manifest
);

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

-- Inodes whose content was a valid manifest when it last took the name
-- manifest.json (or was committed under it). A directory holding such a
-- manifest.json is a session. digest is the inode's digest when recorded;
-- the row is dropped whenever the content changes.
CREATE TABLE manifests (
    inode   INTEGER PRIMARY KEY REFERENCES inodes(id),
    n_pages INTEGER NOT NULL,
    digest  TEXT NOT NULL
);
CREATE INDEX manifests_digest ON manifests(digest);

-- Page digests listed by the manifest.json files: gc roots, so a metadata-only
-- fork can bring back pages that no file holds any more. Rows belong to the
-- manifest's bytes, not to a file: every recorded manifest with those bytes
-- (a session and its forks) shares them, and they go with the last of those.
CREATE TABLE manifest_pages (
    manifest TEXT NOT NULL,     -- manifests.digest
    page_ix  INTEGER NOT NULL,
    digest   TEXT NOT NULL,
    PRIMARY KEY (manifest, page_ix)
) WITHOUT ROWID;
CREATE INDEX manifest_pages_digest ON manifest_pages(digest);

-- Folded forks: a pages/ folder that a metadata-only fork filled with every
-- page of a manifest whose pages were all stored, recorded as this one row.
-- Its page files' inodes, blocks and dentries rows are made (unfolded, see
-- unfold()) before anything looks into the folder: a lookup that misses, an
-- opendir, a change in it, pffs check. Until then the folder has no dentries
-- and the row holds its manifest's page list, so gc keeps every page's blob.
CREATE TABLE folds (
    dir      INTEGER PRIMARY KEY REFERENCES inodes(id),  -- the pages/ folder
    manifest TEXT NOT NULL,      -- manifest_pages.manifest: the page list its files are
    uid     INTEGER NOT NULL,    -- owner, group and mode bits of the page files
    gid     INTEGER NOT NULL,
    mode    INTEGER NOT NULL,    -- st_mode (S_IFREG | permission bits)
    t_ns    INTEGER NOT NULL,    -- their atime, mtime and ctime: when the fork was made
    files   INTEGER NOT NULL,    -- page files it holds (the pages of the manifest)
    bytes   INTEGER NOT NULL     -- their sizes summed
);
CREATE INDEX folds_manifest ON folds(manifest);

-- Page lists found whole: every page stored (a blob row of at most one block
-- each), so many files of so many bytes. A list's blobs are gc roots while
-- it is held, so this stays true until the list goes, and this row with it
-- (repair, which may drop blob rows, drops them all). It saves the next fork
-- of those bytes into an empty pages/ a look at each page's blob row.
CREATE TABLE whole_lists (
    manifest TEXT PRIMARY KEY,   -- manifest_pages.manifest
    files    INTEGER NOT NULL,
    bytes    INTEGER NOT NULL
) WITHOUT ROWID;
"""


class SchemaError(PffsError):
    pass


class DamagedDatabase(SchemaError):
    """The namespace database cannot be read at all (``pffs check --repair`` restores a snapshot)."""


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
            try:
                self.conn.execute("COMMIT")
            except sqlite3.Error:
                # A failed COMMIT (disk full, I/O error) may leave the
                # transaction open; never let the next one nest in it.
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
        elif self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        return False


def is_disk_full(e: BaseException) -> bool:
    """Whether a SQLite error means the disk (or quota) is full."""
    return isinstance(e, sqlite3.OperationalError) and (
        getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e))


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
    try:
        conn = connect(path, readonly=readonly)
    except sqlite3.DatabaseError as e:
        raise DamagedDatabase(f"{path}: not a readable namespace database ({e});"
                              " pffs check --repair restores the newest snapshot") from None
    try:
        if not exists:
            create(conn)
        v = schema_version(conn)
    except (sqlite3.DatabaseError, SchemaError) as e:
        conn.close()
        raise DamagedDatabase(f"{path}: not a readable namespace database ({e});"
                              " pffs check --repair restores the newest snapshot") from None
    if v > SCHEMA_VERSION:
        conn.close()
        raise SchemaError(f"{path}: schema version {v} is newer than this pffs ({SCHEMA_VERSION});"
                          " upgrade pffs")
    if v < SCHEMA_VERSION:
        if readonly:
            conn.close()
            raise SchemaError(f"{path}: schema version {v} is older than this pffs ({SCHEMA_VERSION});"
                              " mount the store once to upgrade it")
        migrate(conn, v)
    return conn


INODE_COLUMNS = ("id INTEGER PRIMARY KEY AUTOINCREMENT, mode INTEGER NOT NULL, uid INTEGER NOT NULL,"
                 " gid INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0, atime_ns INTEGER NOT NULL,"
                 " mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, nlink INTEGER NOT NULL,"
                 " rdev INTEGER NOT NULL DEFAULT 0, digest TEXT, target BLOB")
DENTRY_COLUMNS = ("id INTEGER PRIMARY KEY AUTOINCREMENT, parent INTEGER NOT NULL REFERENCES inodes(id),"
                  " name BLOB NOT NULL, inode INTEGER NOT NULL REFERENCES inodes(id), UNIQUE (parent, name)")


def _rebuilt(table: str, columns: str) -> str:
    return f"CREATE TABLE {table}_8 ({columns})"


def _copy(table: str) -> str:
    return f"INSERT INTO {table}_8 SELECT * FROM {table}"


# Forward migrations: MIGRATIONS[v] turns schema v into v+1.
MIGRATIONS: dict[int, list[str]] = {
    # 1 -> 2: no index of names across directories.  Every page file created
    # put its name ("000123", shared by every session) at a scattered place
    # in it, and a fork's commit rewrote most of its pages; sessions are
    # counted from `manifests` instead.
    1: ["DROP INDEX IF EXISTS dentries_name"],
    # 2 -> 3: page lists belong to a manifest's bytes, shared by a session
    # and its forks, not copied into rows of each manifest file.
    2: ["CREATE TABLE manifests_3 (inode INTEGER PRIMARY KEY REFERENCES inodes(id),"
        " n_pages INTEGER NOT NULL, digest TEXT NOT NULL)",
        "INSERT INTO manifests_3 SELECT m.inode, m.n_pages, i.digest FROM manifests m"
        " JOIN inodes i ON i.id = m.inode WHERE i.digest IS NOT NULL",
        "CREATE TABLE manifest_pages_3 (manifest TEXT NOT NULL, page_ix INTEGER NOT NULL,"
        " digest TEXT NOT NULL, PRIMARY KEY (manifest, page_ix)) WITHOUT ROWID",
        "INSERT OR IGNORE INTO manifest_pages_3 SELECT m.digest, p.page_ix, p.digest"
        " FROM manifest_pages p JOIN manifests_3 m ON m.inode = p.inode",
        "DROP TABLE manifest_pages",
        "DROP TABLE manifests",
        "ALTER TABLE manifests_3 RENAME TO manifests",
        "ALTER TABLE manifest_pages_3 RENAME TO manifest_pages",
        "CREATE INDEX manifests_digest ON manifests(digest)",
        "CREATE INDEX manifest_pages_digest ON manifest_pages(digest)"],
    # 3 -> 4: a fork's page rows hold their blobs through the manifest that
    # listed them (pagesets), out of the by-blob index.
    3: ["ALTER TABLE blocks ADD COLUMN via INTEGER REFERENCES pagesets(id)",
        "DROP INDEX blocks_blob",
        "CREATE INDEX blocks_blob ON blocks(blob) WHERE via IS NULL",
        "CREATE INDEX blocks_via ON blocks(via) WHERE via IS NOT NULL",
        "CREATE TABLE pagesets (id INTEGER PRIMARY KEY, manifest TEXT NOT NULL UNIQUE)"],
    # 4 -> 5: a fork into an empty pages/ folder is one row until it is looked into.
    4: ["CREATE TABLE folds (dir INTEGER PRIMARY KEY REFERENCES inodes(id),"
        " manifest TEXT NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,"
        " mode INTEGER NOT NULL, t_ns INTEGER NOT NULL, files INTEGER NOT NULL,"
        " bytes INTEGER NOT NULL)",
        "CREATE INDEX folds_manifest ON folds(manifest)"],
    # 5 -> 6: page lists found whole are remembered.
    5: ["CREATE TABLE whole_lists (manifest TEXT PRIMARY KEY, files INTEGER NOT NULL,"
        " bytes INTEGER NOT NULL) WITHOUT ROWID"],
    # 6 -> 7: a folder's entries indexed in cookie order.  Every readdir call
    # of a large folder scanned and sorted all of it (60 ms at 100,000
    # entries), and a listing takes one call per few dozen entries.
    6: ["CREATE INDEX IF NOT EXISTS dentries_parent_id ON dentries(parent, id)"],
    # 7 -> 8: inode numbers and readdir cookies are never reused (AUTOINCREMENT).
    # The largest id of a table was given again once its row went, so a
    # process holding the old number (an NFS handle, a cookie of an open
    # listing) could name another file.
    7: [_rebuilt("inodes", INODE_COLUMNS), _copy("inodes"), "DROP TABLE inodes",
        "ALTER TABLE inodes_8 RENAME TO inodes",
        _rebuilt("dentries", DENTRY_COLUMNS), _copy("dentries"), "DROP TABLE dentries",
        "ALTER TABLE dentries_8 RENAME TO dentries",
        "CREATE INDEX dentries_inode ON dentries(inode)",
        "CREATE INDEX dentries_parent_id ON dentries(parent, id)"],
}


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
        "SELECT COUNT(*) FROM manifests m CROSS JOIN dentries d ON d.inode = m.inode"
        " WHERE d.name = ?", (b"manifest.json",)).fetchone()[0]
    files, logical = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(i.size), 0) FROM dentries d JOIN inodes i ON i.id = d.inode"
        " WHERE (i.mode & 61440) = 32768").fetchone()
    folded, folded_bytes = conn.execute(
        "SELECT COALESCE(SUM(files), 0), COALESCE(SUM(bytes), 0) FROM folds").fetchone()
    files += folded
    logical += folded_bytes
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


# -- rows and changes ------------------------------------------------------
# Every function below runs inside the caller's transaction. The mounted
# filesystem calls them in its single writer thread; offline tools call them
# directly. Checks and changes happen in the same transaction, so a check
# can never be overtaken by a concurrent change.

import errno as _errno  # noqa: E402

S_IFMT = 0o170000
INODE_COLS = "id, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink, rdev, digest, target"
#: A folder's entries after a readdir cookie, in cookie order: (cookie, name, *INODE_COLS).
READDIR_SQL = (f"SELECT d.id, d.name, {', '.join('i.' + c.strip() for c in INODE_COLS.split(','))}"
               " FROM dentries d JOIN inodes i ON i.id = d.inode WHERE d.parent=? AND d.id > ?"
               " ORDER BY d.id")
NAME_MAX = 255


class FsError(PffsError):
    """A failed namespace operation with the errno the caller should answer."""

    def __init__(self, err: int, msg: str = ""):
        super().__init__(msg or os.strerror(err))
        self.errno = err


@dataclass
class Inode:
    id: int
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    nlink: int
    rdev: int
    digest: str | None
    target: bytes | None

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


def get_inode(conn: sqlite3.Connection, ino: int) -> Inode:
    row = conn.execute(f"SELECT {INODE_COLS} FROM inodes WHERE id=?", (ino,)).fetchone()
    if row is None:
        raise FsError(_errno.ENOENT, f"no inode {ino}")
    return Inode(*row)


def lookup(conn: sqlite3.Connection, parent: int, name: bytes) -> int | None:
    row = conn.execute("SELECT inode FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone()
    return row[0] if row else None


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(_errno.ENAMETOOLONG, f"name of {len(name)} bytes")
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise FsError(_errno.EINVAL, f"invalid name {name!r}")


def _dir(conn: sqlite3.Connection, ino: int) -> Inode:
    """The directory a change is made in (unfolded first: see unfold)."""
    node = get_inode(conn, ino)
    if not node.is_dir:
        raise FsError(_errno.ENOTDIR)
    if node.nlink == 0:
        raise FsError(_errno.ENOENT, "directory was removed")
    unfold(conn, ino)
    return node


def _is_empty(conn: sqlite3.Connection, ino: int) -> bool:
    """Whether directory *ino* has no entries (a folded fork's folder has its pages)."""
    return (conn.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (ino,)).fetchone() is None
            and conn.execute("SELECT 1 FROM folds WHERE dir=? AND files > 0", (ino,)).fetchone() is None)


def touch_dir(conn: sqlite3.Connection, ino: int, t: int, nlink_delta: int = 0) -> None:
    conn.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=?, nlink=nlink+? WHERE id=?",
                 (t, t, nlink_delta, ino))


def make_inode(conn: sqlite3.Connection, parent: int, name: bytes, mode: int, uid: int, gid: int,
               rdev: int = 0, target: bytes | None = None, t: int | None = None) -> Inode:
    """Create a new inode named *name* in *parent* (EEXIST if taken)."""
    check_name(name)
    pnode = _dir(conn, parent)
    if lookup(conn, parent, name) is not None:
        raise FsError(_errno.EEXIST)
    t = now_ns() if t is None else t
    is_dir = stat.S_ISDIR(mode)
    if pnode.mode & stat.S_ISGID:
        # BSD group semantics for setgid directories, as ext4 does.
        gid = pnode.gid
        if is_dir:
            mode |= stat.S_ISGID
    size = len(target) if target is not None else 0
    digest = EMPTY_DIGEST if stat.S_ISREG(mode) else None
    cur = conn.execute(
        "INSERT INTO inodes (mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink, rdev, digest, target)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (mode, uid, gid, size, t, t, t, 2 if is_dir else 1, rdev, digest, target))
    ino = cur.lastrowid
    conn.execute("INSERT INTO dentries (parent, name, inode) VALUES (?,?,?)", (parent, name, ino))
    touch_dir(conn, parent, t, 1 if is_dir else 0)
    return Inode(ino, mode, uid, gid, size, t, t, t, 2 if is_dir else 1, rdev, digest, target)


def delete_inode(conn: sqlite3.Connection, ino: int) -> None:
    """Drop an inode and everything it holds (its blobs stay until gc)."""
    drop_blocks(conn, ino)
    conn.execute("DELETE FROM xattrs WHERE inode=?", (ino,))
    forget_manifest(conn, ino)
    _drop_fold(conn, ino)
    conn.execute("DELETE FROM inodes WHERE id=?", (ino,))


def drop_link(conn: sqlite3.Connection, ino: int, t: int, in_use: bool) -> bool:
    """One name of *ino* is gone; True if the inode itself was deleted."""
    node = get_inode(conn, ino)
    nlink = 0 if node.is_dir else node.nlink - 1
    if nlink == 0 and not in_use:
        delete_inode(conn, ino)
        return True
    conn.execute("UPDATE inodes SET nlink=?, ctime_ns=? WHERE id=?", (nlink, t, ino))
    return False


def unlink(conn: sqlite3.Connection, parent: int, name: bytes, in_use) -> tuple[int, bool]:
    """Remove a non-directory entry. *in_use(ino)* says whether the kernel still holds it."""
    _dir(conn, parent)
    ino = lookup(conn, parent, name)
    if ino is None:
        raise FsError(_errno.ENOENT)
    if get_inode(conn, ino).is_dir:
        raise FsError(_errno.EISDIR)
    t = now_ns()
    conn.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
    touch_dir(conn, parent, t)
    return ino, drop_link(conn, ino, t, in_use(ino))


def rmdir(conn: sqlite3.Connection, parent: int, name: bytes, in_use) -> tuple[int, bool]:
    _dir(conn, parent)
    ino = lookup(conn, parent, name)
    if ino is None:
        raise FsError(_errno.ENOENT)
    if not get_inode(conn, ino).is_dir:
        raise FsError(_errno.ENOTDIR)
    if not _is_empty(conn, ino):
        raise FsError(_errno.ENOTEMPTY)
    t = now_ns()
    conn.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
    touch_dir(conn, parent, t, -1)
    return ino, drop_link(conn, ino, t, in_use(ino))


def _is_ancestor(conn: sqlite3.Connection, anc: int, ino: int) -> bool:
    seen = 0
    while ino != ROOT_INODE and seen < 100000:
        if ino == anc:
            return True
        row = conn.execute("SELECT parent FROM dentries WHERE inode=? LIMIT 1", (ino,)).fetchone()
        if row is None:
            return False
        ino = row[0]
        seen += 1
    return ino == anc


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4


def rename(conn: sqlite3.Connection, old_parent: int, old_name: bytes, new_parent: int,
           new_name: bytes, flags: int, in_use) -> tuple[int, int | None, bool]:
    """Move an entry, replacing a compatible target. Returns (ino, replaced ino, replaced deleted)."""
    check_name(new_name)
    _dir(conn, old_parent)
    _dir(conn, new_parent)
    ino = lookup(conn, old_parent, old_name)
    if ino is None:
        raise FsError(_errno.ENOENT)
    node = get_inode(conn, ino)
    target = lookup(conn, new_parent, new_name)
    if flags & RENAME_EXCHANGE:
        raise FsError(_errno.EINVAL, "RENAME_EXCHANGE is not supported")
    if flags & RENAME_WHITEOUT:
        # No whiteouts here (nothing is an overlay's upper layer): refused as
        # other filesystems without them refuse it, never taken as a plain rename.
        raise FsError(_errno.EINVAL, "RENAME_WHITEOUT is not supported")
    if target == ino:
        return ino, None, False
    if node.is_dir and new_parent != old_parent and _is_ancestor(conn, ino, new_parent):
        raise FsError(_errno.EINVAL, "cannot move a directory into itself")
    t = now_ns()
    replaced_deleted = False
    if target is not None:
        if flags & RENAME_NOREPLACE:
            raise FsError(_errno.EEXIST)
        tnode = get_inode(conn, target)
        if tnode.is_dir:
            if not node.is_dir:
                raise FsError(_errno.EISDIR)
            if not _is_empty(conn, target):
                raise FsError(_errno.ENOTEMPTY)
            touch_dir(conn, new_parent, t, -1)
        elif node.is_dir:
            raise FsError(_errno.ENOTDIR)
        conn.execute("DELETE FROM dentries WHERE parent=? AND name=?", (new_parent, new_name))
        replaced_deleted = drop_link(conn, target, t, in_use(target))
    conn.execute("UPDATE dentries SET parent=?, name=? WHERE parent=? AND name=?",
                 (new_parent, new_name, old_parent, old_name))
    if node.is_dir and new_parent != old_parent:
        touch_dir(conn, old_parent, t, -1)
        touch_dir(conn, new_parent, t, 1)
    else:
        touch_dir(conn, old_parent, t)
        touch_dir(conn, new_parent, t)
    conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, ino))
    return ino, target, replaced_deleted


def link(conn: sqlite3.Connection, ino: int, new_parent: int, new_name: bytes) -> Inode:
    check_name(new_name)
    _dir(conn, new_parent)
    node = get_inode(conn, ino)
    if node.is_dir:
        raise FsError(_errno.EPERM, "hard links to directories are not allowed")
    if node.nlink == 0:
        raise FsError(_errno.ENOENT, "file was removed")
    if lookup(conn, new_parent, new_name) is not None:
        raise FsError(_errno.EEXIST)
    t = now_ns()
    conn.execute("INSERT INTO dentries (parent, name, inode) VALUES (?,?,?)", (new_parent, new_name, ino))
    conn.execute("UPDATE inodes SET nlink=nlink+1, ctime_ns=? WHERE id=?", (t, ino))
    touch_dir(conn, new_parent, t)
    return get_inode(conn, ino)


_SETTABLE = ("mode", "uid", "gid", "atime_ns", "mtime_ns", "ctime_ns")


def set_attrs(conn: sqlite3.Connection, ino: int, **fields) -> Inode:
    """Update plain attributes (not size: content changes go through set_content)."""
    cols = [k for k in fields if k in _SETTABLE]
    if cols:
        conn.execute(f"UPDATE inodes SET {', '.join(c + '=?' for c in cols)} WHERE id=?",
                     [fields[c] for c in cols] + [ino])
    return get_inode(conn, ino)


@dataclass
class BlobRow:
    digest: str
    raw_size: int
    stored_size: int
    codec: str


def set_content(conn: sqlite3.Connection, ino: int, size: int, digest: str,
                blocks: list[str], new_blobs: list[BlobRow], mtime_ns: int | None,
                ctime_ns: int | None = None, *, was_empty: bool = False) -> None:
    """Point a file at new content: its blocks' blobs (already stored and synced).

    *was_empty*: the caller knows the file had no content (no blocks, so no
    manifest either), as after a create; two statements are then saved.
    """
    t = now_ns()
    for b in new_blobs:
        conn.execute("INSERT OR IGNORE INTO blobs (digest, raw_size, stored_size, codec, created_ns)"
                     " VALUES (?,?,?,?,?)", (b.digest, b.raw_size, b.stored_size, b.codec, t))
    if not was_empty:
        drop_blocks(conn, ino)
    conn.executemany("INSERT INTO blocks (inode, blockno, blob) VALUES (?,?,?)",
                     [(ino, i, d) for i, d in enumerate(blocks)])
    conn.execute("UPDATE inodes SET size=?, digest=?, mtime_ns=COALESCE(?, mtime_ns), ctime_ns=? WHERE id=?",
                 (size, digest, mtime_ns, ctime_ns or t, ino))
    if not was_empty:
        # The content changed: whatever it listed as a manifest no longer holds.
        forget_manifest(conn, ino)


def insert_blob_rows(conn: sqlite3.Connection, rows: list[BlobRow]) -> None:
    """Rows of blobs already stored (and synced) that the namespace did not know."""
    t = now_ns()
    conn.executemany("INSERT OR IGNORE INTO blobs (digest, raw_size, stored_size, codec, created_ns)"
                     " VALUES (?,?,?,?,?)", [(r.digest, r.raw_size, r.stored_size, r.codec, t) for r in rows])


def drop_blocks(conn: sqlite3.Connection, ino: int) -> None:
    """Delete the blocks rows of *ino*; a pageset left without rows lets its pages go."""
    vias = [v for (v,) in conn.execute("SELECT DISTINCT via FROM blocks WHERE inode=? AND via IS NOT NULL",
                                       (ino,))]
    conn.execute("DELETE FROM blocks WHERE inode=?", (ino,))
    for via in vias:
        row = conn.execute("SELECT manifest FROM pagesets WHERE id=?", (via,)).fetchone()
        if row is not None:
            _drop_unheld_pages(conn, row[0])


def files_holding(conn: sqlite3.Connection, digest: str) -> list[int]:
    """The inodes whose blocks name blob *digest* (by index: a fork's pages through their pageset)."""
    return [ino for (ino,) in conn.execute(
        "SELECT inode FROM blocks WHERE blob=:d AND via IS NULL UNION"
        " SELECT b.inode FROM manifest_pages p JOIN pagesets ps ON ps.manifest = p.manifest"
        " JOIN blocks b ON b.via = ps.id AND b.blob = p.digest WHERE p.digest = :d", dict(d=digest))]


def blocks_of(conn: sqlite3.Connection, ino: int) -> list[str]:
    return [d for (d,) in conn.execute("SELECT blob FROM blocks WHERE inode=? ORDER BY blockno", (ino,))]


def known_blobs(conn: sqlite3.Connection, digests: Iterable[str]) -> dict[str, int]:
    """raw_size of each of *digests* that the store holds."""
    out = {}
    uniq = list(set(digests))
    for k in range(0, len(uniq), 500):
        chunk = uniq[k:k + 500]
        out.update(conn.execute(f"SELECT digest, raw_size FROM blobs WHERE digest IN"
                                f" ({','.join('?' * len(chunk))})", chunk))
    return out


def record_manifest(conn: sqlite3.Connection, ino: int, pages: list[str], digest: str) -> None:
    """Remember that *ino*, whose bytes have *digest*, holds a valid manifest listing *pages*.

    The pages (gc roots) are rows of the manifest's bytes: a fork's manifest,
    byte for byte its source's, adds one ``manifests`` row and no page rows.
    """
    _record(conn, ino, len(pages), digest)
    have = conn.execute("SELECT COUNT(*) FROM manifest_pages WHERE manifest=?", (digest,)).fetchone()[0]
    if have == len(pages):
        return
    conn.execute("DELETE FROM manifest_pages WHERE manifest=?", (digest,))
    conn.execute("DELETE FROM whole_lists WHERE manifest=?", (digest,))
    conn.executemany("INSERT INTO manifest_pages (manifest, page_ix, digest) VALUES (?,?,?)",
                     [(digest, i, d) for i, d in enumerate(pages)])


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
        _drop_unheld_pages(conn, old[0])


def forget_manifest(conn: sqlite3.Connection, ino: int) -> None:
    """*ino* holds no recorded manifest any more; its page rows go with the last holder of its bytes."""
    row = conn.execute("SELECT digest FROM manifests WHERE inode=?", (ino,)).fetchone()
    if row is None:
        return
    conn.execute("DELETE FROM manifests WHERE inode=?", (ino,))
    _drop_unheld_pages(conn, row[0])


def _drop_unheld_pages(conn: sqlite3.Connection, digest: str) -> None:
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
    if _found_whole(conn, digest, found[0]) is not None:
        return found[0]  # (found whole: one row a page, and the list goes only at once)
    have = conn.execute("SELECT COUNT(*) FROM manifest_pages WHERE manifest=?", (digest,)).fetchone()[0]
    return found[0] if have == found[0] else None


def _found_whole(conn: sqlite3.Connection, digest: str, n_pages: int) -> tuple[int, int] | None:
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


def names_of(conn: sqlite3.Connection, ino: int) -> list[tuple[int, bytes]]:
    return list(conn.execute("SELECT parent, name FROM dentries WHERE inode=?", (ino,)))


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
    from .manifest import PAGES_DIR
    pdir = lookup(conn, session_dir, PAGES_DIR.encode())
    if pdir is None or not get_inode(conn, pdir).is_dir:
        return []
    t = now_ns()
    unfold(conn, pdir)
    taken = conn.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (pdir,)).fetchone() is not None
    if not taken:
        listed = conn.execute("SELECT n_pages FROM manifests WHERE digest=? LIMIT 1", (manifest,)).fetchone()
        whole = _found_whole(conn, manifest, listed[0]) if listed is not None else None
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
    n = _make_pages(conn, pdir, manifest, uid, gid, stat.S_IFREG | mode, t, taken)
    if not n:
        return []
    touch_dir(conn, pdir, t)
    return [(pdir, n)]


def _pageset(conn: sqlite3.Connection, manifest: str) -> int:
    conn.execute("INSERT OR IGNORE INTO pagesets (manifest) VALUES (?)", (manifest,))
    return conn.execute("SELECT id FROM pagesets WHERE manifest=?", (manifest,)).fetchone()[0]


def _make_pages(conn: sqlite3.Connection, pdir: int, manifest: str, uid: int, gid: int, mode: int,
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
    n = _make_pages(conn, pdir, manifest, uid, gid, mode, t, False)
    if not n:
        _drop_unheld_pages(conn, manifest)
    return n


def _drop_fold(conn: sqlite3.Connection, pdir: int) -> None:
    row = conn.execute("SELECT manifest FROM folds WHERE dir=?", (pdir,)).fetchone()
    if row is not None:
        conn.execute("DELETE FROM folds WHERE dir=?", (pdir,))
        _drop_unheld_pages(conn, row[0])


def cleanup_orphans(conn: sqlite3.Connection) -> int:
    """Delete inodes left unlinked-but-open by a previous run (nothing holds them now)."""
    rows = [r[0] for r in conn.execute("SELECT id FROM inodes WHERE nlink=0 AND id != ?", (ROOT_INODE,))]
    for ino in rows:
        delete_inode(conn, ino)
    return len(rows)


def path_of(conn: sqlite3.Connection, ino: int) -> str:
    """A path of *ino* inside the mount, for log lines ('/a/b'; '<inode N>' if unnamed)."""
    parts = []
    seen = set()
    while ino != ROOT_INODE:
        if ino in seen or len(parts) > 4096:
            break
        seen.add(ino)
        row = conn.execute("SELECT parent, name FROM dentries WHERE inode=? LIMIT 1", (ino,)).fetchone()
        if row is None:
            return f"<inode {ino}>" + ("/" + "/".join(reversed(parts)) if parts else "")
        parts.append(row[1].decode(errors="replace"))
        ino = row[0]
    return "/" + "/".join(reversed(parts))
