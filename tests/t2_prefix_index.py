"""Level t2, in process: the prefix index (SPEC §7) on stores built in the test, no mount.
A session's full pages are found by their token chain keys as soon as its
manifest is recorded; a fork adds no row; removing the session takes its
keys; check finds an index that disagrees with the manifests and repair
rebuilds it; the key-only cache keeps pages within its size, least recently
used out first, and never touches what sessions hold (pffs.namespace.prefix_index,
docs/prefix-index.md)."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest
from sessions import digest

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.client import chainkeys as ck
from pffs.client.offline import StoreSessionSink
from pffs.maint.check import check
from pffs.maint.repair import repair
from pffs.namespace import prefix_index as pi
from pffs.store.local import LocalBlobStore
from pffs.store.storedir import StoreDir

P = 4       # tokens a page
GEOM = dict(page_size_tokens=P, n_layers=1, n_heads=1, head_dim=2, dtype="f32")
MODEL = {"name": "test/tiny", "revision": "1"}
SPACE = ck.key_namespace(MODEL, "f32", 1, 1, 2, P, {"k_has_rope": True})


def page(i: int, salt: int = 0) -> bytes:
    return (i + 1000 * salt).to_bytes(8, "little") * 8      # 64 bytes: the geometry's page size


def manifest(pages: list[bytes], tokens: list[int], **extra) -> mf.Manifest:
    fill = len(tokens) % P
    return mf.Manifest(pages=[digest(p) for p in pages], model=MODEL, kv={"k_has_rope": True},
                       logical_seqs=[mf.LogicalSeq("r", list(range(len(pages))), fill, tokens)],
                       extra=extra, **GEOM)


def write(root: Path, path: str, pages: list[bytes], tokens: list[int], **extra) -> mf.Manifest:
    sink = StoreSessionSink(root, path)
    for i, p in enumerate(pages):
        sink.write_page(i, p)
    m = manifest(pages, tokens, **extra)
    sink.write_manifest(m.to_json())
    sink.commit()
    return m


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "store"


def db(root: Path) -> sqlite3.Connection:
    return ns.open_db(root, create_missing=False)


def q(root: Path, sql: str, *args):
    conn = db(root)
    try:
        return conn.execute(sql, args).fetchone()[0]
    finally:
        conn.close()


def find(root: Path, keys: list[str], space: str = SPACE) -> list[str]:
    conn = db(root)
    try:
        return [d for d, _ in pi.find(conn, space, keys)]
    finally:
        conn.close()


def keyed_rows(root: Path) -> int:
    return q(root, "SELECT COUNT(*) FROM manifest_pages WHERE key IS NOT NULL")


def resolve(conn, path: str) -> int:
    ino: int | None = ns.ROOT_INODE
    for part in path.strip("/").split("/"):
        assert ino is not None
        ino = ns.lookup(conn, ino, part.encode())
    assert ino is not None, path
    return ino


def fork(root: Path, src: str, dst: str) -> None:
    """``pffs fork`` in the namespace: dst/pages/ made, src's manifest forked there."""
    conn = db(root)
    try:
        with ns.transaction(conn):
            folder = ns.make_inode(conn, ns.ROOT_INODE, dst.encode(), stat.S_IFDIR | 0o755, 0, 0).id
            ns.make_inode(conn, folder, b"pages", stat.S_IFDIR | 0o755, 0, 0)
            ns.fork_manifest(conn, resolve(conn, f"{src}/manifest.json"), folder, 0, 0)
    finally:
        conn.close()


def test_a_256_page_session_adds_256_keyed_rows_and_a_fork_adds_none(root):
    pages = [page(i) for i in range(256)]
    tokens = list(range(5000, 5000 + 256 * P))
    m = write(root, "a", pages, tokens)
    keys = ck.chain_keys(tokens, P)
    assert keyed_rows(root) == 256
    assert find(root, keys) == m.pages                     # every page, in order
    fork(root, "a", "b")
    assert q(root, "SELECT COUNT(*) FROM manifests") == 2
    assert keyed_rows(root) == 256 and q(root, "SELECT COUNT(*) FROM manifest_pages") == 256
    assert find(root, keys[:10] + ["0" * 64] + keys[11:]) == m.pages[:10]   # the leading run only
    assert find(root, keys, space="1" * 64) == []          # another namespace: nothing


