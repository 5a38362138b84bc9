"""Level t1, units: no mount and no engine.
Metadata-only forks in the namespace alone: folded, unfolded, made at once, and their page lists."""

from __future__ import annotations

import hashlib
import stat

import pytest

from pffs import namespace as ns

PAGE = 147_456


def digest(i: int) -> str:
    return "sha256:" + hashlib.sha256(b"page %d" % i).hexdigest()


@pytest.fixture
def conn(tmp_path):
    c = ns.open_db(tmp_path)
    yield c
    c.close()


def store_blobs(conn, ids) -> None:
    with ns.transaction(conn):
        conn.executemany("INSERT OR IGNORE INTO blobs VALUES (?,?,?,?,0)",
                         [(digest(i), PAGE, PAGE // 2, "raw") for i in ids])


def session(conn, name: bytes, pages: list[str], mdigest: str) -> tuple[int, int, int]:
    """A folder with an empty pages/ and a manifest.json recorded as listing *pages*."""
    with ns.transaction(conn):
        s = ns.make_inode(conn, ns.ROOT_INODE, name, stat.S_IFDIR | 0o755, 0, 0)
        p = ns.make_inode(conn, s.id, b"pages", stat.S_IFDIR | 0o755, 0, 0)
        m = ns.make_inode(conn, s.id, b"manifest.json", stat.S_IFREG | 0o644, 0, 0)
        ns.record_manifest(conn, m.id, pages, mdigest)
    return s.id, p.id, m.id


def listing(conn, pdir: int) -> list[tuple[bytes, int, int, int, int, str]]:
    """(name, mode, uid, gid, size, digest) of each entry, and the blob its one block names."""
    return [row for row in conn.execute(
        "SELECT d.name, i.mode, i.uid, i.gid, i.size, i.digest, b.blob FROM dentries d"
        " JOIN inodes i ON i.id = d.inode JOIN blocks b ON b.inode = i.id WHERE d.parent=? ORDER BY d.name",
        (pdir,))]


def test_a_fork_of_a_complete_session_is_folded_and_unfolds_to_what_a_fork_makes(conn):
    pages = [digest(i) for i in range(12)]
    store_blobs(conn, range(12))
    s, pdir, _ = session(conn, b"a", pages, "sha256:" + "a" * 64)
    with ns.transaction(conn):
        assert ns.fork_pages(conn, s, "sha256:" + "a" * 64, 1000, 1001) == [(pdir, 12)]
    assert ns.is_folded(conn, pdir) and listing(conn, pdir) == []
    st = ns.stats(conn)
    assert (st.files, st.logical_bytes) == (13, 12 * PAGE)     # and the manifest, empty here
    with ns.transaction(conn):
        assert ns.unfold(conn, pdir) == 12
        assert ns.unfold(conn, pdir) == 0
    assert not ns.is_folded(conn, pdir)
    got = listing(conn, pdir)
    assert [r[0] for r in got] == [b"%06d" % i for i in range(12)]
    assert all(r[1:5] == (stat.S_IFREG | 0o644, 1000, 1001, PAGE) and r[5] == r[6] == pages[i]
               for i, r in enumerate(got))
    assert (ns.stats(conn).files, ns.stats(conn).logical_bytes) == (13, 12 * PAGE)
    # A session with a page stored nowhere is made at once, without that page.
    s2, pdir2, _ = session(conn, b"b", pages + [digest(99)], "sha256:" + "b" * 64)
    with ns.transaction(conn):
        assert ns.fork_pages(conn, s2, "sha256:" + "b" * 64, 1000, 1001) == [(pdir2, 12)]
    assert not ns.is_folded(conn, pdir2)
    assert [r[0] for r in listing(conn, pdir2)] == [b"%06d" % i for i in range(12)]


def test_a_folded_folder_is_full_and_its_page_list_stays_until_it_goes(conn):
    pages = [digest(i) for i in range(3)]
    store_blobs(conn, range(3))
    m = "sha256:" + "c" * 64
    s, pdir, mino = session(conn, b"a", pages, m)
    with ns.transaction(conn):
        ns.fork_pages(conn, s, m, 0, 0)
        with pytest.raises(ns.FsError) as e:
            ns.rmdir(conn, s, b"pages", lambda ino: False)
        assert e.value.errno == 39   # ENOTEMPTY
        ns.unlink(conn, s, b"manifest.json", lambda ino: False)
    assert ns.is_folded(conn, pdir)
    assert ns.recorded_pages(conn, m) is None     # no manifest records it...
    assert conn.execute("SELECT COUNT(*) FROM manifest_pages WHERE manifest=?", (m,)).fetchone()[0] == 3
    assert set(ns.iter_referenced_blobs(conn)) == set(pages)   # ...but the fold holds it for gc
    with ns.transaction(conn):
        ns.rename(conn, s, b"pages", ns.ROOT_INODE, b"moved", 0, lambda ino: False)
    assert ns.is_folded(conn, pdir)
    # A change in the folder makes its files first.
    with ns.transaction(conn):
        ns.make_inode(conn, pdir, b"extra", stat.S_IFREG | 0o644, 0, 0)
    assert not ns.is_folded(conn, pdir)
    assert len(conn.execute("SELECT * FROM dentries WHERE parent=?", (pdir,)).fetchall()) == 4
    with ns.transaction(conn):
        for name in (b"extra", b"000000", b"000001", b"000002"):
            ns.unlink(conn, pdir, name, lambda ino: False)
    assert conn.execute("SELECT COUNT(*) FROM manifest_pages").fetchone()[0] == 0
    assert list(ns.iter_referenced_blobs(conn)) == []


def test_a_folded_folder_removed_lets_its_page_list_go(conn):
    store_blobs(conn, range(2))
    m = "sha256:" + "d" * 64
    s, pdir, mino = session(conn, b"a", [digest(0), digest(1)], m)
    with ns.transaction(conn):
        ns.fork_pages(conn, s, m, 0, 0)
        ns.unlink(conn, s, b"manifest.json", lambda ino: False)
        ns.delete_inode(conn, pdir)    # (as repair may)
    assert conn.execute("SELECT COUNT(*) FROM folds").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM manifest_pages").fetchone()[0] == 0


def test_recording_known_manifest_bytes_needs_their_whole_page_list(conn):
    pages = [digest(i) for i in range(4)]
    m = "sha256:" + "e" * 64
    _, _, mino = session(conn, b"a", pages, m)
    assert ns.recorded_count(conn, m) == 4
    with ns.transaction(conn):
        f = ns.make_inode(conn, ns.ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0)
        assert ns.record_known_manifest(conn, f.id, m, 4)
    assert conn.execute("SELECT COUNT(*) FROM manifests WHERE digest=?", (m,)).fetchone()[0] == 2
    with ns.transaction(conn):
        conn.execute("DELETE FROM manifest_pages WHERE manifest=? AND page_ix=3", (m,))
        g = ns.make_inode(conn, ns.ROOT_INODE, b"g", stat.S_IFREG | 0o644, 0, 0)
        assert ns.recorded_count(conn, m) is None
        assert not ns.record_known_manifest(conn, g.id, m, 4)
        assert conn.execute("SELECT COUNT(*) FROM manifests WHERE inode=?", (g.id,)).fetchone()[0] == 0
        ns.record_manifest(conn, g.id, pages, m)     # what the daemon does then, from the bytes
    assert ns.recorded_pages(conn, m) == pages


def test_readdir_resumes_at_a_cookie_by_index_without_a_sort(conn):
    """Each readdir call of a large folder reads its next entries from an index in
    cookie order: no scan of the folder, no sort (a listing is many calls)."""
    plan = " | ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + ns.READDIR_SQL, (1, 0)))
    assert "dentries_parent_id" in plan and "TEMP B-TREE" not in plan, plan


def test_inode_numbers_and_cookies_are_never_given_again(conn):
    """The newest file removed, the next one gets a new inode number and a new
    readdir cookie (the old ones may still be held by someone); a fork's page
    files too."""
    import stat as st
    with ns.transaction(conn):
        a = ns.make_inode(conn, ns.ROOT_INODE, b"a", st.S_IFREG | 0o644, 0, 0).id
    cookie = conn.execute("SELECT id FROM dentries WHERE inode=?", (a,)).fetchone()[0]
    with ns.transaction(conn):
        ns.unlink(conn, ns.ROOT_INODE, b"a", lambda ino: False)
    assert conn.execute("SELECT COUNT(*) FROM inodes WHERE id=?", (a,)).fetchone()[0] == 0
    with ns.transaction(conn):
        b = ns.make_inode(conn, ns.ROOT_INODE, b"b", st.S_IFREG | 0o644, 0, 0).id
    assert b > a
    assert conn.execute("SELECT id FROM dentries WHERE inode=?", (b,)).fetchone()[0] > cookie
    with ns.transaction(conn):
        ns.unlink(conn, ns.ROOT_INODE, b"b", lambda ino: False)
    # A fork's page files (ids given by one INSERT ... SELECT) come after them too.
    store_blobs(conn, [0, 1])
    s, p, m = session(conn, b"s", [digest(0), digest(1)], "sha256:" + "ee" * 32)
    with ns.transaction(conn):
        gone = ns.make_inode(conn, p, b"x", st.S_IFREG | 0o644, 0, 0).id
        ns.unlink(conn, p, b"x", lambda ino: False)
        ns.make_inode(conn, p, b"keep", st.S_IFREG | 0o644, 0, 0)   # (pages/ not empty: no fold)
        ns.fork_pages(conn, s, "sha256:" + "ee" * 32, 0, 0)
    made = [i for (i,) in conn.execute("SELECT inode FROM dentries WHERE parent=? AND name != ?", (p, b"keep"))]
    assert len(made) == 2 and min(made) > gone
