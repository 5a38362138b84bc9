"""Level t2, in process: check and repair called in the test's process, with no mount.
``pffs check`` and ``pffs check --repair`` (pffs.maint.check, pffs.maint.repair)
on stores built in the test with pffs.client.offline and then damaged behind
pffs's back: blobs deleted, corrupted or cut short, namespace rows naming
blobs that are not stored, stray blobs, a manifest lost or invalid, a page
list short of rows, broken names and links, a database that is not one.
Each case asserts what check reports, what repair says it did, and what the
store holds afterwards (docs/operations.md, "check and repair")."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest
from sessions import digest, make_manifest, varied_pages

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.client.offline import StoreSessionSink, StoreSessionSource
from pffs.maint.check import Report, check
from pffs.maint.repair import LOST_XATTR, RepairResult, database_damaged, repair
from pffs.maint.snapshots import take_snapshot
from pffs.store.local import LocalBlobStore
from pffs.store.storedir import StoreDir
from pffs.types import Digest

# -- building a store, damaging it, looking into it ----------------------------------


def write_session(root: Path, path: str, pages: list[bytes], seq_id: str = "req-1") -> bytes:
    """A session written straight into the unmounted store; its manifest's bytes."""
    sink = StoreSessionSink(root, path)
    for i, p in enumerate(pages):
        sink.write_page(i, p)
    man = make_manifest(pages, seq_id=seq_id).to_json()
    sink.write_manifest(man)
    sink.commit()
    return man


def write_file(root: Path, path: str, data: bytes) -> int:
    """An ordinary file of one block, its folders made, as a commit leaves it; its inode."""
    store = StoreDir(root)
    conn = ns.open_db(root)
    try:
        with ns.transaction(conn):
            *folders, name = path.strip("/").split("/")
            parent: int = ns.ROOT_INODE
            for part in folders:
                parent = ns.lookup(conn, parent, part.encode()) or ns.make_inode(
                    conn, parent, part.encode(), stat.S_IFDIR | 0o755, os.getuid(), os.getgid()).id
            r = store.blobs.put(data)
            f = ns.make_inode(conn, parent, name.encode(), stat.S_IFREG | 0o644, os.getuid(), os.getgid())
            ns.set_content(conn, f.id, len(data), r.digest, [r.digest] if data else [],
                           [ns.BlobRow(r.digest, len(data), r.stored_size, r.codec)], None)
        return f.id
    finally:
        conn.close()


def damage(root: Path, *statements: str, args: tuple = ()) -> None:
    """Change the namespace behind pffs's back, as damage would (plain sqlite3, no pffs code)."""
    conn = sqlite3.connect(root / ns.DB_NAME)
    try:
        for stmt in statements:
            conn.execute(stmt, args if "?" in stmt else ())
        conn.commit()
    finally:
        conn.close()


def blob_file(root: Path, data: bytes) -> Path:
    return StoreDir(root).blobs.path(Digest(digest(data)))


def run_check(root: Path, read_data: bool = False) -> Report:
    conn = ns.open_db(root, create_missing=False)
    try:
        blobs = StoreDir(root).blobs
        assert isinstance(blobs, LocalBlobStore)
        return check(conn, blobs, read_data=read_data)
    finally:
        conn.close()


def run_repair(root: Path, read_data: bool = False) -> tuple[RepairResult, Report]:
    """Repair under the store lock, as ``pffs check --repair`` does; the result and its check."""
    store = StoreDir(root)
    store.lock("pffs check --repair")
    try:
        result = repair(store, read_data=read_data)
    finally:
        store.unlock()
    assert result.report is not None
    return result, result.report


def resolve(conn: sqlite3.Connection, path: str) -> int | None:
    ino: int | None = ns.ROOT_INODE
    for part in path.strip("/").split("/"):
        if part and ino is not None:
            ino = ns.lookup(conn, ino, part.encode())
    return ino


