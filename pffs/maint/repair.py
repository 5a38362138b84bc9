"""``pffs check --repair``: fix what can be fixed without losing intact data.

On an unmounted store (the caller holds the store lock):

- A namespace database that SQLite cannot read, or whose integrity check
  fails, is set aside (``namespace.db.damaged-<time>``) and the newest
  snapshot that passes the check is restored.  Blobs written after that
  snapshot are not lost: each one appears as a file in
  ``/lost+found/after-snapshot/`` (manifests as ``<hex>.manifest.json``), so
  ``mkdir -p s/pages && cp lost+found/after-snapshot/X.manifest.json
  s/manifest.json`` brings such a session back by metadata-only fork.
  Without any good snapshot, a fresh namespace is built the same way from
  every blob.
- A file holding a missing, corrupt or inconsistent blob is moved to
  ``/lost+found/<inode>-<name>``, keeping its intact leading blocks, with
  the reason in its ``user.pffs.lost`` xattr and in a ``.why`` file beside
  it; the rest of its session stays readable (the session is then
  incomplete, which is not damage).  Corrupt blob files are moved to
  ``DIR/damaged/``, so a later write of the same bytes stores them afresh.
- Entries naming missing inodes, rows of missing inodes and stale rows are
  dropped; inodes without a name, or cut off from the root, go to
  ``/lost+found``; link counts are set right; a blob a file holds but the
  index forgot gets its row back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.errors import IntegrityError, PffsError
from pffs.maint import check as fsck
from pffs.maint.snapshots import list_snapshots
from pffs.names import LOST_XATTR_B as LOST_XATTR
from pffs.namespace import prefix_index
from pffs.store.storedir import StoreDir
from pffs.types import Digest

LOST_FOUND = b"lost+found"
AFTER_SNAPSHOT = b"after-snapshot"
# Blobs this much older than a restored snapshot count as written after it
# too: a commit naming them may have landed just after the copy was taken.
SNAPSHOT_SLACK = 120.0


@dataclass
class RepairResult:
    actions: list[str] = field(default_factory=list)
    restored_snapshot: Path | None = None
    report: fsck.Report | None = None     # the check after the repair


def _say(result: RepairResult, say: Callable[[str], None] | None, line: str) -> None:
    result.actions.append(line)
    if say:
        say(line)


# -- the database file -----------------------------------------------------

def _snapshot_ok(path: Path) -> bool:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            if fsck.database_errors(conn):
                return False
            return ns.schema_version(conn) <= ns.SCHEMA_VERSION
        finally:
            conn.close()
    except (sqlite3.Error, ns.SchemaError):
        return False


def database_damaged(store: StoreDir) -> str | None:
    """Why the namespace database cannot be used as it is, or None if it can."""
    try:
        conn = ns.open_db(store.root, create_missing=False)
    except ns.DamagedDatabase as e:
        return str(e)
    try:
        errors = fsck.database_errors(conn)
        return "; ".join(errors) if errors else None
    finally:
        conn.close()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restore_snapshot(store: StoreDir, result: RepairResult, say=None) -> float:
    """Replace a damaged database by the newest good snapshot; returns the snapshot's time (0: none)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    db = store.db_path
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(db) + suffix)
        if p.exists():
            aside = Path(f"{db}.damaged-{stamp}{suffix}")
            os.rename(p, aside)
            if not suffix:
                _say(result, say, f"set the damaged database aside as {aside.name}")
    good = None
    for snap in reversed(list_snapshots(store.snapshot_dir)):
        if _snapshot_ok(snap):
            good = snap
            break
        _say(result, say, f"snapshot {snap.name} is damaged too; trying an older one")
    tmp = Path(str(db) + ".restore")
    if good is not None:
        shutil.copyfile(good, tmp)
        _fsync(tmp)
        os.rename(tmp, db)
        _fsync(store.root)
        result.restored_snapshot = good
        _say(result, say, f"restored the namespace from snapshot {good.name}")
        return good.stat().st_mtime
    conn = ns.open_db(store.root)  # a fresh, empty namespace
    conn.close()
    _say(result, say, "no good snapshot: started a fresh namespace; every blob goes to /lost+found")
    return 0.0


