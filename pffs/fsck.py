"""``pffs check``: namespace ↔ blobs consistency, sessions, and optionally every byte.

Damage (exit ≠ 0): a file naming a blob that is missing or corrupt, entries
naming missing inodes, wrong link counts, sizes that disagree with blocks.
Not damage (reported as notes): orphan blobs (gc's job), incomplete sessions
and sessions whose pages disagree with their manifest (the user's business,
SPEC §3.5).
"""

from __future__ import annotations

import sqlite3
import stat
from dataclasses import dataclass, field
from typing import Callable

from . import manifest as mf
from .errors import IntegrityError
from .namespace import BLOCK_SIZE, ROOT_INODE, path_of, read_file
from .store.local import LocalBlobStore
from .types import Digest


@dataclass
class Report:
    damage: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.damage


def check(conn: sqlite3.Connection, blobs: LocalBlobStore, *, read_data: bool = False,
          progress: Callable[[int, int], None] | None = None) -> Report:
    r = Report()
    on_disk = set(blobs)
    r.counts["blobs_on_disk"] = len(on_disk)
    known = {d: (raw, stored) for d, raw, stored in
             conn.execute("SELECT digest, raw_size, stored_size FROM blobs")}
    r.counts["blobs_indexed"] = len(known)
    held = {d for (d,) in conn.execute("SELECT DISTINCT blob FROM blocks")}
    listed = {d for (d,) in conn.execute("SELECT DISTINCT digest FROM manifest_pages")}

    # Files naming blobs that are not stored.
    bad_blobs: set[str] = set()
    for d in sorted(held - on_disk):
        bad_blobs.add(d)
        for (ino,) in conn.execute("SELECT DISTINCT inode FROM blocks WHERE blob=?", (d,)):
            r.damage.append(f"{path_of(conn, ino)}: blob {d} is missing")
    for d in sorted(held - set(known)):
        r.damage.append(f"blob {d} is held by a file but has no row in blobs")
    for d in sorted(set(known) - on_disk - held):
        r.notes.append(f"blob {d} is indexed but not stored (not held by any file)")
    orphans = on_disk - set(known)
    if orphans:
        r.notes.append(f"{len(orphans)} stored blobs are not indexed (left by interrupted writes; gc removes them)")
    garbage = set(known) - held - listed
    r.counts["garbage_blobs"] = len(garbage)

    # Every blob's header, and with read_data its bytes.
    todo = sorted(on_disk)
    for i, d in enumerate(todo):
        try:
            if read_data:
                raw = blobs.get(Digest(d))
                size = len(raw)
            else:
                size = blobs.header(Digest(d)).raw_len
            if d in known and known[d][0] != size:
                raise IntegrityError(d, f"holds {size} bytes, the index says {known[d][0]}")
        except IntegrityError as e:
            if d in held:
                bad_blobs.add(d)
                for (ino,) in conn.execute("SELECT DISTINCT inode FROM blocks WHERE blob=?", (d,)):
                    r.damage.append(f"{path_of(conn, ino)}: {e}")
            else:
                r.notes.append(f"unreferenced {e}")
        if progress:
            progress(i + 1, len(todo))

    # Entries and inodes.
    for (did, parent, name, ino) in conn.execute(
            "SELECT d.id, d.parent, d.name, d.inode FROM dentries d LEFT JOIN inodes i ON i.id = d.inode"
            " WHERE i.id IS NULL"):
        r.damage.append(f"entry {name!r} in directory {parent} names missing inode {ino}")
    for (did, parent, name) in conn.execute(
            "SELECT d.id, d.parent, d.name FROM dentries d LEFT JOIN inodes i ON i.id = d.parent"
            " WHERE i.id IS NULL OR (i.mode & 61440) != 16384"):
        r.damage.append(f"entry {name!r} sits in {parent}, which is not a directory")
    for ino, mode, nlink, names, subdirs in conn.execute(
            "SELECT i.id, i.mode, i.nlink,"
            " (SELECT COUNT(*) FROM dentries d WHERE d.inode = i.id),"
            " (SELECT COUNT(*) FROM dentries d JOIN inodes c ON c.id = d.inode"
            "   WHERE d.parent = i.id AND (c.mode & 61440) = 16384)"
            " FROM inodes i"):
        if stat.S_ISDIR(mode):
            want = 2 + subdirs
            if ino != ROOT_INODE and names != 1:
                r.damage.append(f"directory inode {ino} has {names} names")
        else:
            want = names
        if names == 0 and ino != ROOT_INODE:
            r.damage.append(f"inode {ino} has no name (orphan)")
        elif nlink != want:
            r.damage.append(f"{path_of(conn, ino)}: link count {nlink}, should be {want}")
    for ino, size, nblocks, total, maxno in conn.execute(
            "SELECT i.id, i.size, COUNT(b.blob), COALESCE(SUM(bl.raw_size), 0), MAX(b.blockno)"
            " FROM inodes i LEFT JOIN blocks b ON b.inode = i.id LEFT JOIN blobs bl ON bl.digest = b.blob"
            " WHERE (i.mode & 61440) = 32768 GROUP BY i.id"):
        want = -(-size // BLOCK_SIZE)
        if nblocks != want or (want and (maxno != want - 1 or total != size)):
            r.damage.append(f"{path_of(conn, ino)}: {nblocks} blocks of {total} bytes for a size of {size}")

    # Sessions (notes only).
    n_sessions = 0
    for dir_ino, ino, digest in conn.execute(
            "SELECT d.parent, d.inode, i.digest FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE d.name = ? AND (i.mode & 61440) = 32768", (mf.MANIFEST_NAME.encode(),)):
        n_sessions += 1
        r.notes.extend(check_session(conn, dir_ino, ino, blobs, bad_blobs))
    r.counts["sessions"] = n_sessions
    return r


def check_session(conn: sqlite3.Connection, dir_ino: int, man_ino: int,
                  blobs: LocalBlobStore, bad_blobs: set[str]) -> list[str]:
    """Notes on one session: invalid manifest, missing or disagreeing pages."""
    where = path_of(conn, dir_ino)
    try:
        m = mf.parse(read_file(conn, blobs, man_ino))
    except mf.ManifestError as e:
        return [f"session {where}: manifest.json is not valid ({e})"]
    except IntegrityError as e:
        return [f"session {where}: manifest.json unreadable ({e})"]
    row = conn.execute("SELECT d.inode FROM dentries d JOIN inodes i ON i.id = d.inode"
                       " WHERE d.parent=? AND d.name=? AND (i.mode & 61440) = 16384",
                       (dir_ino, mf.PAGES_DIR.encode())).fetchone()
    if row is None:
        return [f"session {where}: incomplete (no pages/ folder)"] if m.pages else []
    pages_ino = row[0]
    have = {}
    for name, digest, size in conn.execute(
            "SELECT d.name, i.digest, i.size FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE d.parent=? AND (i.mode & 61440) = 32768", (pages_ino,)):
        ix = mf.parse_page_name(name)
        if ix is not None:
            have[ix] = (digest, size)
    notes = []
    missing = [i for i in range(len(m.pages)) if i not in have]
    if missing:
        notes.append(f"session {where}: incomplete, {len(missing)} of {len(m.pages)} pages missing"
                     f" (first: {mf.page_name(missing[0])})")
    for i, want in enumerate(m.pages):
        if i in have:
            digest, size = have[i]
            if size != m.page_bytes:
                notes.append(f"session {where}: page {mf.page_name(i)} has {size} bytes,"
                             f" the geometry says {m.page_bytes}")
            elif digest != want:
                notes.append(f"session {where}: page {mf.page_name(i)} disagrees with manifest.json")
    extra = sorted(i for i in have if i >= len(m.pages))
    if extra:
        notes.append(f"session {where}: {len(extra)} page files beyond the manifest's {len(m.pages)}")
    return notes