def listdir(root: Path, path: str) -> list[str]:
    conn = ns.open_db(root, create_missing=False)
    try:
        ino = resolve(conn, path)
        assert ino is not None, path
        return sorted(n.decode() for (n,) in conn.execute("SELECT name FROM dentries WHERE parent=?", (ino,)))
    finally:
        conn.close()


def read(root: Path, path: str) -> bytes:
    conn = ns.open_db(root, create_missing=False)
    try:
        ino = resolve(conn, path)
        assert ino is not None, path
        return ns.read_file(conn, StoreDir(root).blobs, ino)
    finally:
        conn.close()


def lost_note(root: Path, path: str) -> str:
    """The reason repair gave a file it moved to lost+found (its xattr)."""
    conn = ns.open_db(root, create_missing=False)
    try:
        row = conn.execute("SELECT value FROM xattrs WHERE inode=? AND name=?",
                           (resolve(conn, path), LOST_XATTR)).fetchone()
        return bytes(row[0]).decode() if row else ""
    finally:
        conn.close()


def pages_of(root: Path, path: str, n: int) -> list[bytes]:
    src = StoreSessionSource(root, path)
    try:
        return [src.read_page(i) for i in range(n)]
    finally:
        src.close()


def page_ino(root: Path, session: str, ix: int) -> int:
    conn = ns.open_db(root, create_missing=False)
    try:
        ino = resolve(conn, f"{session}/pages/{mf.page_name(ix)}")
        assert ino is not None
        return ino
    finally:
        conn.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


# -- a sound store -------------------------------------------------------------------

def test_a_sound_store_checks_clean_and_repair_changes_nothing(root, bf16_pages):
    a, b = varied_pages(bf16_pages, 3, salt=1), varied_pages(bf16_pages, 2, salt=2)
    write_session(root, "team/a", a, seq_id="a")
    write_session(root, "b", b, seq_id="b")
    write_file(root, "notes.txt", b"hello")
    for read_data in (False, True):
        r = run_check(root, read_data)
        assert r.clean and r.damage == [] and r.notes == [] and r.bad_files == {}
        # 5 pages, 2 manifests, 1 file; every page full and keyed by its tokens.
        assert r.counts == {"blobs_on_disk": 8, "blobs_indexed": 8, "garbage_blobs": 0, "sessions": 2,
                            "prefix_keys": 5}
    result, after = run_repair(root, read_data=True)
    assert result.actions == [] and result.restored_snapshot is None
    assert after.clean and after.counts["blobs_on_disk"] == 8
    assert "lost+found" not in listdir(root, "/")
    assert pages_of(root, "team/a", 3) == a and read(root, "notes.txt") == b"hello"


# -- blobs damaged on disk -----------------------------------------------------------

def test_a_deleted_blob_is_damage_and_repair_moves_its_page_to_lost_found(root, bf16_pages):
    pages = varied_pages(bf16_pages, 4, salt=3)
    write_session(root, "s", pages)
    ino = page_ino(root, "s", 1)
    blob_file(root, pages[1]).unlink()

    r = run_check(root)   # the header check finds a missing blob already
    assert r.damage == [f"/s/pages/000001: blob {digest(pages[1])} is missing"]
    assert r.bad_files == {ino: f"blob {digest(pages[1])} is missing"}
    assert r.counts["blobs_on_disk"] == 4 and r.counts["blobs_indexed"] == 5

    result, after = run_repair(root)
    assert result.actions == [f"/s/pages/000001: blob {digest(pages[1])} is missing:"
                              f" moved to /lost+found/{ino}-000001 (kept 0 of {len(pages[1])} bytes)"]
    assert after.clean
    assert after.notes == ["session /s: incomplete, 1 of 4 pages missing (first: 000001)"]
    # The rest of the session reads as it was written; the damaged page waits in lost+found.
    assert listdir(root, "s/pages") == ["000000", "000002", "000003"]
    for i in (0, 2, 3):
        assert read(root, f"s/pages/{mf.page_name(i)}") == pages[i]
    assert listdir(root, "lost+found") == [f"{ino}-000001", f"{ino}-000001.why"]
    assert read(root, f"lost+found/{ino}-000001") == b""
    note = lost_note(root, f"lost+found/{ino}-000001")
    assert note.startswith(f"/s/pages/000001: blob {digest(pages[1])} is missing; moved here by")
    assert read(root, f"lost+found/{ino}-000001.why").decode() == note
    assert run_check(root).clean


