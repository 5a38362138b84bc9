"""Level t1, units: no mount and no engine.
Which blobs are referenced (pffs.namespace.references): the scan gc marks with
and the lookups by index (gc's re-check, the S3 lease, du) give one answer."""

from __future__ import annotations

import hashlib
import stat

import pytest

from pffs import namespace as ns
from pffs.maint.check import UNPINNED_FORK_ROW

PAGE = 4096


def digest(i: int) -> str:
    return "sha256:" + hashlib.sha256(b"blob %d" % i).hexdigest()


@pytest.fixture
def conn(tmp_path):
    c = ns.open_db(tmp_path)
    yield c
    c.close()


def build(conn) -> dict[str, set[str]]:
    """A namespace with every kind of reference, and blobs nothing references."""
    m = "sha256:" + "a" * 64
    with ns.transaction(conn):
        conn.executemany("INSERT INTO blobs VALUES (?,?,?,?,0)", [(digest(i), PAGE, PAGE, "raw") for i in range(10)])
        # A file holds blob 0; an unlinked file still open holds blob 9.
        f = ns.make_inode(conn, ns.ROOT_INODE, b"file", stat.S_IFREG | 0o644, 0, 0)
        gone = ns.make_inode(conn, ns.ROOT_INODE, b"gone", stat.S_IFREG | 0o644, 0, 0)
        conn.executemany("INSERT INTO blocks (inode, blockno, blob) VALUES (?,0,?)",
                         [(f.id, digest(0)), (gone.id, digest(9))])
        ns.unlink(conn, ns.ROOT_INODE, b"gone", lambda ino: True)
        # Session a lists blobs 1-4; its fork b holds them as page files (via set).
        a = ns.make_inode(conn, ns.ROOT_INODE, b"a", stat.S_IFDIR | 0o755, 0, 0)
        ns.make_inode(conn, a.id, b"pages", stat.S_IFDIR | 0o755, 0, 0)
        ma = ns.make_inode(conn, a.id, b"manifest.json", stat.S_IFREG | 0o644, 0, 0)
        ns.record_manifest(conn, ma.id, [digest(i) for i in range(1, 5)], m)
        b = ns.make_inode(conn, ns.ROOT_INODE, b"b", stat.S_IFDIR | 0o755, 0, 0)
        pb = ns.make_inode(conn, b.id, b"pages", stat.S_IFDIR | 0o755, 0, 0)
        mb = ns.make_inode(conn, b.id, b"manifest.json", stat.S_IFREG | 0o644, 0, 0)
        ns.record_manifest(conn, mb.id, [digest(i) for i in range(1, 5)], m)
        ns.fork_pages(conn, b.id, m, 0, 0)
        ns.unfold(conn, pb.id)
        # Both manifests go: the fork's page files keep the list (and blobs 1-4).
        ns.forget_manifest(conn, ma.id)
        ns.forget_manifest(conn, mb.id)
        # The key-only prefix cache keeps blob 5.
        conn.execute("INSERT INTO cached_keys VALUES (1, ?, ?, ?, 0)", ("0" * 64, digest(5), PAGE))
    assert conn.execute("SELECT COUNT(*) FROM blocks WHERE via IS NOT NULL").fetchone()[0] == 4
    return {"referenced": {digest(i) for i in (0, 1, 2, 3, 4, 5, 9)}, "all": {digest(i) for i in range(10)}}


def test_the_scan_and_the_lookups_by_index_agree(conn):
    want = build(conn)
    assert set(ns.iter_referenced_blobs(conn)) == want["referenced"]
    assert ns.referenced_among(conn, want["all"]) == want["referenced"]
    assert {d for d in want["all"] if ns.is_referenced(conn, d)} == want["referenced"]
    # Only blob rows nothing references are dropped.
    with ns.transaction(conn):
        dropped = {d for d in sorted(want["all"]) if ns.drop_unreferenced_blob_row(conn, d)}
    assert dropped == want["all"] - want["referenced"]


def test_a_fork_row_whose_page_list_lost_its_blob_still_keeps_it_from_gc(conn):
    """The damage pffs check reports (a fork's page file whose list lacks its blob):
    gc marks with the scan, which counts every file's rows, so the blob stays."""
    want = build(conn)
    with ns.transaction(conn):
        conn.execute("DELETE FROM manifest_pages WHERE digest=?", (digest(2),))
    assert conn.execute(f"SELECT COUNT(*) FROM blocks WHERE {UNPINNED_FORK_ROW}").fetchone()[0] == 1
    assert set(ns.iter_referenced_blobs(conn)) == want["referenced"]
