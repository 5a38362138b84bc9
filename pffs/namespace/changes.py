"""The changes the mounted daemon makes, each a named function of the write
connection run in one transaction: by the writer thread (``Database.write``),
on the loop when it need not wait (``Database.write_small``), or by a commit
thread for the file it has just stored (``Database.run_in_transaction``).

They are given what they need as arguments (the staged bytes' reader where
a commit may have to parse them): none closes over a handler's state.  The
one thing they ask of the loop is ``in_use(ino)`` where an inode's deletion
hangs on whether the kernel or a handle still holds it (see
docs/concurrency.md).
"""

from __future__ import annotations

import errno
import sqlite3
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pffs import manifest as mf
from pffs.namespace.forks import fork_pages
from pffs.namespace.pagelists import record_known_manifest, record_manifest
from pffs.namespace.prefix_index import IndexKeys, manifest_keys
from pffs.namespace.rows import (
    BlobRow,
    FsError,
    Inode,
    blocks_of,
    delete_inode,
    get_inode,
    known_blobs,
    link,
    make_inode,
    names_of,
    rename,
    set_content,
)

MANIFEST = mf.MANIFEST_NAME.encode()
#: Where a file takes the name manifest.json: the digest of its bytes as
#: checked, the pages they list and their token chain keys.
CheckedManifest = tuple[str | None, Sequence[str], IndexKeys | None]
Created = list[tuple[int, int]]     # (pages folder, page files a fork made there)


@dataclass
class AcceptedManifest:
    """Bytes identical to a manifest already accepted: its page count, known without
    parsing or reading its page list (see record_known_manifest)."""
    n_pages: int
    load: Callable[[], Sequence[str]]

    @property
    def pages(self) -> Sequence[str]:
        """The page list (read from the namespace, or parsed if it went meanwhile)."""
        return self.load()


@dataclass
class StoredContent:
    """What a commit stored of a file's bytes: the rows that name it."""
    size: int
    digest: str | None      # None for a file of several blocks (reckoned when asked for)
    blocks: list[str]
    blob_rows: list[BlobRow]
    manifest: mf.Manifest | AcceptedManifest | None = None
    manifest_error: mf.ManifestError | None = None


class StagedBytes(Protocol):
    """The staged bytes a commit stored (pffs.fs.write_stage.Staging)."""
    mtime_ns: int | None

    def read(self, off: int, size: int) -> bytes: ...


class LateManifest(Exception):
    """A commit's bytes, not checked as a manifest, found named manifest.json in its transaction."""

    def __init__(self, error: mf.ManifestError):
        super().__init__(str(error))
        self.error = error


def commit_file(conn: sqlite3.Connection, ino: int, staged: StagedBytes, was_empty: bool,
                uid: int, gid: int, stored: StoredContent) -> Created:
    """*ino* holds the bytes *staged* that the commit stored as *stored*; a
    manifest among them records its page list and forks its pages into
    every session folder that names it manifest.json (made by *uid*:*gid*).

    Bytes not checked as a manifest whose file has the name manifest.json by
    now (a rename committed meanwhile) are checked here, where the names are
    those this transaction commits against: LateManifest if they are none.
    *was_empty*: the file is known to have had no content (see set_content).
    """
    m = stored.manifest
    if m is None and any(n == MANIFEST for _, n in names_of(conn, ino)):
        try:
            if stored.size > mf.MAX_MANIFEST_BYTES:
                raise mf.ManifestError("manifest", f"{stored.size} bytes exceed the "
                                       f"{mf.MAX_MANIFEST_BYTES}-byte cap")
            m = mf.parse(staged.read(0, stored.size))
        except mf.ManifestError as e:
            raise LateManifest(e) from None
    set_content(conn, ino, stored.size, stored.digest, stored.blocks, stored.blob_rows,
                staged.mtime_ns, was_empty=was_empty)
    created: Created = []
    digest = stored.digest
    if m is not None:
        assert digest is not None      # (a manifest is one block)
        if isinstance(m, AcceptedManifest):
            # A fork's manifest: its page list is the accepted one's, unless
            # that went with its last holder since (then it is parsed anew).
            if not record_known_manifest(conn, ino, digest, m.n_pages):
                parsed = mf.parse(staged.read(0, stored.size))
                record_manifest(conn, ino, parsed.pages, digest, manifest_keys(parsed))
        else:
            record_manifest(conn, ino, m.pages, digest, manifest_keys(m))
        for parent, name in names_of(conn, ino):
            if name == MANIFEST:
                created += fork_pages(conn, parent, digest, uid, gid)
    return created