# -- helpers on the namespace -------------------------------------------------

def _lost_found(conn: sqlite3.Connection) -> int:
    name = LOST_FOUND
    n = 0
    while True:
        ino = ns.lookup(conn, ns.ROOT_INODE, name)
        if ino is None:
            return ns.make_inode(conn, ns.ROOT_INODE, name, stat.S_IFDIR | 0o700, 0, 0).id
        if ns.get_inode(conn, ino).is_dir:
            return ino
        n += 1
        name = LOST_FOUND + b".%d" % n


def _subdir(conn: sqlite3.Connection, parent: int, name: bytes) -> int:
    ino = ns.lookup(conn, parent, name)
    if ino is not None and ns.get_inode(conn, ino).is_dir:
        return ino
    return ns.make_inode(conn, parent, name if ino is None else name + b".dir",
                         stat.S_IFDIR | 0o700, 0, 0).id


def _free_name(conn: sqlite3.Connection, parent: int, name: bytes) -> bytes:
    name = name[:ns.NAME_MAX - 12] or b"unnamed"
    cand, n = name, 0
    while ns.lookup(conn, parent, cand) is not None or ns.lookup(conn, parent, cand + b".why") is not None:
        n += 1
        cand = name + b".%d" % n
    return cand


def _relink(conn: sqlite3.Connection, ino: int, parent: int, name: bytes) -> None:
    """Give *ino* exactly one name, *name* in *parent* (a directory's old parents lose a link)."""
    node = ns.get_inode(conn, ino)
    t = ns.now_ns()
    for (old_parent,) in conn.execute("SELECT parent FROM dentries WHERE inode=?", (ino,)).fetchall():
        ns.touch_dir(conn, old_parent, t)
    conn.execute("DELETE FROM dentries WHERE inode=?", (ino,))
    conn.execute("INSERT INTO dentries (parent, name, inode) VALUES (?,?,?)", (parent, name, ino))
    ns.touch_dir(conn, parent, t)
    if not node.is_dir:
        conn.execute("UPDATE inodes SET nlink=1, ctime_ns=? WHERE id=?", (t, ino))


def _put_text(conn: sqlite3.Connection, store: StoreDir, parent: int, name: bytes, text: str) -> None:
    data = text.encode()
    r = store.blobs.put(data)
    f = ns.make_inode(conn, parent, name, stat.S_IFREG | 0o600, 0, 0)
    ns.set_content(conn, f.id, len(data), r.digest, [r.digest],
                   [ns.BlobRow(r.digest, len(data), r.stored_size, r.codec)], None)


def _index_row(store: StoreDir, d: str) -> ns.BlobRow | None:
    try:
        hdr = store.blobs.header(Digest(d))
        size = store.blobs.stored_size(Digest(d))
    except IntegrityError:
        return None
    return ns.BlobRow(d, hdr.raw_len, size, hdr.codec.name)


def _insert_row(conn: sqlite3.Connection, row: ns.BlobRow) -> None:
    conn.execute("INSERT OR IGNORE INTO blobs (digest, raw_size, stored_size, codec, created_ns)"
                 " VALUES (?,?,?,?,?)", (row.digest, row.raw_size, row.stored_size, row.codec, ns.now_ns()))


# -- the repair ---------------------------------------------------------------

