"""The namespace: inodes, names, modes, times, xattrs, and which blobs hold each file.

It lives in one SQLite database beside the blobs (``<store>/namespace.db``)
and is the only index of the store, so it is treated as precious: WAL mode,
a recorded schema version, snapshots, and a repair path (see fsck).

Threading: a mounted filesystem reads through one connection on the trio
thread and makes every change through a second connection owned by a single
writer thread (see :class:`pffs.fs.db.Database`).  The functions here are
plain synchronous code on a given connection, so offline tools (check, gc,
stats, the bridge's store sink) share them.

The package's modules, each with one reason to change:

- :mod:`.schema`: the tables (SCHEMA), store-wide constants (SCHEMA_VERSION,
  DB_NAME, ROOT_INODE, BLOCK_SIZE, MAX_FILE_SIZE, EMPTY_DIGEST), SchemaError
  and DamagedDatabase, connect/create/open_db, transaction, is_disk_full,
  and the migrations (MIGRATIONS, migrate).
- :mod:`.tree`: the rows and their changes: Inode, FsError, get_inode,
  lookup, make_inode, unlink, rmdir, rename, link, set_attrs, BlobRow,
  set_content, blocks_of, names_of, path_of, read_file, cleanup_orphans...
- :mod:`.pagelists`: manifests' page lists and what holds them: manifest
  records (record_manifest, record_known_manifest, forget_manifest,
  recorded_count, recorded_pages), pagesets, and folded forks (is_folded,
  unfold).  It calls nothing of the tree's; the tree calls it.
- :mod:`.forks`: metadata-only forks (fork_pages), on top of the two above.
- :mod:`.figures`: Stats, stats and iter_referenced_blobs (the gc roots).

Imports go one way: schema <- pagelists <- tree <- forks; figures needs
only the tables.  Every public name is re-exported here (``__all__``), so
``from pffs import namespace as ns; ns.X`` and ``from pffs.namespace import X``
work as they did when this was one module.
"""

from __future__ import annotations

from pffs.namespace.figures import Stats, iter_referenced_blobs, stats
from pffs.namespace.forks import fork_pages
from pffs.namespace.pagelists import (
    forget_manifest,
    is_folded,
    record_known_manifest,
    record_manifest,
    recorded_count,
    recorded_pages,
    unfold,
)
from pffs.namespace.rows import (
    INODE_COLS,
    NAME_MAX,
    READDIR_SQL,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    RENAME_WHITEOUT,
    S_IFMT,
    BlobRow,
    FsError,
    Inode,
    blocks_of,
    check_name,
    cleanup_orphans,
    delete_inode,
    deletes_little,
    drop_blocks,
    drop_link,
    files_holding,
    get_inode,
    insert_blob_rows,
    known_blobs,
    link,
    lookup,
    make_inode,
    names_of,
    path_of,
    read_file,
    rename,
    rmdir,
    set_attrs,
    set_content,
    touch_dir,
    unlink,
)
from pffs.namespace.schema import (
    BLOCK_SIZE,
    BUSY_TIMEOUT_MS,
    DB_NAME,
    DENTRY_COLUMNS,
    EMPTY_DIGEST,
    INODE_COLUMNS,
    MAX_FILE_SIZE,
    MIGRATIONS,
    ROOT_INODE,
    SCHEMA,
    SCHEMA_VERSION,
    DamagedDatabase,
    SchemaError,
    connect,
    create,
    is_disk_full,
    migrate,
    now_ns,
    open_db,
    schema_version,
    transaction,
)

__all__ = [
    "BLOCK_SIZE",
    "BUSY_TIMEOUT_MS",
    "DB_NAME",
    "DENTRY_COLUMNS",
    "EMPTY_DIGEST",
    "INODE_COLS",
    "INODE_COLUMNS",
    "MAX_FILE_SIZE",
    "MIGRATIONS",
    "NAME_MAX",
    "READDIR_SQL",
    "RENAME_EXCHANGE",
    "RENAME_NOREPLACE",
    "RENAME_WHITEOUT",
    "ROOT_INODE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "S_IFMT",
    "BlobRow",
    "DamagedDatabase",
    "FsError",
    "Inode",
    "SchemaError",
    "Stats",
    "blocks_of",
    "check_name",
    "cleanup_orphans",
    "connect",
    "create",
    "delete_inode",
    "deletes_little",
    "drop_blocks",
    "drop_link",
    "files_holding",
    "forget_manifest",
    "fork_pages",
    "get_inode",
    "insert_blob_rows",
    "is_disk_full",
    "is_folded",
    "iter_referenced_blobs",
    "known_blobs",
    "link",
    "lookup",
    "make_inode",
    "migrate",
    "names_of",
    "now_ns",
    "open_db",
    "path_of",
    "read_file",
    "record_known_manifest",
    "record_manifest",
    "recorded_count",
    "recorded_pages",
    "rename",
    "rmdir",
    "schema_version",
    "set_attrs",
    "set_content",
    "stats",
    "touch_dir",
    "transaction",
    "unfold",
    "unlink",
]
