"""The namespace database itself: its tables, store-wide constants, opening and migrating it.

SCHEMA is the only description of the tables (every column commented);
connect/open_db give connections with the settings all of them share,
transaction wraps BEGIN IMMEDIATE ... COMMIT, and MIGRATIONS/migrate bring
an older store up to SCHEMA_VERSION.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from pathlib import Path

from pffs.errors import PffsError
from pffs.types import Digest, InodeNo

SCHEMA_VERSION = 9
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
--   key 'prefix_index': present (value '1') when every recorded manifest's page
--     list carries its token chain keys (manifest_pages.space/key); absent after
--     the migration from schema 8 until the next mount or check --repair keys them.
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
--
-- They are also the prefix index (SPEC §7, pffs.namespace.prefix_index): a
-- full page of a logical sequence with token_ids carries its token chain key
-- (pffs.client.chainkeys), so a fork adds no key and the keys go with the
-- list.  A key finds its page while a manifests row holds the list and the
-- page's blob has a blobs row.
CREATE TABLE manifest_pages (
    manifest TEXT NOT NULL,     -- manifests.digest
    page_ix  INTEGER NOT NULL,
    digest   TEXT NOT NULL,
    space    INTEGER,           -- key_spaces.id of the manifest's key namespace; NULL when key is
    key      TEXT,              -- the page's token chain key (64 hex); NULL: not keyed (no
                                -- token_ids, a short last page, a manifest with 'inputs')
    PRIMARY KEY (manifest, page_ix)
) WITHOUT ROWID;
CREATE INDEX manifest_pages_digest ON manifest_pages(digest);
CREATE INDEX manifest_pages_key ON manifest_pages(space, key) WHERE key IS NOT NULL;

-- Key namespaces (pffs.client.chainkeys.key_namespace: model identity, dtype,
-- geometry, layout, kv conventions).  A key never matches across them.  Rows
-- that nothing names are dropped when the index is rebuilt.
CREATE TABLE key_spaces (
    id   INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE   -- the namespace: 64 hex digits
);

-- Pages stored by key alone (an engine's cache, not a session): the
-- user.pffs.prefix xattr names a file's blob under a key.  Each row is a gc
-- root.  Past the mount's prefix_cache_size (bytes of these rows' sizes) the
-- least recently used rows go; pages sessions hold are not rows here, and
-- are never evicted.
CREATE TABLE cached_keys (
    space   INTEGER NOT NULL,   -- key_spaces.id
    key     TEXT NOT NULL,      -- token chain key (64 hex)
    digest  TEXT NOT NULL,      -- blobs.digest of the page
    size    INTEGER NOT NULL,   -- the blob's raw_size: what the row counts against the limit
    used_ns INTEGER NOT NULL,   -- when it was stored or last found (LRU order)
    PRIMARY KEY (space, key)
) WITHOUT ROWID;
CREATE INDEX cached_keys_used ON cached_keys(used_ns);
CREATE INDEX cached_keys_digest ON cached_keys(digest);

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


#: How long a statement waits for another process's write lock (gc, check).
BUSY_TIMEOUT_MS = 10000


def connect(path: str | os.PathLike, *, readonly: bool = False) -> sqlite3.Connection:
    """Open the database with the settings every connection must share."""
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                               check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
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


def set_busy_timeout(conn: sqlite3.Connection, ms: int) -> None:
    """How long *conn*'s statements wait for another connection's lock (0: never)."""
    conn.execute(f"PRAGMA busy_timeout = {int(ms)}")


def no_autocheckpoint(conn: sqlite3.Connection) -> None:
    """No checkpoint by a commit that crosses the WAL's threshold: the caller
    checkpoints (``checkpoint``) where it chooses."""
    conn.execute("PRAGMA wal_autocheckpoint = 0")


def checkpoint(conn: sqlite3.Connection, mode: str = "PASSIVE") -> None:
    """Copy the WAL's commits into the database file (*mode*: PASSIVE, FULL,
    RESTART or TRUNCATE, SQLite's)."""
    if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
        raise ValueError(f"no checkpoint mode {mode!r}")
    conn.execute(f"PRAGMA wal_checkpoint({mode})")


def data_version(conn: sqlite3.Connection) -> int:
    """A number that changes whenever another connection, of this process or
    another, has committed since *conn* last looked (O(1))."""
    return conn.execute("PRAGMA data_version").fetchone()[0]


def create(conn: sqlite3.Connection, uid: int | None = None, gid: int | None = None) -> None:
    """Create the tables and the root directory in an empty database."""
    t = now_ns()
    with transaction(conn):
        for statement in _statements(SCHEMA):
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("INSERT INTO meta VALUES ('created_ns', ?)", (str(t),))
        conn.execute("INSERT INTO meta VALUES ('prefix_index', '1')")   # (no manifest to key yet)
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
    # 6 -> 7: a folder's entries indexed in cookie order.  Without it every
    # readdir call of a large folder scanned and sorted all of it, and a
    # listing takes one call per few dozen entries.
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
    # 8 -> 9: the prefix index (SPEC §7).  The keys need the manifests' bytes,
    # which SQL cannot read: meta's 'prefix_index' stays absent until the next
    # mount (or check --repair) computes them (pffs.namespace.prefix_index.rebuild).
    8: ["ALTER TABLE manifest_pages ADD COLUMN space INTEGER",
        "ALTER TABLE manifest_pages ADD COLUMN key TEXT",
        "CREATE INDEX manifest_pages_key ON manifest_pages(space, key) WHERE key IS NOT NULL",
        "CREATE TABLE key_spaces (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)",
        "CREATE TABLE cached_keys (space INTEGER NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL,"
        " size INTEGER NOT NULL, used_ns INTEGER NOT NULL, PRIMARY KEY (space, key)) WITHOUT ROWID",
        "CREATE INDEX cached_keys_used ON cached_keys(used_ns)",
        "CREATE INDEX cached_keys_digest ON cached_keys(digest)"],
}


def migrate(conn: sqlite3.Connection, version: int) -> None:
    with transaction(conn):
        while version < SCHEMA_VERSION:
            for s in MIGRATIONS[version]:
                conn.execute(s)
            version += 1
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))