def repair(store: StoreDir, *, read_data: bool = False, say: Callable[[str], None] | None = None,
           progress: Callable[[int, int], None] | None = None) -> RepairResult:
    """Repair an unmounted store whose lock the caller holds; the result holds a fresh check."""
    if store.blobs.remote:
        raise PffsError(f"{store.root}: repair works on a local store only"
                        " (this one keeps its blobs elsewhere)")
    result = RepairResult()
    snapshot_time = None
    why = database_damaged(store) if store.db_path.exists() else "no namespace database"
    if why is not None:
        _say(result, say, f"namespace database is damaged: {why}")
        snapshot_time = restore_snapshot(store, result, say)
    conn = ns.open_db(store.root, create_missing=False)
    try:
        report = fsck.check(conn, store.blobs, read_data=read_data, progress=progress)
        if report.db_errors:
            raise PffsError("the restored namespace is damaged too; giving up")
        with ns.transaction(conn):
            _fix(conn, store, report, result, say)
            if snapshot_time is not None:
                _recover_after(conn, store, snapshot_time, result, say)
            _reindex(conn, store, report, result, say)
        result.report = fsck.check(conn, store.blobs, read_data=False)
    finally:
        conn.close()
    return result


def _fix(conn: sqlite3.Connection, store: StoreDir, report: fsck.Report, result: RepairResult, say) -> None:
    s = report.blobs
    t = ns.now_ns()

    # The root directory.
    root = conn.execute("SELECT mode FROM inodes WHERE id=?", (ns.ROOT_INODE,)).fetchone()
    if root is None or not stat.S_ISDIR(root[0]):
        conn.execute("DELETE FROM inodes WHERE id=?", (ns.ROOT_INODE,))
        conn.execute("INSERT INTO inodes (id, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink)"
                     " VALUES (?, ?, 0, 0, 0, ?, ?, ?, 2)", (ns.ROOT_INODE, stat.S_IFDIR | 0o755, t, t, t))
        _say(result, say, "recreated the root directory")
    n = conn.execute("DELETE FROM dentries WHERE inode=?", (ns.ROOT_INODE,)).rowcount
    if n:
        _say(result, say, f"dropped {n} entries naming the root directory")

    # Rows that belong to nothing.
    for table in ("blocks", "xattrs", "manifests"):
        n = conn.execute(f"DELETE FROM {table} WHERE inode NOT IN (SELECT id FROM inodes)").rowcount
        if n:
            _say(result, say, f"dropped {n} {table} rows of inodes that do not exist")
    n = conn.execute("DELETE FROM manifests WHERE inode IN (SELECT m.inode FROM manifests m"
                     " JOIN inodes i ON i.id = m.inode WHERE i.digest IS NOT m.digest)").rowcount
    if n:
        _say(result, say, f"dropped {n} manifests rows of files whose bytes changed since")
    n = conn.execute("DELETE FROM blocks WHERE inode IN (SELECT id FROM inodes"
                     " WHERE (mode & 61440) != 32768)").rowcount
    if n:
        _say(result, say, f"dropped {n} blocks rows of inodes that are not regular files")
    for digest, ino, _want, _have in fsck.short_page_lists(conn):
        where = ns.path_of(conn, ino)
        try:
            parsed = mf.parse(ns.read_file(conn, store.blobs, ino, mf.MAX_MANIFEST_BYTES))
            pages = parsed.pages
        except (IntegrityError, ValueError):
            continue    # its blob is damaged: the file goes to lost+found below
        except mf.ManifestError as e:
            for (holder,) in conn.execute("SELECT inode FROM manifests WHERE digest=?", (digest,)).fetchall():
                ns.forget_manifest(conn, holder)
            _say(result, say, f"{where}: no longer recorded as a manifest ({e})")
            continue
        ns.record_manifest(conn, ino, pages, digest, ns.manifest_keys(parsed))
        conn.execute("UPDATE manifests SET n_pages=? WHERE digest=?", (len(pages), digest))
        _say(result, say, f"{where}: recorded the page list of its bytes again ({len(pages)} pages)")
    for folder, (files, _gives) in sorted(fsck.folds_short(conn).items()):
        made = ns.unfold(conn, folder)
        _say(result, say, f"{ns.path_of(conn, folder)}: made {made} of the {files} page files"
                          " of a folded fork"
                          + ("" if made == files else " (the page list they came from lacks the rest)"))
    n = conn.execute(f"UPDATE blocks SET via = NULL WHERE {fsck.UNPINNED_FORK_ROW}").rowcount
    if n:
        _say(result, say, f"indexed {n} blocks rows of forked pages by blob again"
                          " (the page list that held them was gone)")
    # What page lists were found whole is found again by the next fork (blob
    # rows may go below).
    conn.execute("DELETE FROM whole_lists")
    conn.execute("DELETE FROM pagesets WHERE NOT EXISTS (SELECT 1 FROM blocks b WHERE b.via = pagesets.id)")
    n = conn.execute("DELETE FROM manifest_pages WHERE manifest NOT IN (SELECT digest FROM manifests)"
                     " AND manifest NOT IN (SELECT manifest FROM pagesets)").rowcount
    if n:
        _say(result, say, f"dropped {n} manifest_pages rows of manifests no file holds")
    for (parent, name, ino) in conn.execute(
            "SELECT parent, name, inode FROM dentries WHERE inode NOT IN (SELECT id FROM inodes)").fetchall():
        conn.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
        _say(result, say, f"dropped entry {name!r} in {ns.path_of(conn, parent)}"
                          f" (inode {ino} does not exist)")
    for (parent, name, ino) in conn.execute(
            "SELECT d.parent, d.name, d.inode FROM dentries d LEFT JOIN inodes i ON i.id = d.parent"
            " WHERE i.id IS NULL OR (i.mode & 61440) != 16384").fetchall():
        conn.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
        _say(result, say, f"dropped entry {name!r} of inode {ino}: its parent {parent} is not a directory")

    # Blobs files hold that the index forgot.
    for d in sorted(s.held - set(s.indexed) - set(s.bad)):
        row = _index_row(store, d)
        if row is not None:
            _insert_row(conn, row)
            s.indexed[d] = (row.raw_size, row.stored_size)
            _say(result, say, f"indexed blob {d} (held by a file, missing from the index)")

    # Damaged files: to lost+found, keeping what is intact.
    bad_files = dict(report.bad_files)
    for ino, why in sorted(bad_files.items()):
        _isolate(conn, store, ino, why, s, result, say)

    # Damaged blobs: corrupt files aside, rows of unusable blobs dropped.
    for d, why in sorted({**s.bad, **s.corrupt_unheld}.items()):
        path = store.blobs.path(Digest(d))
        if path.exists():
            store.damaged_dir.mkdir(exist_ok=True)
            os.replace(path, store.damaged_dir / path.name)
            _say(result, say, f"moved corrupt blob {d} ({why}) to {store.damaged_dir.name}/")
        conn.execute("DELETE FROM blobs WHERE digest=?", (d,))
    stale = [d for d in s.indexed if d not in s.on_disk and d not in s.bad]
    for d in stale:
        if not ns.files_holding(conn, d):
            conn.execute("DELETE FROM blobs WHERE digest=?", (d,))
    if stale:
        _say(result, say, f"dropped {len(stale)} index rows of blobs that are not stored")

    # Names: directories with several, inodes with none or cut off from the root.
    for (ino,) in conn.execute(
            "SELECT d.inode FROM dentries d JOIN inodes i ON i.id = d.inode WHERE (i.mode & 61440) = 16384"
            " GROUP BY d.inode HAVING COUNT(*) > 1").fetchall():
        keep = conn.execute("SELECT MIN(id) FROM dentries WHERE inode=?", (ino,)).fetchone()[0]
        n = conn.execute("DELETE FROM dentries WHERE inode=? AND id != ?", (ino, keep)).rowcount
        _say(result, say, f"directory {ns.path_of(conn, ino)}: dropped {n} extra names")
    for (ino, nlink) in conn.execute(
            "SELECT id, nlink FROM inodes WHERE id != ? AND id NOT IN (SELECT inode FROM dentries)",
            (ns.ROOT_INODE,)).fetchall():
        if nlink == 0:
            ns.delete_inode(conn, ino)
            _say(result, say, f"deleted inode {ino}, unlinked and no longer open")
        else:
            lf = _lost_found(conn)
            name = _free_name(conn, lf, b"#%d" % ino)
            _relink(conn, ino, lf, name)
            _say(result, say, f"inode {ino} had no name: now /lost+found/{name.decode()}")
    while True:
        cut_off = fsck.unreachable_inodes(conn)
        if not cut_off:
            break
        ino = min(cut_off)
        lf = _lost_found(conn)
        name = _free_name(conn, lf, b"#%d" % ino)
        _relink(conn, ino, lf, name)
        _say(result, say, f"inode {ino} was cut off from the root (a directory cycle):"
                          f" now /lost+found/{name.decode()}")

    # Link counts last: every move above changed them.
    for ino, mode, nlink, names, subdirs in conn.execute(
            "SELECT i.id, i.mode, i.nlink,"
            " (SELECT COUNT(*) FROM dentries d WHERE d.inode = i.id),"
            " (SELECT COUNT(*) FROM dentries d JOIN inodes c ON c.id = d.inode"
            "   WHERE d.parent = i.id AND (c.mode & 61440) = 16384)"
            " FROM inodes i").fetchall():
        want = 2 + subdirs if stat.S_ISDIR(mode) else names
        if nlink != want and (names or ino == ns.ROOT_INODE):
            conn.execute("UPDATE inodes SET nlink=? WHERE id=?", (want, ino))
            _say(result, say, f"{ns.path_of(conn, ino)}: link count {nlink} set to {want}")