def test_the_short_last_page_and_manifests_with_inputs_are_not_keyed(root):
    tokens = list(range(100, 100 + 3 * P - 1))              # the third page is short
    m = write(root, "a", [page(i) for i in range(3)], tokens)
    assert keyed_rows(root) == 2
    assert find(root, ck.chain_keys(tokens + [7], P)) == m.pages[:2]
    write(root, "lora", [page(i, salt=1) for i in range(2)], list(range(9000, 9000 + 2 * P)),
          inputs={"lora": "adapter-1"})
    assert keyed_rows(root) == 2


def test_removing_the_session_takes_its_keys_and_gc_its_blobs(root):
    tokens = list(range(8 * P))
    m = write(root, "a", [page(i) for i in range(8)], tokens)
    keys = ck.chain_keys(tokens, P)
    conn = db(root)
    try:
        with ns.transaction(conn):
            folder = resolve(conn, "a")
            for name in (b"manifest.json",):
                ns.unlink(conn, folder, name, lambda ino: False)
    finally:
        conn.close()
    assert keyed_rows(root) == 0 and find(root, keys) == []
    assert q(root, "SELECT COUNT(*) FROM blobs WHERE digest = ?", m.pages[0]) == 1   # page files hold it


def check_store(root: Path):
    conn = db(root)
    try:
        blobs = StoreDir(root).blobs
        assert isinstance(blobs, LocalBlobStore)
        return check(conn, blobs)
    finally:
        conn.close()


def repair_store(root: Path):
    store = StoreDir(root)
    store.lock("test")
    try:
        return repair(store)
    finally:
        store.unlock()


def test_check_finds_lost_or_wrong_keys_and_repair_rebuilds_them(root):
    tokens = list(range(6 * P))
    m = write(root, "a", [page(i) for i in range(6)], tokens)
    assert check_store(root).clean
    conn = sqlite3.connect(root / ns.DB_NAME)
    conn.execute("UPDATE manifest_pages SET space = NULL, key = NULL WHERE page_ix >= 3")
    conn.commit()
    conn.close()
    r = check_store(root)
    assert r.damage == ["/a/manifest.json: the prefix index holds 3 keys of its pages, its bytes give 6"]
    result = repair_store(root)
    assert "rebuilt the prefix index: 6 keys of 1 manifests" in result.actions
    assert result.report is not None and result.report.clean
    assert find(root, ck.chain_keys(tokens, P)) == m.pages


def test_an_index_not_built_is_a_note_and_repair_builds_it(root):
    """What the migration from schema 8 leaves: no keys, meta's mark absent."""
    tokens = list(range(2 * P))
    write(root, "a", [page(i) for i in range(2)], tokens)
    conn = sqlite3.connect(root / ns.DB_NAME)
    conn.execute("UPDATE manifest_pages SET space = NULL, key = NULL")
    conn.execute("DELETE FROM meta WHERE key = 'prefix_index'")
    conn.commit()
    conn.close()
    r = check_store(root)
    assert r.clean and any("prefix index is not built" in n for n in r.notes)
    repair_store(root)
    assert keyed_rows(root) == 2 and q(root, "SELECT value FROM meta WHERE key='prefix_index'") == "1"


def cached(root: Path) -> list[str]:
    conn = db(root)
    try:
        return [k for (k,) in conn.execute("SELECT key FROM cached_keys ORDER BY used_ns")]
    finally:
        conn.close()


def test_key_only_pages_go_least_recently_used_first_and_session_pages_never(root):
    tokens = list(range(2 * P))
    m = write(root, "s", [page(i) for i in range(2)], tokens)
    skeys = ck.chain_keys(tokens, P)
    other = [f"{i:064x}" for i in range(1, 6)]
    conn = db(root)
    try:
        with ns.transaction(conn):
            # The session's own first page under its key too, then four pages of 64 bytes.
            assert pi.cache_page(conn, SPACE, skeys[0], m.pages[0], 64, 1, 256) == 0
            for t, k in enumerate(other[:3], start=2):
                assert pi.cache_page(conn, SPACE, k, m.pages[1], 64, t, 256) == 0
            assert pi.touch(conn, SPACE, [skeys[0]], 10) == 1     # used again: now the newest
            assert pi.cache_page(conn, SPACE, other[3], m.pages[1], 64, 11, 256) == 1
    finally:
        conn.close()
    # 256 bytes hold four: the least recently used (other[0]) went, the touched one stayed.
    assert cached(root) == [other[1], other[2], skeys[0], other[3]]
    conn = db(root)
    try:
        with ns.transaction(conn):
            assert pi.evict(conn, 0) == 4
    finally:
        conn.close()
    assert cached(root) == []
    assert find(root, skeys) == m.pages                    # the session's pages stay found
    assert find(root, other[1:2]) == []


