"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Store lifecycle on real mounts: gc, prune, check and repair, snapshots, schema versions.

contract §3.7–3.8, §4 (gc roots, repair path), §6 (gc, check --repair).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from lifecycle_helpers import copy_file, gc, run, stats
from mountutil import pffs, wait_for
from pffs import manifest as mf
from pffs import namespace as ns
from pffs.store.storedir import StoreDir
from sessions import digest, make_manifest, varied_pages, write_session


def cp_session(src, dst) -> None:
    run("cp", "-r", src, dst)


def blob_path(store, data: bytes):
    return StoreDir(store).blobs.path(digest(data))


# -- gc ------------------------------------------------------------------------


def forgotten(m) -> None:
    """Wait until the kernel has let go of every removed file: an unlinked
    inode holds its blobs until the kernel's FORGET, which it sends when it
    will (later on a busy host), so gc right after rm would keep them."""
    def none_left() -> bool:
        c = sqlite3.connect(f"file:{m.store / 'namespace.db'}?mode=ro", uri=True)
        try:
            return c.execute("SELECT COUNT(*) FROM inodes WHERE nlink = 0").fetchone()[0] == 0
        finally:
            c.close()
    wait_for(none_left, what="the removed files to be forgotten")

def test_gc_frees_exactly_deleted_sessions_and_keeps_listed_pages(mnt, bf16_pages, tmp_path):
    a, b, d = (varied_pages(bf16_pages, n, salt=s) for n, s in ((8, 1), (6, 2), (5, 3)))
    for name, pages in (("a", a), ("b", b), ("d", d)):
        write_session(tmp_path / name, pages, seq_id=name)
    s0 = stats(mnt.path)
    cp_session(tmp_path / "a", mnt / "a")
    s1 = stats(mnt.path)
    cp_session(tmp_path / "b", mnt / "b")
    cp_session(tmp_path / "d", mnt / "d")
    s2 = stats(mnt.path)
    a_blobs = s1["unique_blobs"] - s0["unique_blobs"]
    a_bytes = s1["stored_bytes"] - s0["stored_bytes"]
    assert a_blobs == len(a) + 1  # its pages and its manifest

    run("rm", "-r", mnt / "a")
    run("rm", "-r", mnt / "d" / "pages")  # d's manifest still lists its pages: gc roots
    forgotten(mnt)
    dry = gc(mnt.store, "--dry-run")
    assert f"would remove {a_blobs} blobs ({a_bytes} bytes)" in dry
    assert stats(mnt.path)["unique_blobs"] == s2["unique_blobs"]

    out = gc(mnt.store)
    assert f"removed {a_blobs} blobs ({a_bytes} bytes)" in out
    s3 = stats(mnt.path)
    assert s3["unique_blobs"] == s2["unique_blobs"] - a_blobs
    assert s3["stored_bytes"] == s2["stored_bytes"] - a_bytes
    for p in a:
        assert not blob_path(mnt.store, p).exists()
    for p in d:
        assert blob_path(mnt.store, p).exists()
    assert "removed 0 blobs" in gc(mnt.store)

    # The kept pages come back by metadata-only fork, byte for byte.
    (mnt / "e" / "pages").mkdir(parents=True)
    run("cp", mnt / "d" / "manifest.json", mnt / "e" / "manifest.json")
    assert [(mnt / "e" / "pages" / mf.page_name(i)).read_bytes() for i in range(len(d))] == d
    assert [(mnt / "b" / "pages" / mf.page_name(i)).read_bytes() for i in range(len(b))] == b