def _isolate(conn: sqlite3.Connection, store: StoreDir, ino: int, why: str, s: fsck.BlobStatus,
             result: RepairResult, say) -> None:
    """Move a damaged file to lost+found, keeping its intact leading blocks."""
    node = ns.get_inode(conn, ino)
    where = ns.path_of(conn, ino)
    blocks = ns.blocks_of(conn, ino)
    keep: list[str] = []
    kept_bytes = 0
    for d in blocks:
        n = s.raw_len.get(d)
        if d in s.bad or n is None:
            break
        keep.append(d)
        kept_bytes += n
        if n != ns.BLOCK_SIZE:
            break
    digest: str
    if not keep:
        digest = ns.EMPTY_DIGEST
    elif len(keep) == 1:
        digest = keep[0]
    else:
        h = hashlib.sha256()
        try:
            for d in keep:
                h.update(store.blobs.get(Digest(d)))
            digest = "sha256:" + h.hexdigest()
        except IntegrityError:
            keep, kept_bytes, digest = [], 0, ns.EMPTY_DIGEST
    names = ns.names_of(conn, ino)
    base = names[0][1] if names else b"unnamed"
    lf = _lost_found(conn)
    name = _free_name(conn, lf, b"%d-%s" % (ino, base))
    ns.drop_blocks(conn, ino)
    conn.executemany("INSERT INTO blocks (inode, blockno, blob) VALUES (?,?,?)",
                     [(ino, i, d) for i, d in enumerate(keep)])
    ns.forget_manifest(conn, ino)
    conn.execute("UPDATE inodes SET size=?, digest=?, ctime_ns=? WHERE id=?",
                 (kept_bytes, digest, ns.now_ns(), ino))
    if names:
        _relink(conn, ino, lf, name)
    else:
        conn.execute("INSERT INTO dentries (parent, name, inode) VALUES (?,?,?)", (lf, name, ino))
        conn.execute("UPDATE inodes SET nlink=1 WHERE id=?", (ino,))
    note = (f"{where}: {why}; moved here by pffs check --repair"
            f" on {time.strftime('%Y-%m-%d %H:%M:%S')}, keeping its first {kept_bytes}"
            f" of {node.size} bytes\n")
    conn.execute("INSERT OR REPLACE INTO xattrs (inode, name, value) VALUES (?,?,?)",
                 (ino, LOST_XATTR, note.encode()))
    _put_text(conn, store, lf, name + b".why", note)
    _say(result, say, f"{where}: {why}: moved to /lost+found/{name.decode(errors='replace')}"
                      f" (kept {kept_bytes} of {node.size} bytes)")