def take_manifest_name(conn: sqlite3.Connection, ino: int, checked: CheckedManifest, parent: int,
                       uid: int, gid: int) -> Created:
    """*ino*, whose bytes were checked as a manifest (*checked*), has just
    taken the name manifest.json in *parent*: its page list recorded, its
    pages forked there.  EAGAIN if its bytes changed since the check."""
    digest, pages, keys = checked
    if digest is None or get_inode(conn, ino).digest != digest:
        raise FsError(errno.EAGAIN, "manifest changed while it was being validated")
    record_manifest(conn, ino, pages, digest, keys)
    return fork_pages(conn, parent, digest, uid, gid)


def rename_with_manifest(conn: sqlite3.Connection, p_old: int, n_old: bytes, p_new: int, n_new: bytes,
                         flags: int, in_use: Callable[[int], bool], checked: CheckedManifest | None,
                         uid: int, gid: int) -> tuple[int | None, bool, Created]:
    """``rename`` (see there), the moved file taking the name manifest.json
    where *checked* says its bytes were checked as one: (the inode replaced,
    whether it was deleted, the page files forked)."""
    ino, replaced, deleted = rename(conn, p_old, n_old, p_new, n_new, flags, in_use)
    created: Created = []
    if checked is not None:
        created = take_manifest_name(conn, ino, checked, p_new, uid, gid)
    return replaced, deleted, created


def link_with_manifest(conn: sqlite3.Connection, ino: int, new_parent: int, new_name: bytes,
                       checked: CheckedManifest | None, uid: int, gid: int) -> tuple[Inode, Created]:
    """``link``, the new name manifest.json where *checked* says the file's
    bytes were checked as one: (the inode, the page files forked)."""
    node = link(conn, ino, new_parent, new_name)
    created: Created = []
    if checked is not None:
        created = take_manifest_name(conn, ino, checked, new_parent, uid, gid)
    return node, created


def fork_manifest(conn: sqlite3.Connection, src: int, folder: int, uid: int, gid: int) -> Created:
    """``pffs fork``: session folder *folder* gets a manifest.json holding the
    blob of accepted manifest *src*, and its pages as a metadata-only fork
    (EINVAL where *src* is not a manifest accepted with its bytes, or its page
    list is not recorded whole)."""
    row = conn.execute("SELECT n_pages, digest FROM manifests WHERE inode=?", (src,)).fetchone()
    node = get_inode(conn, src)
    if row is None or node.digest != row[1]:
        raise FsError(errno.EINVAL, "not an accepted manifest")
    n_pages, digest = row
    blocks = blocks_of(conn, src)
    new = make_inode(conn, folder, MANIFEST, stat.S_IFREG | 0o644, uid, gid)
    set_content(conn, new.id, node.size, digest, blocks, [], None, new.ctime_ns, was_empty=True)
    if not record_known_manifest(conn, new.id, digest, n_pages):
        raise FsError(errno.EINVAL, "its page list is not recorded whole")
    return fork_pages(conn, folder, digest, uid, gid)


def share_content(conn: sqlite3.Connection, src: int, dst: int, length: int, staged_empty: bool,
                  t: int) -> tuple[int, list[str]] | None:
    """A copy of all of *src* (at most *length* bytes) into empty file *dst*:
    *dst* holds *src*'s blobs (mtime *t*): (its size, its blocks), or None
    where *src* is longer or *dst* not empty (*staged_empty*: its staged
    bytes, which the caller knows to be none, stand for its content)."""
    node = get_inode(conn, src)
    if node.size > length or (not staged_empty and get_inode(conn, dst).size):
        return None     # (part of a file, or a target that is not empty)
    blocks = blocks_of(conn, src)
    set_content(conn, dst, node.size, node.digest, blocks, [], t)
    return node.size, blocks


def give_blob(conn: sqlite3.Connection, ino: int, size: int, digest: str, row: BlobRow | None,
              staged_empty: bool, t: int) -> tuple[int, list[str]] | None:
    """Empty file *ino* holds blob *digest* of *size* bytes (mtime *t*; *row*
    where the namespace may lack one): (its size, its blocks), or None where
    the file is not empty (see share_content) or the blob has no row."""
    if not staged_empty and get_inode(conn, ino).size:
        return None     # (not empty)
    if row is None and digest not in known_blobs(conn, {digest}):
        return None
    set_content(conn, ino, size, digest, [digest], [row] if row is not None else [], t)
    return size, [digest]


def delete_unlinked(conn: sqlite3.Connection, inos: Sequence[int], in_use: Callable[[int], bool]) -> None:
    """Delete each of *inos* that has no name and that nothing holds
    (``in_use``, asked here, in the transaction: an inode looked up while it
    waited is kept)."""
    for ino in inos:
        row = conn.execute("SELECT nlink FROM inodes WHERE id=?", (ino,)).fetchone()
        if row is not None and row[0] == 0 and not in_use(ino):
            delete_inode(conn, ino)