def test_gc_offline_sweeps_leftovers_after_the_grace_period(mount_factory, bf16_pages, tmp_path):
    m = mount_factory()
    keep = varied_pages(bf16_pages, 3, salt=4)
    write_session(tmp_path / "k", keep)
    cp_session(tmp_path / "k", m / "k")
    assert m.stop() == 0
    st = StoreDir(m.store)
    old, young = varied_pages(bf16_pages, 2, salt=5)
    # Blobs no row names (an interrupted write) and a temp file: one old, one young.
    st.blobs.put(old)
    st.blobs.put(young)
    tmp = st.blobs.path(digest(old)).parent / ".tmp-0123456789abcdef-1-00000000"
    tmp.write_bytes(b"half a frame")
    hour_ago = time.time() - 3600
    for p in (st.blobs.path(digest(old)), tmp):
        os.utime(p, (hour_ago, hour_ago))
    out = pffs("gc", "--store", m.store, "--grace", "10m").stdout
    assert "removed 1 blobs" in out and "1 unnamed blobs younger than the grace period kept" in out
    assert "removed 1 temp files" in out
    assert not st.blobs.path(digest(old)).exists() and not tmp.exists()
    assert st.blobs.path(digest(young)).exists()
    assert all(st.blobs.path(digest(p)).exists() for p in keep)
    # A dedup hit refreshes the blob's mtime, so the grace period counts from it.
    os.utime(st.blobs.path(digest(young)), (hour_ago, hour_ago))
    st.blobs.put(young)
    assert st.blobs.path(digest(young)).stat().st_mtime > time.time() - 60
    m.start()
    assert [(m / "k" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == keep


def test_gc_refuses_a_store_being_checked(mount_factory, tmp_path):
    m = mount_factory(start=False)
    StoreDir(m.store).create()
    ns.open_db(m.store).close()
    holder = StoreDir(m.store)
    holder.lock("pffs check")
    try:
        r = pffs("gc", "--store", m.store, check=False)
    finally:
        holder.unlock()
    assert r.returncode == 1 and "in use (pffs check" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# -- prune ---------------------------------------------------------------------

def test_prune_older_than_and_keep_last(mnt, bf16_pages, tmp_path):
    now = time.time()
    layout = {"old1": 9, "team/old2": 3, "team/x/new1": 0.01, "new2": 0.02, "team/new3": 0.03}
    pages = {}
    for k, (rel, days) in enumerate(layout.items()):
        pages[rel] = varied_pages(bf16_pages, 2, salt=10 + k)
        write_session(tmp_path / "src" / rel, pages[rel], seq_id=f"s{k}")
        (mnt / rel).parent.mkdir(parents=True, exist_ok=True)
        cp_session(tmp_path / "src" / rel, mnt / rel)
        t = now - days * 86400
        os.utime(mnt / rel / "manifest.json", (t, t))
    (mnt / "plain").mkdir()
    (mnt / "plain" / "notes.txt").write_text("not a session\n")
    before = stats(mnt.path)

    r = pffs("prune", mnt.path, "--older-than", "1d", "--dry-run")
    assert "would remove" in r.stdout
    assert str(mnt / "old1") in r.stdout and str(mnt / "team" / "old2") in r.stdout
    assert (mnt / "old1").exists() and stats(mnt.path)["unique_blobs"] == before["unique_blobs"]

    r = pffs("prune", mnt.path, "--older-than", "1d", "--grace", "0")
    assert f"removing {mnt / 'old1'}" in r.stdout and f"removing {mnt / 'team' / 'old2'}" in r.stdout
    assert "2 of 5 sessions removed" in r.stdout and "gc: removed 6 blobs" in r.stdout
    assert not (mnt / "old1").exists() and not (mnt / "team" / "old2").exists()
    after = stats(mnt.path)
    assert after["sessions"] == 3 and after["unique_blobs"] == before["unique_blobs"] - 6

    # Newest by manifest mtime under team/: x/new1, then new3.
    r = pffs("prune", mnt / "team", "--keep-last", "1", "--grace", "0")
    assert "1 of 2 sessions removed" in r.stdout
    assert (mnt / "team" / "x" / "new1").exists() and not (mnt / "team" / "new3").exists()
    assert (mnt / "plain" / "notes.txt").exists() and (mnt / "new2").exists()
    for rel in ("team/x/new1", "new2"):
        assert [(mnt / rel / "pages" / mf.page_name(i)).read_bytes() for i in range(2)] == pages[rel]


def test_prune_errors_are_one_line(mnt, tmp_path):
    for args in (("--keep-last", "1", tmp_path), ("--older-than", "soon", mnt.path)):
        r = pffs("prune", *args, check=False)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- schema --------------------------------------------------------------------

def test_newer_schema_is_refused_by_mount_check_and_gc(tmp_path):
    store = tmp_path / "store"
    StoreDir(store).create()
    conn = ns.open_db(store)
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(ns.SCHEMA_VERSION + 1),))
    conn.close()
    mp = tmp_path / "mnt"
    mp.mkdir()
    for args in (("check", "--store", store), ("gc", "--store", store), ("mount", "--store", store, mp)):
        r = pffs(*args, check=False, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (args, r.stderr)
        assert f"schema version {ns.SCHEMA_VERSION + 1} is newer than this pffs" in lines[0]
    assert not os.path.ismount(mp)


# The tables of schemas 1 and 2 that schema 3 changed: page lists were rows
# of each manifest file's inode.
SCHEMA_2_MANIFESTS = [
    "CREATE TABLE manifest_pages_2 (inode INTEGER NOT NULL REFERENCES inodes(id), page_ix INTEGER NOT NULL,"
    " digest TEXT NOT NULL, PRIMARY KEY (inode, page_ix)) WITHOUT ROWID",
    "INSERT INTO manifest_pages_2 SELECT m.inode, p.page_ix, p.digest FROM manifests m"
    " JOIN manifest_pages p ON p.manifest = m.digest",
    "CREATE TABLE manifests_2 (inode INTEGER PRIMARY KEY REFERENCES inodes(id), n_pages INTEGER NOT NULL)",
    "INSERT INTO manifests_2 SELECT inode, n_pages FROM manifests",
    "DROP TABLE manifest_pages",
    "DROP TABLE manifests",
    "ALTER TABLE manifest_pages_2 RENAME TO manifest_pages",
    "ALTER TABLE manifests_2 RENAME TO manifests",
    "CREATE INDEX manifest_pages_digest ON manifest_pages(digest)",
]
# Schema 3's blocks: no via column (a fork's rows indexed by blob like any), no pagesets.
SCHEMA_3_BLOCKS = [
    "CREATE TABLE blocks_3 (inode INTEGER NOT NULL REFERENCES inodes(id), blockno INTEGER NOT NULL,"
    " blob TEXT NOT NULL REFERENCES blobs(digest), PRIMARY KEY (inode, blockno)) WITHOUT ROWID",
    "INSERT INTO blocks_3 SELECT inode, blockno, blob FROM blocks",
    "DROP TABLE blocks",
    "ALTER TABLE blocks_3 RENAME TO blocks",
    "CREATE INDEX blocks_blob ON blocks(blob)",
    "DROP TABLE pagesets",
]
# Schema 4 had no folded forks.
SCHEMA_4_FOLDS = ["DROP TABLE folds"]
SCHEMA_5_WHOLE_LISTS = ["DROP TABLE whole_lists"]
SCHEMA_6_READDIR = ["DROP INDEX dentries_parent_id"]
SCHEMA_8_PREFIX = ["DROP TABLE key_spaces", "DROP TABLE cached_keys",
                   "DELETE FROM meta WHERE key='prefix_index'"]


def test_a_schema_1_store_is_migrated_by_a_mount(mount_factory, bf16_pages, tmp_path):
    """Schema 1 had an index of names across directories (dentries_name);
    schemas 1 and 2 kept a page list per manifest file, schema 3 one per
    manifest's bytes; schemas 1-3 indexed every blocks row by blob; schemas
    1-4 made a fork's page files at once (no folds); schemas 1-5 did not
    remember which page lists were found whole; schemas 1-6 had no index of a
    folder's entries in cookie order; schemas 1-8 had no prefix index."""
    m = mount_factory()
    pages = varied_pages(bf16_pages, 3, salt=55)
    write_session(tmp_path / "s", pages)
    cp_session(tmp_path / "s", m / "s")
    pffs("fork", m / "s", m / "f")
    assert len(os.listdir(m / "f" / "pages")) == 3  # (unfolded: the rows a fork made before)
    assert m.stop() == 0
    conn = sqlite3.connect(m.store / "namespace.db")
    for stmt in ["CREATE INDEX dentries_name ON dentries(name)", *SCHEMA_2_MANIFESTS, *SCHEMA_3_BLOCKS,
                 *SCHEMA_4_FOLDS, *SCHEMA_5_WHOLE_LISTS, *SCHEMA_6_READDIR, *SCHEMA_8_PREFIX]:
        conn.execute(stmt)
    conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    conn.commit()
    assert conn.execute("SELECT COUNT(*) FROM manifest_pages").fetchone()[0] == 6
    conn.close()
    with pytest.raises(ns.SchemaError, match="mount the store once to upgrade it"):
        ns.open_db(m.store, readonly=True)  # (a read-only open cannot migrate)

    def schema():
        c = sqlite3.connect(m.store / "namespace.db")
        try:
            return (c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0],
                    c.execute("SELECT COUNT(*) FROM sqlite_master WHERE name='dentries_name'").fetchone()[0],
                    c.execute("SELECT COUNT(*) FROM manifests").fetchone()[0],
                    c.execute("SELECT page_ix, digest FROM manifest_pages ORDER BY page_ix").fetchall())
        finally:
            c.close()
    m.start()  # migrates
    for s in ("s", "f"):
        assert [(m / s / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == pages
    assert stats(m.path)["sessions"] == 2
    pffs("fork", m / "f", m / "g")
    assert [(m / "g" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == pages
    assert m.stop() == 0
    assert schema() == (str(ns.SCHEMA_VERSION), 0, 3, [(i, digest(p)) for i, p in enumerate(pages)])
    c = sqlite3.connect(m.store / "namespace.db")
    assert c.execute("SELECT COUNT(*) FROM sqlite_master WHERE name='dentries_parent_id'").fetchone()[0] == 1
    assert c.execute("SELECT value FROM meta WHERE key='prefix_index'").fetchone() == ("1",)  # (built at mount)
    # f's pages (forked under schema 3) stay indexed by blob; g's were forked since.
    assert c.execute("SELECT COUNT(*), COUNT(via) FROM blocks").fetchone() == (3 + 3 + 3 + 3, 3)
    c.close()
    assert "3 sessions" in pffs("check", "--store", m.store, "--read-data").stdout


# -- check and repair ------------------------------------------------------------

def test_damaged_blobs_give_eio_and_repair_isolates_them(mount_factory, bf16_pages, tmp_path):
    m = mount_factory()
    m.allow(r"ERROR pffs.fs: read /s/pages/00000[123]: blob sha256:")
    m.allow(r"WARNING pffs.store: blob sha256:[0-9a-f]+ is damaged")
    pages = varied_pages(bf16_pages, 6, salt=20)
    write_session(tmp_path / "s", pages)
    cp_session(tmp_path / "s", m / "s")
    assert m.stop() == 0

    flipped, truncated, deleted = (blob_path(m.store, pages[i]) for i in (1, 2, 3))
    frame = bytearray(flipped.read_bytes())
    frame[len(frame) // 2] ^= 0x01
    flipped.write_bytes(frame)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    deleted.unlink()

    m.start()
    for i in (1, 2, 3):
        with pytest.raises(OSError) as ei:
            (m / "s" / "pages" / mf.page_name(i)).read_bytes()
        assert ei.value.errno == errno.EIO
        assert digest(pages[i]) in m.log_text()
    for i in (0, 4, 5):
        assert (m / "s" / "pages" / mf.page_name(i)).read_bytes() == pages[i]
    assert m.proc.poll() is None
    assert m.stop() == 0

    r = pffs("check", "--store", m.store, check=False)  # headers only: finds the deleted blob
    assert r.returncode == 1 and "/s/pages/000003" in r.stdout and "is missing" in r.stdout
    r = pffs("check", "--store", m.store, "--read-data", check=False)
    assert r.returncode == 1
    for i in (1, 2, 3):
        assert f"DAMAGE: /s/pages/{mf.page_name(i)}: blob {digest(pages[i])}" in r.stdout

    r = pffs("check", "--store", m.store, "--read-data", "--repair", check=False)
    assert r.returncode == 0, r.stdout
    assert r.stdout.count("moved to /lost+found/") == 3 and "0 damaged after repair" in r.stdout
    r = pffs("check", "--store", m.store, "--read-data")
    assert "incomplete, 3 of 6 pages missing" in r.stdout

    m.start()
    assert sorted(os.listdir(m / "s" / "pages")) == [mf.page_name(i) for i in (0, 4, 5)]
    for i in (0, 4, 5):
        assert (m / "s" / "pages" / mf.page_name(i)).read_bytes() == pages[i]
    lost = sorted(os.listdir(m / "lost+found"))
    assert len(lost) == 6 and sum(n.endswith(".why") for n in lost) == 3
    for n in lost:
        if not n.endswith(".why"):
            why = os.getxattr(m / "lost+found" / n, "user.pffs.lost").decode()
            assert "/s/pages/00000" in why and why == (m / "lost+found" / (n + ".why")).read_text()
            assert (m / "lost+found" / n).read_bytes() == b""
    # Written again, the pages are stored afresh (the corrupt frames were set aside).
    for i in (1, 2, 3):
        copy_file(tmp_path / "s" / "pages" / mf.page_name(i), m / "s" / "pages" / mf.page_name(i))
    for i in range(6):
        assert (m / "s" / "pages" / mf.page_name(i)).read_bytes() == pages[i]
    assert sorted(os.listdir(m.store / "damaged")) == sorted(p.name for p in (flipped, truncated))


def test_repair_restores_the_newest_snapshot_and_recovers_later_sessions(mount_factory, bf16_pages,
                                                                          tmp_path):
    m = mount_factory()
    m.allow(r"mount .* failed: .*not a readable namespace database")
    a, b = varied_pages(bf16_pages, 4, salt=30), varied_pages(bf16_pages, 5, salt=31)
    write_session(tmp_path / "a", a, seq_id="a")
    write_session(tmp_path / "b", b, seq_id="b")
    cp_session(tmp_path / "a", m / "a")
    assert m.stop() == 0          # the unmount takes a snapshot holding a
    m.start()
    cp_session(tmp_path / "b", m / "b")
    m.kill9()                     # b is in the database, in no snapshot
    with open(m.store / "namespace.db", "r+b") as f:
        f.write(os.urandom(4096))

    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1 and "not a readable namespace database" in r.stdout
    r = pffs("mount", "--store", m.store, m.path, check=False, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "not a readable namespace database" in r.stderr

    r = pffs("check", "--store", m.store, "--repair", check=False)
    assert r.returncode == 0, r.stdout
    assert "restored the namespace from snapshot namespace-" in r.stdout
    assert "1 manifests" in r.stdout
    assert any(p.name.startswith("namespace.db.damaged-") for p in m.store.iterdir())

    m.start()
    assert [(m / "a" / "pages" / mf.page_name(i)).read_bytes() for i in range(4)] == a
    assert not (m / "b").exists()
    rec = m / "lost+found" / "after-snapshot"
    names = os.listdir(rec)
    man = [n for n in names if n.endswith(".manifest.json")]
    assert man == [digest((tmp_path / "b" / "manifest.json").read_bytes())[7:] + ".manifest.json"]
    # Session b comes back by metadata-only fork from its recovered manifest.
    (m / "b2" / "pages").mkdir(parents=True)
    copy_file(rec / man[0], m / "b2" / "manifest.json")
    assert [(m / "b2" / "pages" / mf.page_name(i)).read_bytes() for i in range(5)] == b


def test_repair_fixes_structure_without_losing_files(mount_factory, bf16_pages, tmp_path):
    m = mount_factory()
    pages = varied_pages(bf16_pages, 3, salt=40)
    write_session(tmp_path / "s", pages)
    cp_session(tmp_path / "s", m / "s")
    (m / "d1" / "d2").mkdir(parents=True)
    (m / "d1" / "d2" / "f").write_bytes(b"keep me")
    (m / "g").write_bytes(b"and me")
    pffs("fork", m / "s", m / "t")
    assert m.stop() == 0
    conn = sqlite3.connect(m.store / "namespace.db")
    ino = lambda parent, name: conn.execute(  # noqa: E731
        "SELECT inode FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone()[0]
    d1 = ino(1, b"d1")
    g = ino(1, b"g")
    s = ino(1, b"s")
    conn.execute("UPDATE inodes SET nlink=7 WHERE id=?", (ino(s, b"manifest.json"),))
    conn.execute("DELETE FROM dentries WHERE parent=1 AND name=?", (b"g",))            # orphan file
    conn.execute("UPDATE dentries SET parent=? WHERE parent=1 AND name=?", (ino(d1, b"d2"), b"d1"))  # cycle
    conn.execute("INSERT INTO dentries (parent, name, inode) VALUES (1, ?, 99999)", (b"ghost",))
    conn.execute("INSERT INTO xattrs (inode, name, value) VALUES (88888, ?, ?)", (b"user.x", b"y"))
    conn.execute("INSERT INTO manifest_pages (manifest, page_ix, digest) VALUES ('sha256:gone', 0, ?)",
                 (digest(pages[0]),))
    conn.execute("UPDATE manifests SET digest='sha256:other' WHERE inode=?", (ino(ino(1, b"t"), b"manifest.json"),))
    conn.commit()
    conn.close()

    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1
    for what in ("link count 7, should be 1", f"inode {g} has no name", "cannot be reached from the root",
                 "names missing inode 99999", "1 xattrs rows belong to inodes that do not exist",
                 "1 manifest_pages rows belong to manifests no file holds",
                 "1 manifests rows name bytes their files no longer hold"):
        assert what in r.stdout, what
    r = pffs("check", "--store", m.store, "--repair", check=False)
    assert r.returncode == 0, r.stdout
    m.start()
    lf = m / "lost+found"
    assert (lf / f"#{g}").read_bytes() == b"and me"
    assert (lf / f"#{d1}" / "d2" / "f").read_bytes() == b"keep me"
    assert [(m / "s" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == pages
    assert os.stat(m / "s" / "manifest.json").st_nlink == 1
    assert not os.path.lexists(m / "ghost")
    # t's manifest is no longer recorded (its row named other bytes); its files are all there.
    assert [(m / "t" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == pages
    assert stats(m.path)["sessions"] == 1
    assert m.stop() == 0
    assert pffs("check", "--store", m.store, check=False).returncode == 0


def damage(store, *statements: str) -> None:
    """Change an unmounted store's namespace behind pffs's back, as damage would."""
    conn = sqlite3.connect(store / "namespace.db")
    try:
        for stmt in statements:
            conn.execute(stmt)
        conn.commit()
    finally:
        conn.close()


def test_check_finds_a_page_list_wrongly_called_whole_and_repair_drops_it(mount_factory, bf16_pages,
                                                                          tmp_path):
    m = mount_factory()
    pages = varied_pages(bf16_pages, 4, salt=61)
    write_session(tmp_path / "a", pages)
    cp_session(tmp_path / "a", m / "a")
    pffs("fork", m / "a", m / "b")
    assert m.stop() == 0
    assert pffs("check", "--store", m.store, check=False).returncode == 0
    damage(m.store, "UPDATE whole_lists SET bytes = bytes + 1")
    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1 and "1 whole_lists rows say a page list is stored whole" in r.stdout, r.stdout
    assert pffs("check", "--store", m.store, "--repair", check=False).returncode == 0
    assert pffs("check", "--store", m.store, check=False).returncode == 0
    m.start()
    assert "4 pages" in pffs("fork", m / "b", m / "c").stdout
    assert [(m / "c" / "pages" / mf.page_name(i)).read_bytes() for i in range(4)] == pages


def test_forked_pages_hold_their_blobs_after_every_manifest_is_gone(mount_factory, bf16_pages, tmp_path):
    """A fork's page files hold their blobs through their manifest's page list, which
    stays while any of them is left, and goes with the last; check and repair know."""
    m = mount_factory()
    pages = varied_pages(bf16_pages, 5, salt=60)
    write_session(tmp_path / "a", pages)
    cp_session(tmp_path / "a", m / "a")
    pffs("fork", m / "a", m / "b")
    pffs("fork", m / "b", m / "c")
    run("rm", "-r", m / "a")
    for f in ("b", "c"):
        os.unlink(m / f / "manifest.json")
    forgotten(m)
    assert "removed 1 blobs" in gc(m.store)     # the manifest's own blob
    for f in ("b", "c"):
        assert [(m / f / "pages" / mf.page_name(i)).read_bytes() for i in range(5)] == pages
    run("rm", "-r", m / "c")
    for i in (0, 1):
        os.unlink(m / "b" / "pages" / mf.page_name(i))
    forgotten(m)
    assert "removed 0 blobs" in gc(m.store)     # the page list stays while b's pages are left
    assert [(m / "b" / "pages" / mf.page_name(i)).read_bytes() for i in (2, 3, 4)] == pages[2:]
    assert m.stop() == 0
    assert pffs("check", "--store", m.store, check=False).returncode == 0
    m.start()
    run("rm", "-r", m / "b")
    forgotten(m)
    assert "removed 5 blobs" in gc(m.store)
    assert not any(blob_path(m.store, p).exists() for p in pages)

    # Damage: the fork's pageset and every page list lost. check says so; repair
    # records the manifest's page list again from its bytes and indexes the
    # fork's rows by blob again.
    cp_session(tmp_path / "a", m / "a")
    pffs("fork", m / "a", m / "b")
    assert len(os.listdir(m / "b" / "pages")) == 5    # unfolded: the fork's page rows
    run("rm", "-r", m / "a")
    assert m.stop() == 0
    damage(m.store, "DELETE FROM pagesets", "DELETE FROM manifest_pages")
    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1, r.stdout
    for what in ("5 blocks rows of forked pages name a blob",
                 "/b/manifest.json: the page list recorded for its bytes has 0 rows for its 5 pages"):
        assert what in r.stdout, (what, r.stdout)
    r = pffs("check", "--store", m.store, "--repair", check=False)
    assert r.returncode == 0, r.stdout
    for what in ("/b/manifest.json: recorded the page list of its bytes again (5 pages)",
                 "indexed 5 blocks rows of forked pages by blob again"):
        assert what in r.stdout, (what, r.stdout)
    assert pffs("check", "--store", m.store, check=False).returncode == 0
    m.start()
    os.unlink(m / "b" / "pages" / mf.page_name(0))
    assert "removed 0 blobs" in gc(m.store)     # the page list recorded again holds it
    os.unlink(m / "b" / "manifest.json")
    assert "removed 2 blobs" in gc(m.store)     # the manifest's and page 0's
    assert [(m / "b" / "pages" / mf.page_name(i)).read_bytes() for i in range(1, 5)] == pages[1:]


def folds(store) -> int:
    c = sqlite3.connect(store / "namespace.db")
    try:
        return c.execute("SELECT COUNT(*) FROM folds").fetchone()[0]
    finally:
        c.close()


def test_folded_forks_hold_their_pages_and_check_and_repair_unfold_them(mount_factory, bf16_pages,
                                                                        tmp_path):
    """A folded fork (one row until looked into) holds its pages for gc; check unfolds it;
    when its page list was lost, repair records it again from a manifest with those bytes,
    or makes what is left of a fork no manifest holds."""
    m = mount_factory()
    pages = varied_pages(bf16_pages, 4, salt=62)
    names = [mf.page_name(i) for i in range(4)]
    write_session(tmp_path / "a", pages)
    cp_session(tmp_path / "a", m / "a")
    pffs("fork", m / "a", m / "x")
    assert m.stop() == 0
    assert folds(m.store) == 1
    assert "2 sessions" in pffs("check", "--store", m.store).stdout
    assert folds(m.store) == 0
    m.start()
    assert sorted(os.listdir(m / "x" / "pages")) == names
    run("rm", "-r", m / "x")
    for f in ("b", "c"):
        pffs("fork", m / "a", m / f)
    # d: a manifest of its own (page 0 and a page no other file holds) into an
    # empty pages/, then removed: d's fold alone holds that page.
    extra = varied_pages(bf16_pages, 1, salt=63)[0]
    (m / "z").write_bytes(extra)
    (m / "d" / "pages").mkdir(parents=True)
    (m / "d" / "manifest.json").write_bytes(make_manifest([pages[0], extra]).to_json())
    os.unlink(m / "d" / "manifest.json")
    os.unlink(m / "z")
    run("rm", "-r", m / "a")
    assert "removed 1 blobs" in gc(m.store)     # d's manifest; the folds hold every page
    assert m.stop() == 0
    assert folds(m.store) == 3
    damage(m.store, "DELETE FROM manifest_pages")
    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1, r.stdout
    for what in ("/b/pages: a fork's 4 page files are folded here, and the page list they come from gives 0",
                 "/c/pages: a fork's 4 page files are folded here",
                 "/d/pages: a fork's 2 page files are folded here"):
        assert what in r.stdout, (what, r.stdout)
    r = pffs("check", "--store", m.store, "--repair", check=False)
    assert r.returncode == 0, r.stdout
    for what in ("/b/manifest.json: recorded the page list of its bytes again (4 pages)",
                 "/d/pages: made 0 of the 2 page files of a folded fork (the page list they came from"
                 " lacks the rest)"):
        assert what in r.stdout, (what, r.stdout)
    assert pffs("check", "--store", m.store, check=False).returncode == 0
    assert folds(m.store) == 0
    m.start()
    for f in ("b", "c"):
        assert [(m / f / "pages" / n).read_bytes() for n in names] == pages
    assert os.listdir(m / "d" / "pages") == []
    assert "removed 1 blobs" in gc(m.store)     # the page only d's fold held


def test_check_refuses_a_mounted_store(mnt):
    r = pffs("check", "--store", mnt.store, "--repair", check=False)
    assert r.returncode == 1 and "in use (pffs mount" in r.stderr


def test_manifest_only_session_keeps_pages_until_its_manifest_goes(mnt, bf16_pages, tmp_path):
    pages = varied_pages(bf16_pages, 3, salt=50)
    m = make_manifest(pages)
    (mnt / "s" / "pages").mkdir(parents=True)
    for i, p in enumerate(pages):
        (mnt / "s" / "pages" / mf.page_name(i)).write_bytes(p)
    (mnt / "s" / "manifest.json").write_bytes(m.to_json())
    run("rm", "-r", mnt / "s" / "pages")
    assert "removed 0 blobs" in gc(mnt.store)
    assert all(blob_path(mnt.store, p).exists() for p in pages)
    os.unlink(mnt / "s" / "manifest.json")
    assert "removed 4 blobs" in gc(mnt.store)
    assert not any(blob_path(mnt.store, p).exists() for p in pages)
    # Written again after gc: stored afresh and readable.
    (mnt / "t").mkdir()
    (mnt / "t" / "p").write_bytes(pages[0])
    assert (mnt / "t" / "p").read_bytes() == pages[0]


def test_gc_while_mounted_with_open_unlinked_file(mnt, bf16_pages):
    data = varied_pages(bf16_pages, 1, salt=60)[0]
    (mnt / "f").write_bytes(data)
    with open(mnt / "f", "rb") as f:
        os.unlink(mnt / "f")
        assert "removed 0 blobs" in gc(mnt.store)
        assert f.read() == data


def _still_running(done, seconds: float = 0.5) -> bool:
    """True if *done()* stays false for *seconds* (a negative check: nothing may finish)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if done():
            return False
        time.sleep(0.02)
    return True


def test_daemon_and_gc_honour_the_gc_lock(mnt, bf16_pages):
    import threading
    pages = varied_pages(bf16_pages, 2, salt=70)
    lock = StoreDir(mnt.store).gc_lock
    # gc holds it exclusively: a close (existence check → commit) waits for it.
    with lock.exclusive():
        t = threading.Thread(target=(mnt / "f").write_bytes, args=(pages[0],))
        t.start()
        assert _still_running(lambda: not t.is_alive())
    t.join(30)
    assert (mnt / "f").read_bytes() == pages[0]
    # A writer holds it shared: gc's sweep waits for it.
    (mnt / "g").write_bytes(pages[1])
    os.unlink(mnt / "g")
    with lock.shared():
        proc = subprocess.Popen([sys.executable, "-m", "pffs.cli", "gc", "--store", str(mnt.store),
                                 "--grace", "0"], stdout=subprocess.PIPE, text=True)
        assert _still_running(lambda: proc.poll() is not None)
        assert blob_path(mnt.store, pages[1]).exists()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "removed 1 blobs" in out
    assert not blob_path(mnt.store, pages[1]).exists()
    assert (mnt / "f").read_bytes() == pages[0]


def test_the_gc_lock_taken_on_the_event_loop_never_waits(tmp_path):
    """``shared_if_free`` (a copy out of engines/ naming a stored page on the
    event loop) holds the lock shared as ``shared`` does, so gc cannot sweep
    meanwhile; where gc holds the lock, or waits for it (holding the intent),
    it takes nothing and says so at once, and the caller uses a thread."""
    import fcntl

    from pffs.store.storedir import GC_INTENT_NAME, GC_LOCK_NAME, GcLock
    lock = GcLock(tmp_path)
    gc_fd = os.open(tmp_path / GC_LOCK_NAME, os.O_RDWR | os.O_CREAT)
    intent_fd = os.open(tmp_path / GC_INTENT_NAME, os.O_RDWR | os.O_CREAT)
    try:
        with lock.shared_if_free() as held:
            assert held
            with pytest.raises(BlockingIOError):
                fcntl.flock(gc_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with lock.shared_if_free() as again:     # (nested, as shared() nests)
                assert again
            with pytest.raises(BlockingIOError):
                fcntl.flock(gc_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(gc_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # (let go at the end)
        with lock.shared_if_free() as held:
            assert not held
        fcntl.flock(gc_fd, fcntl.LOCK_UN)
        fcntl.flock(intent_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # gc waiting for the lock
        with lock.shared_if_free() as held:
            assert not held
        fcntl.flock(intent_fd, fcntl.LOCK_UN)
        with lock.shared_if_free() as held:
            assert held
    finally:
        os.close(gc_fd)
        os.close(intent_fd)


def test_session_sink_refuses_pages_gc_removed(tmp_path, bf16_pages):
    from pffs.errors import PffsError
    from pffs.client.offline import StoreSessionSink, StoreSessionSource
    store = tmp_path / "store"
    pages = varied_pages(bf16_pages, 2, salt=80)
    sink = StoreSessionSink(store, "a")
    ns.open_db(store).close()
    for i, p in enumerate(pages):
        sink.write_page(i, p)
    sink.write_manifest(make_manifest(pages).to_json())
    assert "removed 2 blobs" in pffs("gc", "--store", store, "--grace", "0").stdout
    with pytest.raises(PffsError, match="removed by gc"):
        sink.commit()
    sink = StoreSessionSink(store, "a")
    for i, p in enumerate(pages):
        sink.write_page(i, p)
    sink.write_manifest(make_manifest(pages).to_json())
    sink.commit()
    src = StoreSessionSource(store, "a")
    try:
        assert [src.read_page(i) for i in range(2)] == pages
    finally:
        src.close()
    assert pffs("check", "--store", store, "--read-data").returncode == 0


def test_repair_restores_a_snapshot_when_the_integrity_check_fails(mount_factory, bf16_pages, tmp_path):
    m = mount_factory()
    pages = varied_pages(bf16_pages, 3, salt=90)
    write_session(tmp_path / "s", pages)
    cp_session(tmp_path / "s", m / "s")
    assert m.stop() == 0  # the unmount checkpoints the WAL and takes a snapshot
    db = m.store / "namespace.db"
    conn = sqlite3.connect(db)
    root, size = conn.execute("SELECT rootpage FROM sqlite_master WHERE name='dentries_inode'").fetchone()[0], \
        conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(db, "r+b") as f:  # the database still opens; one index page is garbage
        f.seek((root - 1) * size)
        f.write(b"\xff" * size)
    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1 and "DAMAGE: namespace database:" in r.stdout
    r = pffs("check", "--store", m.store, "--repair", check=False)
    assert r.returncode == 0, r.stdout
    assert "restored the namespace from snapshot" in r.stdout and "after the snapshot" not in r.stdout
    m.start()
    assert [(m / "s" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == pages
    assert not (m / "lost+found").exists()


def test_repair_rebuilds_a_deleted_database_from_its_snapshot(mount_factory, bf16_pages, tmp_path):
    m = mount_factory()
    pages = varied_pages(bf16_pages, 2, salt=95)
    write_session(tmp_path / "s", pages)
    cp_session(tmp_path / "s", m / "s")
    assert m.stop() == 0
    for p in m.store.glob("namespace.db*"):
        p.unlink()
    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1 and "no pffs store here" in r.stderr
    r = pffs("check", "--store", m.store, "--repair", check=False)
    assert r.returncode == 0 and "restored the namespace from snapshot" in r.stdout, r.stdout
    m.start()
    assert [(m / "s" / "pages" / mf.page_name(i)).read_bytes() for i in range(2)] == pages
