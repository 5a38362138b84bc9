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
- :mod:`.rows`: the rows and their changes: Inode, FsError, get_inode,
  lookup, make_inode, unlink, rmdir, rename, link, set_attrs, BlobRow,
  set_content, blocks_of, names_of, path_of, read_file, cleanup_orphans...
- :mod:`.pagelists`: manifests' page lists and what holds them: manifest
  records (record_manifest, record_known_manifest, forget_manifest,
  recorded_count, recorded_pages), pagesets, and folded forks (is_folded,
  unfold).  It calls nothing of the tree's; the tree calls it.
- :mod:`.forks`: metadata-only forks (fork_pages), on top of the two above.
- :mod:`.prefix_index`: the prefix index (SPEC §7): a page list's token chain
  keys (manifest_keys, IndexKeys), what a key finds, the key-only cache,
  rebuilding the index from the manifests.
- :mod:`.figures`: Stats and stats (the store's figures).
- :mod:`.references`: which blobs are referenced, the gc roots, in one place
  (iter_referenced_blobs, is_referenced, referenced_among, referenced_sql,
  drop_unreferenced_blob_row).
- :mod:`.usage`: what places of the tree share and hold alone (Place,
  PlaceMoved, Usage, usage_of: ``pffs du``), by the gc roots' rules.
- :mod:`.queries`: the mounted daemon's reads (listings, counts, what
  prefetch reads ahead, page_verdict) and KnownBlobs, asked from any thread.
- :mod:`.changes`: the mounted daemon's changes that its writer and commit
  threads run, each one named function (commit_file, rename_with_manifest,
  fork_manifest, delete_unlinked...).

Imports go one way: schema <- prefix_index <- pagelists <- tree <- forks <- changes, and
queries on top of the tree; figures and references need only the tables, usage the references.  Every public name is re-exported here (``__all__``), so
``from pffs import namespace as ns; ns.X`` and ``from pffs.namespace import X``
work as they did when this was one module.
"""

from __future__ import annotations

from pffs.namespace.changes import (
    AcceptedManifest,
    CheckedManifest,
    LateManifest,
    StoredContent,
    commit_file,
    delete_unlinked,
    fork_manifest,
    give_blob,
    link_with_manifest,
    rename_with_manifest,
    share_content,
    take_manifest_name,
)
from pffs.namespace.figures import Stats, stats
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
from pffs.namespace.prefix_index import IndexKeys, manifest_keys
from pffs.namespace.queries import (
    VERDICT_MAX,
    KnownBlobs,
    entry_count,
    files_content,
    first_entry,
    inode_count,
    lookup_or_folded,
    named_files_content,
    nlink_of,
    page_verdict,
    readdir,
    size_of,
    stored_bytes,
)
from pffs.namespace.references import (
    drop_unreferenced_blob_row,
    is_referenced,
    iter_referenced_blobs,
    referenced_among,
    referenced_sql,
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
    get_xattr,
    has_blob,
    insert_blob_rows,
    known_blobs,
    link,
    list_xattrs,
    lookup,
    make_inode,
    names_of,
    path_of,
    read_file,
    remove_xattr,
    rename,
    rmdir,
    set_attrs,
    set_content,
    set_xattr,
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
    checkpoint,
    connect,
    create,
    data_version,
    is_disk_full,
    migrate,
    no_autocheckpoint,
    now_ns,
    open_db,
    schema_version,
    set_busy_timeout,
    transaction,
)
from pffs.namespace.usage import Place, PlaceMoved, Usage, usage_of

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
    "VERDICT_MAX",
    "AcceptedManifest",
    "BlobRow",
    "CheckedManifest",
    "DamagedDatabase",
    "FsError",
    "IndexKeys",
    "Inode",
    "KnownBlobs",
    "LateManifest",
    "Place",
    "PlaceMoved",
    "SchemaError",
    "Stats",
    "StoredContent",
    "Usage",
    "blocks_of",
    "check_name",
    "checkpoint",
    "cleanup_orphans",
    "commit_file",
    "connect",
    "create",
    "data_version",
    "delete_inode",
    "delete_unlinked",
    "deletes_little",
    "drop_blocks",
    "drop_link",
    "drop_unreferenced_blob_row",
    "entry_count",
    "files_content",
    "files_holding",
    "first_entry",
    "forget_manifest",
    "fork_manifest",
    "fork_pages",
    "get_inode",
    "get_xattr",
    "give_blob",
    "has_blob",
    "inode_count",
    "insert_blob_rows",
    "is_disk_full",
    "is_folded",
    "is_referenced",
    "iter_referenced_blobs",
    "known_blobs",
    "link",
    "link_with_manifest",
    "list_xattrs",
    "lookup",
    "lookup_or_folded",
    "make_inode",
    "manifest_keys",
    "migrate",
    "named_files_content",
    "names_of",
    "nlink_of",
    "no_autocheckpoint",
    "now_ns",
    "open_db",
    "page_verdict",
    "path_of",
    "read_file",
    "readdir",
    "record_known_manifest",
    "record_manifest",
    "recorded_count",
    "recorded_pages",
    "referenced_among",
    "referenced_sql",
    "remove_xattr",
    "rename",
    "rename_with_manifest",
    "rmdir",
    "schema_version",
    "set_attrs",
    "set_busy_timeout",
    "set_content",
    "set_xattr",
    "share_content",
    "size_of",
    "stats",
    "stored_bytes",
    "take_manifest_name",
    "touch_dir",
    "transaction",
    "unfold",
    "unlink",
    "usage_of",
]