def _recover_after(conn: sqlite3.Connection, store: StoreDir, since: float, result: RepairResult,
                   say) -> None:
    """Blobs written after the restored snapshot become files in /lost+found/after-snapshot/.

    A blob that parses as a manifest becomes ``<hex>.manifest.json`` and its
    pages become gc roots again (with index rows), so a metadata-only fork
    brings the session back; every other such blob becomes a file ``<hex>``.
    """
    live = set(ns.iter_referenced_blobs(conn))
    cutoff = since - SNAPSHOT_SLACK if since else 0.0
    found: dict[Digest, int] = {}
    for d in store.blobs:
        if d in live:
            continue
        try:
            if store.blobs.path(d).stat().st_mtime < cutoff:
                continue
        except FileNotFoundError:
            continue
        row = _index_row(store, d)
        if row is not None:
            found[d] = row.raw_size
    if not found:
        return
    manifests: dict[str, mf.Manifest] = {}
    for d, raw in sorted(found.items()):
        if raw > mf.MAX_MANIFEST_BYTES:
            continue
        try:
            data = store.blobs.get(Digest(d))
        except IntegrityError:
            continue  # kept out of the namespace; check --read-data reports it as unreferenced
        if data[:1] != b"{":
            continue
        try:
            manifests[d] = mf.parse(data)
        except mf.ManifestError:
            pass
    listed = {p for m in manifests.values() for p in m.pages}
    lf = _lost_found(conn)
    dest = _subdir(conn, lf, AFTER_SNAPSHOT)
    n_files = 0
    for d, raw in sorted(found.items()):
        row = _index_row(store, d)
        if row is None:
            continue
        _insert_row(conn, row)
        if d in listed and d not in manifests:
            continue  # a page of a recovered manifest: a fork brings it back by name
        name = d[len("sha256:"):].encode() + (b".manifest.json" if d in manifests else b"")
        if ns.lookup(conn, dest, name) is not None:
            continue
        f = ns.make_inode(conn, dest, name, stat.S_IFREG | 0o600, 0, 0)
        ns.set_content(conn, f.id, raw, d, [d] if raw else [], [], None)
        if d in manifests:
            ns.record_manifest(conn, f.id, manifests[d].pages, d, ns.manifest_keys(manifests[d]))
        n_files += 1
    _say(result, say, f"{len(found)} blobs written after the snapshot were recovered:"
                      f" {len(manifests)} manifests and {n_files - len(manifests)} other files in"
                      f" /lost+found/after-snapshot/, {len(found) - n_files} pages listed by those manifests")


def _reindex(conn: sqlite3.Connection, store: StoreDir, report: fsck.Report, result: RepairResult,
             say) -> None:
    """The prefix index: key-only rows whose blob went are dropped; the keys of every
    recorded manifest are computed again where the check found them wrong or unbuilt."""
    n = conn.execute("DELETE FROM cached_keys WHERE digest NOT IN (SELECT digest FROM blobs)").rowcount
    if n:
        _say(result, say, f"dropped {n} key-only prefix cache rows whose blob is gone")
    if report.index_wrong or not prefix_index.is_built(conn):
        lists, keys = prefix_index.rebuild(
            conn, lambda ino: ns.read_file(conn, store.blobs, ino, mf.MAX_MANIFEST_BYTES))
        _say(result, say, f"rebuilt the prefix index: {keys} keys of {lists} manifests")
