"""Rows and changes of the tree: inodes, directory entries, attributes and file contents.

Every function here runs inside the caller's transaction. The mounted
filesystem calls them in its single writer thread; offline tools call them
directly. Checks and changes happen in the same transaction, so a check
can never be overtaken by a concurrent change.
"""

from __future__ import annotations

import errno as _errno
import os
import sqlite3
import stat
from dataclasses import dataclass
from typing import Iterable

from pffs.errors import PffsError
from pffs.namespace.pagelists import drop_fold, drop_unheld_pages, forget_manifest, unfold
from pffs.namespace.schema import EMPTY_DIGEST, ROOT_INODE, now_ns
from pffs.types import Digest

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
    assert ino is not None  # an INSERT sets it
    conn.execute("INSERT INTO dentries (parent, name, inode) VALUES (?,?,?)", (parent, name, ino))
    touch_dir(conn, parent, t, 1 if is_dir else 0)
    return Inode(ino, mode, uid, gid, size, t, t, t, 2 if is_dir else 1, rdev, digest, target)


def delete_inode(conn: sqlite3.Connection, ino: int) -> None:
    """Drop an inode and everything it holds (its blobs stay until gc)."""
    drop_blocks(conn, ino)
    conn.execute("DELETE FROM xattrs WHERE inode=?", (ino,))
    forget_manifest(conn, ino)
    drop_fold(conn, ino)
    conn.execute("DELETE FROM inodes WHERE id=?", (ino,))


# Blocks rows of an inode whose deletion is a small change (deletes_little).
FEW_BLOCKS = 16


def deletes_little(conn: sqlite3.Connection, ino: int) -> bool:
    """Whether ``delete_inode(ino)`` changes a few rows only: a file of at most
    FEW_BLOCKS blocks, holding no manifest or fold, none of whose blocks is
    the last of a fork's pageset (whose page list would go with it)."""
    if conn.execute("SELECT 1 FROM manifests WHERE inode=:i UNION ALL SELECT 1 FROM folds WHERE dir=:i"
                    " LIMIT 1", {"i": ino}).fetchone() is not None:
        return False
    n = 0
    for (via,) in conn.execute("SELECT via FROM blocks WHERE inode=? LIMIT ?", (ino, FEW_BLOCKS + 1)):
        n += 1
        if via is not None and conn.execute("SELECT 1 FROM blocks WHERE via=? AND inode<>? LIMIT 1",
                                            (via, ino)).fetchone() is None:
            return False
    return n <= FEW_BLOCKS


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


def set_attrs(conn: sqlite3.Connection, ino: int, /, **fields: int) -> Inode:
    """Update plain attributes (not size: content changes go through set_content)."""
    cols = [k for k in fields if k in _SETTABLE]
    if cols:
        conn.execute(f"UPDATE inodes SET {', '.join(c + '=?' for c in cols)} WHERE id=?",
                     [fields[c] for c in cols] + [ino])
    return get_inode(conn, ino)


def set_xattr(conn: sqlite3.Connection, ino: int, name: bytes, value: bytes, t: int) -> None:
    """Extended attribute *name* of *ino* set to *value* (its ctime to *t*)."""
    get_inode(conn, ino)
    conn.execute("INSERT OR REPLACE INTO xattrs (inode, name, value) VALUES (?,?,?)", (ino, name, value))
    conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, ino))


def remove_xattr(conn: sqlite3.Connection, ino: int, name: bytes, t: int) -> None:
    """Extended attribute *name* of *ino* removed (ENODATA if it had none; its ctime to *t*)."""
    cur = conn.execute("DELETE FROM xattrs WHERE inode=? AND name=?", (ino, name))
    if cur.rowcount == 0:
        raise FsError(_errno.ENODATA)
    conn.execute("UPDATE inodes SET ctime_ns=? WHERE id=?", (t, ino))


def get_xattr(conn: sqlite3.Connection, ino: int, name: bytes) -> bytes | None:
    """The value of extended attribute *name* of *ino*, or None."""
    row = conn.execute("SELECT value FROM xattrs WHERE inode=? AND name=?", (ino, name)).fetchone()
    return None if row is None else row[0]


def list_xattrs(conn: sqlite3.Connection, ino: int) -> list[bytes]:
    """The names of the extended attributes of *ino*."""
    return [r[0] for r in conn.execute("SELECT name FROM xattrs WHERE inode=?", (ino,))]


@dataclass
class BlobRow:
    digest: str
    raw_size: int
    stored_size: int
    codec: str


def set_content(conn: sqlite3.Connection, ino: int, size: int, digest: str | None,
                blocks: list[str], new_blobs: list[BlobRow], mtime_ns: int | None,
                ctime_ns: int | None = None, *, was_empty: bool = False) -> None:
    """Point a file at new content: its blocks' blobs (already stored and synced);
    *digest*, the sha256 of its bytes, None for a file of several blocks.

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
            drop_unheld_pages(conn, row[0])


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
    out: dict[str, int] = {}
    uniq = list(set(digests))
    for k in range(0, len(uniq), 500):
        chunk = uniq[k:k + 500]
        out.update(conn.execute(f"SELECT digest, raw_size FROM blobs WHERE digest IN"
                                f" ({','.join('?' * len(chunk))})", chunk))
    return out


def has_blob(conn: sqlite3.Connection, digest: str) -> bool:
    """Whether the namespace has a row for blob *digest*."""
    return conn.execute("SELECT 1 FROM blobs WHERE digest=?", (digest,)).fetchone() is not None


def names_of(conn: sqlite3.Connection, ino: int) -> list[tuple[int, bytes]]:
    return list(conn.execute("SELECT parent, name FROM dentries WHERE inode=?", (ino,)))


def read_file(conn: sqlite3.Connection, blobs, ino: int, max_size: int | None = None) -> bytes:
    """The whole committed content of a regular file (verified blob reads)."""
    size = conn.execute("SELECT size FROM inodes WHERE id=?", (ino,)).fetchone()[0]
    if max_size is not None and size > max_size:
        raise ValueError(f"file of {size} bytes exceeds {max_size}")
    parts = [blobs.get(Digest(d)) for (d,) in
             conn.execute("SELECT blob FROM blocks WHERE inode=? ORDER BY blockno", (ino,))]
    return b"".join(parts)


def cleanup_orphans(conn: sqlite3.Connection) -> int:
    """Delete inodes left unlinked-but-open by a previous run (nothing holds them now)."""
    rows = [r[0] for r in conn.execute("SELECT id FROM inodes WHERE nlink=0 AND id != ?", (ROOT_INODE,))]
    for ino in rows:
        delete_inode(conn, ino)
    return len(rows)


def path_of(conn: sqlite3.Connection, ino: int) -> str:
    """A path of *ino* inside the mount, for log lines ('/a/b'; '<inode N>' if unnamed)."""
    parts: list[str] = []
    seen: set[int] = set()
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