@pytest.mark.parametrize("how, why", [("flip", "sha256 of the stored bytes does not match its name"),
                                      ("cut", "frame truncated")])
def test_a_corrupt_blob_is_found_reading_the_data_and_set_aside(root, bf16_pages, how, why):
    pages = varied_pages(bf16_pages, 3, salt=4)
    write_session(root, "s", pages)
    ino = page_ino(root, "s", 2)
    path = blob_file(root, pages[2])
    frame = bytearray(path.read_bytes())
    if how == "flip":
        frame[len(frame) // 2] ^= 0x01
    else:
        del frame[-100:]
    path.write_bytes(bytes(frame))

    # Without --read-data: the header, and the frame's size against its layout
    # (a cut planes frame is found so; a flipped byte needs the data read).
    assert run_check(root).clean == (how == "flip")
    r = run_check(root, read_data=True)
    assert len(r.damage) == 1
    assert r.damage[0].startswith(f"/s/pages/000002: blob {digest(pages[2])} ") and why in r.damage[0]

    result, after = run_repair(root, read_data=True)
    assert len(result.actions) == 2, result.actions
    assert result.actions[0].endswith(f"moved to /lost+found/{ino}-000002 (kept 0 of {len(pages[2])} bytes)")
    assert result.actions[1].startswith(f"moved corrupt blob {digest(pages[2])} (") \
        and result.actions[1].endswith(") to damaged/")
    assert after.clean and after.notes == ["session /s: incomplete, 1 of 3 pages missing (first: 000002)"]
    damaged = StoreDir(root).damaged_dir
    assert os.listdir(damaged) == [path.name] and (damaged / path.name).read_bytes() == bytes(frame)
    assert not path.exists()
    assert [read(root, f"s/pages/{mf.page_name(i)}") for i in (0, 1)] == pages[:2]

    # Written again, the page is stored afresh rather than found in the bad frame.
    write_session(root, "again", pages)
    assert path.exists() and path.read_bytes() != bytes(frame)
    assert pages_of(root, "again", 3) == pages
    assert run_check(root, read_data=True).clean


# -- namespace rows that disagree with the blobs ---------------------------------------

def test_a_row_naming_a_blob_never_stored_sends_its_file_to_lost_found(root, bf16_pages):
    write_session(root, "s", varied_pages(bf16_pages, 2, salt=5))
    ino = write_file(root, "f", b"the bytes of f")
    write_file(root, "g", b"the bytes of g")
    gone = digest(b"bytes no one stored")
    damage(root, "UPDATE blocks SET blob=? WHERE inode=?", args=(gone, ino))

    r = run_check(root)
    assert r.damage == [f"/f: blob {gone} is missing"]
    result, after = run_repair(root)
    assert result.actions == [f"/f: blob {gone} is missing: moved to /lost+found/{ino}-f (kept 0 of 14 bytes)"]
    assert after.clean and after.notes == []
    assert "f" not in listdir(root, "/") and read(root, f"lost+found/{ino}-f") == b""
    assert read(root, "g") == b"the bytes of g"


def test_an_index_row_of_the_wrong_length_is_damage(root, bf16_pages):
    pages = varied_pages(bf16_pages, 2, salt=6)
    write_session(root, "s", pages)
    ino = page_ino(root, "s", 0)
    damage(root, "UPDATE blobs SET raw_size = raw_size + 1 WHERE digest=?", args=(digest(pages[0]),))

    d, n = digest(pages[0]), len(pages[0])
    wrong = f"holds {n} bytes, the index says {n + 1}"

    r = run_check(root)
    assert r.damage == [f"/s/pages/000000: blob {d} {wrong}"]
    result, after = run_repair(root)
    assert result.actions == [f"/s/pages/000000: blob {d} {wrong}: moved to /lost+found/{ino}-000000"
                              f" (kept 0 of {n} bytes)",
                              f"moved corrupt blob {d} ({wrong}) to damaged/"]
    assert after.clean
    assert after.notes == ["session /s: incomplete, 1 of 2 pages missing (first: 000000)"]
    # The blob goes aside with its wrong row, as a corrupt one does (a write stores it afresh).
    path = blob_file(root, pages[0])
    assert os.listdir(StoreDir(root).damaged_dir) == [path.name] and not path.exists()
    assert read(root, "s/pages/000001") == pages[1]


def test_blobs_and_index_rows_nothing_holds_are_notes_and_only_corrupt_ones_move(root, bf16_pages):
    pages = varied_pages(bf16_pages, 2, salt=7)
    write_session(root, "s", pages)
    store = StoreDir(root)
    stray = store.blobs.put(b"a blob no row names")          # an interrupted write's leftover
    spoilt = store.blobs.put(b"another blob no row names")
    spoilt_path = store.blobs.path(spoilt.digest)
    frame = bytearray(spoilt_path.read_bytes())
    frame[-1] ^= 0x01
    spoilt_path.write_bytes(bytes(frame))
    ghost = digest(b"indexed, never stored")
    damage(root, "INSERT INTO blobs (digest, raw_size, stored_size, codec, created_ns)"
                 " VALUES (?, 21, 30, 'raw', 0)", args=(ghost,))

    r = run_check(root, read_data=True)
    assert r.clean, r.damage
    assert f"blob {ghost} is indexed but not stored (not held by any file)" in r.notes
    assert any(n.startswith(f"unreferenced blob {spoilt.digest} ") for n in r.notes)
    assert "2 stored blobs are not indexed (left by interrupted writes; gc removes them)" in r.notes
    assert len(r.notes) == 3

    result, after = run_repair(root, read_data=True)
    assert result.actions[0].startswith(f"moved corrupt blob {spoilt.digest} (")
    assert result.actions[1:] == ["dropped 1 index rows of blobs that are not stored"]
    assert os.listdir(store.damaged_dir) == [spoilt_path.name]
    # The intact stray blob is gc's to remove, not repair's.
    assert store.blobs.get(stray.digest) == b"a blob no row names"
    assert after.clean
    assert after.notes == ["1 stored blobs are not indexed (left by interrupted writes; gc removes them)"]
    assert pages_of(root, "s", 2) == pages


# -- manifests -----------------------------------------------------------------------

def test_a_lost_manifest_goes_to_lost_found_and_the_pages_stay(root, bf16_pages):
    pages = varied_pages(bf16_pages, 3, salt=8)
    man = write_session(root, "s", pages)
    conn = ns.open_db(root, create_missing=False)
    man_ino = resolve(conn, "s/manifest.json")
    conn.close()
    blob_file(root, man).unlink()

    r = run_check(root)
    assert r.damage == [f"/s/manifest.json: blob {digest(man)} is missing"]
    assert r.counts["sessions"] == 1
    result, after = run_repair(root)
    assert result.actions == [f"/s/manifest.json: blob {digest(man)} is missing: moved to"
                              f" /lost+found/{man_ino}-manifest.json (kept 0 of {len(man)} bytes)"]
    assert after.clean and after.counts["sessions"] == 0
    assert listdir(root, "s") == ["pages"]
    assert [read(root, f"s/pages/{mf.page_name(i)}") for i in range(3)] == pages
    conn = ns.open_db(root, create_missing=False)
    try:   # no longer a manifest: its page list no longer holds the pages for gc
        assert conn.execute("SELECT COUNT(*) FROM manifests").fetchone()[0] == 0
    finally:
        conn.close()


def test_an_invalid_manifest_and_a_disagreeing_page_are_notes_and_left_as_written(root, bf16_pages):
    pages = varied_pages(bf16_pages, 2, salt=9)
    write_session(root, "s", pages)
    # What a mount would refuse or leave to the user, put there behind its back:
    # a page rewritten with other bytes, and a manifest.json that is no manifest.
    other = varied_pages(bf16_pages, 1, salt=10)[0]
    conn = ns.open_db(root, create_missing=False)
    try:
        store = StoreDir(root)
        with ns.transaction(conn):
            put = store.blobs.put(other)
            ino = resolve(conn, "s/pages/000001")
            assert ino is not None
            ns.set_content(conn, ino, len(other), put.digest, [put.digest],
                           [ns.BlobRow(put.digest, len(other), put.stored_size, put.codec)], None)
    finally:
        conn.close()
    bad = b'{"layout": "nonsense"}'
    write_file(root, "t/manifest.json", bad)

    r = run_check(root)
    assert r.clean, r.damage
    assert r.notes[0] == "session /s: page 000001 disagrees with manifest.json"
    assert r.notes[1].startswith("session /t: manifest.json is not valid (")
    assert len(r.notes) == 2 and r.counts["sessions"] == 2
    result, after = run_repair(root)
    assert result.actions == [] and after.notes == r.notes
    # pffs never rewrites a user's file.
    assert read(root, "t/manifest.json") == bad and read(root, "s/pages/000001") == other


def test_a_page_list_short_of_rows_is_recorded_again_from_the_manifests_bytes(root, bf16_pages):
    pages = varied_pages(bf16_pages, 4, salt=11)
    man = write_session(root, "s", pages)
    damage(root, "DELETE FROM manifest_pages WHERE manifest=? AND page_ix >= 2", args=(digest(man),))

    r = run_check(root)
    assert r.damage == ["/s/manifest.json: the page list recorded for its bytes has 2 rows for its 4 pages"
                        " (gc keeps a session's pages through it)"]
    result, after = run_repair(root)
    assert result.actions == ["/s/manifest.json: recorded the page list of its bytes again (4 pages)"]
    assert after.clean
    conn = ns.open_db(root, create_missing=False)
    try:
        assert ns.recorded_pages(conn, digest(man)) == [digest(p) for p in pages]
    finally:
        conn.close()


# -- names and links -----------------------------------------------------------------

def test_broken_names_and_links_are_mended_without_losing_a_file(root, bf16_pages):
    pages = varied_pages(bf16_pages, 2, salt=12)
    write_session(root, "s", pages)
    orphan = write_file(root, "g", b"keep me")
    conn = ns.open_db(root, create_missing=False)
    man_ino = resolve(conn, "s/manifest.json")
    conn.close()
    damage(root,
           f"UPDATE inodes SET nlink=7 WHERE id={man_ino}",
           "DELETE FROM dentries WHERE parent=1 AND name=CAST('g' AS BLOB)",
           "INSERT INTO dentries (parent, name, inode) VALUES (1, CAST('ghost' AS BLOB), 99999)",
           "INSERT INTO xattrs (inode, name, value) VALUES (88888, CAST('user.x' AS BLOB), CAST('y' AS BLOB))")

    r = run_check(root)
    for what in ("/s/manifest.json: link count 7, should be 1", f"inode {orphan} has no name (orphan)",
                 "entry b'ghost' in / names missing inode 99999",
                 "1 xattrs rows belong to inodes that do not exist"):
        assert what in r.damage, (what, r.damage)
    assert len(r.damage) == 4, r.damage

    result, after = run_repair(root)
    assert after.clean, after.damage
    assert f"inode {orphan} had no name: now /lost+found/#{orphan}" in result.actions
    assert "dropped entry b'ghost' in / (inode 99999 does not exist)" in result.actions
    assert "/s/manifest.json: link count 7 set to 1" in result.actions
    assert read(root, f"lost+found/#{orphan}") == b"keep me"
    assert "ghost" not in listdir(root, "/")
    assert pages_of(root, "s", 2) == pages


# -- the database itself -------------------------------------------------------------

def test_a_damaged_database_is_replaced_by_its_snapshot_and_later_sessions_are_recovered(root, bf16_pages):
    a, b = varied_pages(bf16_pages, 3, salt=13), varied_pages(bf16_pages, 4, salt=14)
    write_session(root, "a", a, seq_id="a")
    store = StoreDir(root)
    conn = ns.open_db(root, create_missing=False)
    snap = take_snapshot(conn, store.snapshot_dir)     # holds a, not b
    conn.close()
    man_b = write_session(root, "b", b, seq_id="b")
    with open(store.db_path, "r+b") as f:
        f.write(os.urandom(4096))

    why = database_damaged(store)
    assert why is not None and "not a readable namespace database" in why
    with pytest.raises(ns.DamagedDatabase):
        ns.open_db(root, create_missing=False)

    result, after = run_repair(root)
    assert result.restored_snapshot == snap
    assert f"restored the namespace from snapshot {snap.name}" in result.actions
    assert ("5 blobs written after the snapshot were recovered: 1 manifests and 0 other files in"
            " /lost+found/after-snapshot/, 4 pages listed by those manifests") in result.actions
    assert len([p for p in root.iterdir() if p.name.startswith("namespace.db.damaged-")]) == 1
    assert after.clean and after.counts["sessions"] == 1
    assert pages_of(root, "a", 3) == a and "b" not in listdir(root, "/")
    hexname = digest(man_b)[len("sha256:"):] + ".manifest.json"
    assert listdir(root, "lost+found/after-snapshot") == [hexname]
    assert read(root, f"lost+found/after-snapshot/{hexname}") == man_b

    # b's pages are gc roots again, and a metadata-only fork brings b back whole.
    conn = ns.open_db(root, create_missing=False)
    try:
        assert {digest(p) for p in b} <= set(ns.iter_referenced_blobs(conn))
        with ns.transaction(conn):
            d = ns.make_inode(conn, ns.ROOT_INODE, b"b2", stat.S_IFDIR | 0o755, 0, 0).id
            ns.make_inode(conn, d, b"pages", stat.S_IFDIR | 0o755, 0, 0)
            assert ns.fork_pages(conn, d, digest(man_b), 0, 0) != []
    finally:
        conn.close()
    assert pages_of(root, "b2", 4) == b


def test_without_a_snapshot_a_fresh_namespace_recovers_every_session(root, bf16_pages):
    a, b = varied_pages(bf16_pages, 2, salt=15), varied_pages(bf16_pages, 3, salt=16)
    man_a = write_session(root, "a", a, seq_id="a")
    man_b = write_session(root, "team/b", b, seq_id="b")
    store = StoreDir(root)
    for suffix in ("", "-wal", "-shm"):
        Path(str(store.db_path) + suffix).unlink(missing_ok=True)
    assert not any(store.snapshot_dir.glob("namespace-*"))

    result, after = run_repair(root)
    assert result.restored_snapshot is None
    assert result.actions[:2] == ["namespace database is damaged: no namespace database",
                                  "no good snapshot: started a fresh namespace; every blob goes to /lost+found"]
    assert result.actions[2:] == ["7 blobs written after the snapshot were recovered: 2 manifests and 0 other"
                                  " files in /lost+found/after-snapshot/, 5 pages listed by those manifests"]
    assert after.clean
    assert listdir(root, "/") == ["lost+found"]
    assert listdir(root, "lost+found/after-snapshot") == sorted(
        digest(m)[len("sha256:"):] + ".manifest.json" for m in (man_a, man_b))