def test_a_key_only_page_is_a_gc_root_while_its_row_stays(root):
    from pffs.maint.gc import collect
    write(root, "s", [page(0)], list(range(P)))
    store = StoreDir(root)
    data = page(7, salt=3)
    put = store.blobs.put(data)
    conn = db(root)
    try:
        with ns.transaction(conn):
            ns.insert_blob_rows(conn, [ns.BlobRow(put.digest, len(data), put.stored_size, put.codec)])
            pi.cache_page(conn, SPACE, "a" * 64, put.digest, len(data), 1, 1 << 20)
    finally:
        conn.close()
    collect(store, grace=0)
    assert store.blobs.path(put.digest).exists() and find(root, ["a" * 64]) == [put.digest]
    conn = db(root)
    try:
        with ns.transaction(conn):
            pi.evict(conn, 0)
    finally:
        conn.close()
    collect(store, grace=0)
    assert not store.blobs.path(put.digest).exists() and find(root, ["a" * 64]) == []
    assert store.blobs.path(digest(page(0))).exists()      # the session's page stays


def test_a_counted_key_only_cache_costs_no_pass_over_its_rows(root):
    """cache_pages_counted given the cache's bytes reads only the rows it is given (no
    SUM over the table: at millions of key-only rows that pass cost 100 ms a call), and
    its count stays the table's own through replaced keys, repeats and evictions."""
    m = write(root, "s", [page(0), page(1)], list(range(2 * P)))
    keys = [f"{i:064x}" for i in range(1, 40)]
    conn = db(root)
    said: list[str] = []
    try:
        with ns.transaction(conn):
            gone, total = pi.cache_pages_counted(conn, SPACE, [(keys[0], m.pages[0], 64)], 1, 10_000)
            conn.set_trace_callback(said.append)
            for t in range(2, 30):
                rows = [(keys[t], m.pages[1], 32 + t), (keys[t - 1], m.pages[0], 48), (keys[t], m.pages[0], 40)]
                got, total = pi.cache_pages_counted(conn, SPACE, rows, t, 1_000, total)
                gone += got
            conn.set_trace_callback(None)
            held = conn.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM cached_keys").fetchone()
    finally:
        conn.close()
    assert not [s for s in said if "SUM(" in s.upper()], said[:5]
    assert gone > 0 and total == held[0] <= 1_000


def test_a_lookup_of_a_batch_of_keys_is_two_statements_not_two_a_key(root):
    """find asks for FIND_BATCH keys in one statement each for sessions and the key-only
    cache (a statement a key cost 3.2 ms for 128 keys at a million rows, batched 1.7 ms),
    and still gives the leading run in order, a session's page before a cached one."""
    pages = [page(i) for i in range(300)]
    tokens = list(range(7000, 7000 + 300 * P))
    m = write(root, "a", pages[:200], tokens[:200 * P])
    keys = ck.chain_keys(tokens, P)
    conn = db(root)
    said: list[str] = []
    try:
        with ns.transaction(conn):       # pages 200.. kept by key alone (their blobs: a's)
            pi.cache_pages(conn, SPACE, [(k, m.pages[i % 200], 64) for i, k in enumerate(keys[200:], 200)],
                           1, 1 << 40)
        conn.set_trace_callback(said.append)
        got = pi.find(conn, SPACE, keys[:128])
        assert [d for d, c in got] == m.pages[:128] and not any(c for _, c in got)
        assert len([s for s in said if "SELECT" in s.upper()]) <= 2     # (the space's id, its hits)
        said.clear()
        got = pi.find(conn, SPACE, keys)
        assert [d for d, _ in got] == m.pages + [m.pages[i % 200] for i in range(200, 300)]
        assert [c for _, c in got] == [False] * 200 + [True] * 100
        assert len([s for s in said if "SELECT" in s.upper()]) <= 1 + 2 * -(-300 // pi.FIND_BATCH)
        said.clear()
        assert [d for d, _ in pi.find(conn, SPACE, keys[:5] + ["0" * 64] + keys[6:])] == m.pages[:5]
    finally:
        conn.set_trace_callback(None)
        conn.close()
