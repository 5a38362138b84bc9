"""Level t2, in process: the FUSE handlers driven in the test's process, with no kernel mount.
FUSE handlers called in-process, without a mount, over a real store: what the
kernel cannot be made to do on purpose."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import trio

from pffs import namespace as ns
from pffs.daemon.handlers import build
from pffs.fs.content import ContentStore
from pffs.fs.db import Database
from pffs.store.storedir import StoreDir


@pytest.fixture
def ops(tmp_path):
    store = StoreDir(tmp_path / "store")
    store.create()
    ns.open_db(store.root).close()
    db = Database(store.db_path)
    content = ContentStore(store.blobs, store.staging_dir)
    h = build(db, content, nursery=None)
    yield h
    content.workers.stop()
    h.stop()
    db.close()


def test_a_forget_past_the_lookup_count_is_said_once(ops, caplog):
    """The kernel forgetting more lookups than pffs counted is a counting bug:
    one warning (never a silent clamp), and the inode is let go as before."""
    async def main():
        def mk(conn):
            return ns.make_inode(conn, ns.ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0).id
        ino = await ops.db.write(mk)
        ops.inodes.looked_up(ino, 2)
        await ops.ops.forget([(ino, 2)])          # as counted: nothing said
        await ops.ops.forget([(ino, 3)])          # three more than counted
        await ops.ops.forget([(ino, 1)])          # (said once only)
        return ino
    with caplog.at_level(logging.WARNING, logger="pffs.fs"):
        ino = trio.run(main)
    said = [r.getMessage() for r in caplog.records if "forget of inode" in r.getMessage()]
    assert said == [f"forget of inode {ino}: the kernel forgot 3 lookups, pffs counted 0"]
    assert ino not in ops.inodes.lookups


def test_bytes_stored_while_the_store_is_recounted_are_not_lost(ops):
    """A commit thread counts its new blob while the daemon recounts stored
    bytes from the namespace (which does not hold that blob's row yet): the
    recount's result keeps it, so max_size is never overrun by a lost count."""
    content = ops.content
    content.add_stored(1000)

    def recount():
        content.add_stored(300)   # another commit, between the namespace's sum and its use
        return 1000
    assert content.recounted(recount) == 1300
    assert content.stored_bytes == 1300


class Ctx:
    """What a FUSE request context gives the handlers."""
    uid = 0
    gid = 0
    pid = 1
    umask = 0o022


def test_a_write_flushed_while_its_file_is_renamed_onto_manifest_json_is_checked(ops, monkeypatch):
    """rename(x, manifest.json) validates x and queues its transaction; a write
    and flush of x then decide, by x's name, that x is no manifest.  The
    rename's transaction commits first: the flush's bytes now land under the
    name manifest.json, so they are checked there (names read in the flush's
    own transaction) and refused, and the validated manifest stays."""
    import errno
    import json
    import threading

    import pyfuse3
    import trio.testing
    from manifests import good
    from pffs.namespace import changes

    valid = json.dumps(good()).encode()
    renaming, go_on = threading.Event(), threading.Event()
    real_rename = ns.rename

    def held_rename(*args):
        # The rename's transaction, in the writer thread, holding the write connection.
        renaming.set()
        go_on.wait(30)
        return real_rename(*args)
    monkeypatch.setattr(changes, "rename", held_rename)
    out = {}

    async def main():
        info, _ = await ops.ops.create(ns.ROOT_INODE, b"x", 0o100644, os.O_WRONLY, Ctx())
        await ops.ops.write(info.fh, 0, valid)
        await ops.ops.flush(info.fh)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.ops.rename, ns.ROOT_INODE, b"x", ns.ROOT_INODE, b"manifest.json", 0, Ctx())
            await trio.to_thread.run_sync(renaming.wait)     # validated, its transaction under way
            await ops.ops.write(info.fh, 0, b"not a manifest" + b" " * len(valid))

            async def flush():
                try:
                    await ops.ops.flush(info.fh)
                    out["flush"] = 0
                except pyfuse3.FUSEError as e:
                    out["flush"] = e.errno
            nursery.start_soon(flush)
            await trio.testing.wait_all_tasks_blocked()       # the flush waits on its commit
            go_on.set()
        await ops.ops.release(info.fh)
        ino = ns.lookup(ops.db.ro, ns.ROOT_INODE, b"manifest.json")
        out["bytes"] = ns.read_file(ops.db.ro, ops.content.blobs, ino)
        out["recorded"] = ops.db.ro.execute("SELECT COUNT(*) FROM manifests WHERE inode=?", (ino,)).fetchone()[0]
    trio.run(main)
    assert out["flush"] == errno.EINVAL
    assert out["bytes"] == valid and out["recorded"] == 1


def test_changes_commit_while_the_namespace_is_snapshotted(tmp_path, monkeypatch):
    """The periodic snapshot copies the database beside the writers: a change
    commits while the copy is still being made durable."""
    import threading
    from pffs.maint import snapshots
    from pffs.daemon.mount import MountOptions, snapshot_namespace
    store = StoreDir(tmp_path / "store")
    store.create()
    ns.open_db(store.root).close()
    db = Database(store.db_path)
    copying, done = threading.Event(), threading.Event()
    real_fsync = snapshots.os.fsync

    def slow_fsync(fd):
        copying.set()
        done.wait(30)       # a slow disk, until the change below has committed
        real_fsync(fd)
    monkeypatch.setattr(snapshots.os, "fsync", slow_fsync)
    t = threading.Thread(target=snapshot_namespace, args=(store, MountOptions().snapshots_kept))
    t.start()
    try:
        assert copying.wait(30)
        committed = threading.Event()

        def change():
            db.run_in_transaction(lambda c: ns.make_inode(c, ns.ROOT_INODE, b"n", stat.S_IFDIR | 0o755, 0, 0))
            committed.set()
        threading.Thread(target=change, daemon=True).start()
        assert committed.wait(10), "a commit waited for the snapshot"
    finally:
        done.set()
        t.join(30)
        db.close()
    snaps = snapshots.list_snapshots(store.snapshot_dir)
    assert len(snaps) == 1
    import sqlite3
    c = sqlite3.connect(snaps[0])
    assert c.execute("SELECT COUNT(*) FROM dentries WHERE name=?", (b"n",)).fetchone()[0] == 0  # as of its start
    c.close()


def test_a_write_that_spills_its_staging_to_disk_runs_off_the_event_loop(tmp_path, monkeypatch):
    """Past the staging memory budget a write moves the file's staged bytes to
    disk: file I/O of up to a block, in a worker thread, never on the loop."""
    import threading

    from pffs.fs import write_stage as staging
    store = StoreDir(tmp_path / "store")
    store.create()
    ns.open_db(store.root).close()
    db = Database(store.db_path)
    content = ContentStore(store.blobs, store.staging_dir)
    h = build(db, content, nursery=None, staging_memory=1 << 20)
    o = h.ops
    where = []
    real_spill = staging.Staging._spill

    def spill(self):
        where.append(threading.current_thread() is threading.main_thread())
        real_spill(self)
    monkeypatch.setattr(staging.Staging, "_spill", spill)

    async def main():
        info, _ = await o.create(ns.ROOT_INODE, b"f", 0o100644, os.O_WRONLY, Ctx())
        for k in range(4):
            await o.write(info.fh, k << 19, b"x" * (1 << 19))   # the third write crosses 1 MiB
        await o.release(info.fh)
    try:
        trio.run(main)
    finally:
        content.workers.stop()
        h.stop()
        db.close()
    assert where == [False]


def test_stats_json_figures_are_computed_again_only_after_a_change(ops, monkeypatch):
    """lookup, getattr and open of .pffs/stats.json each need its size: the
    namespace's figures (a pass over its tables) are computed once per change,
    and a change shows at once."""
    import json

    from pffs.fs import virtual
    calls = []
    real = virtual.ns.stats
    monkeypatch.setattr(virtual.ns, "stats", lambda conn: calls.append(1) or real(conn))

    async def main():
        for _ in range(5):
            await ops.ops.getattr(virtual.STATS, Ctx())
        before = len(calls)
        await ops.ops.mkdir(ns.ROOT_INODE, b"d", 0o40755, Ctx())
        a = await ops.ops.getattr(virtual.STATS, Ctx())
        info = await ops.ops.open(virtual.STATS, os.O_RDONLY, Ctx())
        data = await ops.ops.read(info.fh, 0, 1 << 16)
        return before, len(calls), a.st_size, data
    before, after, size, data = trio.run(main)
    assert before == 1 and after == 2
    assert size > 0 and json.loads(data)["files"] == 0


def test_statfs_counts_inodes_again_only_after_a_change(ops, monkeypatch):
    """df asks often: the inode count (a pass over a table) is taken once per change."""
    counted = []
    real = ops.db.ro

    class Counting:
        def execute(self, sql, *args):
            if "COUNT(*) FROM inodes" in sql:
                counted.append(1)
            return real.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(real, name)

    async def main():
        ops.db.ro = Counting()
        try:
            for _ in range(4):
                await ops.ops.statfs(Ctx())
            first = ops.content._inodes[1]
            await ops.ops.mkdir(ns.ROOT_INODE, b"d", 0o40755, Ctx())
            await ops.ops.statfs(Ctx())
        finally:
            ops.db.ro = real
        return first, ops.content._inodes[1]
    first, after = trio.run(main)
    assert len(counted) == 2
    assert after == first + 1          # (the inodes pffs holds; the disk's free ones come on top)


def test_editing_a_file_of_several_blocks_stages_it_a_block_at_a_time(ops, monkeypatch):
    """Opening a file of three 64 MiB blocks for a 1-byte write stages its bytes
    one block at a time (into the spill file), never the whole file in memory."""
    from pffs.fs import write_stage as staging
    from pffs.namespace import BLOCK_SIZE
    zero = bytes(BLOCK_SIZE)
    d = ops.content.blobs.put(zero).digest
    biggest = []
    real_write = staging.Staging.write
    monkeypatch.setattr(staging.Staging, "write",
                        lambda self, off, data: biggest.append(len(data)) or real_write(self, off, data))

    async def main():
        def mk(conn):
            node = ns.make_inode(conn, ns.ROOT_INODE, b"big", stat.S_IFREG | 0o644, 0, 0)
            ns.set_content(conn, node.id, 3 * BLOCK_SIZE, "sha256:" + "00" * 32, [d, d, d],
                           [ns.BlobRow(d, BLOCK_SIZE, ops.content.blobs.stored_size(d), "")], None)
            return node.id
        ino = await ops.db.write(mk)
        info = await ops.ops.open(ino, os.O_WRONLY, Ctx())
        await ops.ops.write(info.fh, 3 * BLOCK_SIZE - 1, b"!")
        stg = ops.inodes.states[ino].staging
        out = (stg.size, stg.in_memory, stg.read(3 * BLOCK_SIZE - 2, 2))
        await ops.ops.release(info.fh)
        return out
    size, in_memory, tail = trio.run(main)
    assert size == 3 * BLOCK_SIZE and not in_memory and tail == b"\0!"
    assert max(biggest) <= BLOCK_SIZE


def test_a_small_write_into_a_file_of_several_blocks_commits_that_block_only(ops, monkeypatch):
    """One byte changed in the middle block of three: one block is hashed and
    stored again, the other two are named as they were; the file reads back
    with the change, and its digest (reckoned when asked) is its bytes'."""
    import hashlib

    from pffs.fs import content as content_mod
    from pffs.names import DIGEST_XATTR_B as DIGEST_XATTR
    from pffs.namespace import BLOCK_SIZE
    blocks = [bytes([65 + i]) * BLOCK_SIZE for i in range(3)]
    ds = [ops.content.blobs.put(b).digest for b in blocks]
    hashed = []
    real = content_mod.digest_of
    ops.content.zero_digest(BLOCK_SIZE)   # (reckoned once a daemon: not the commit's work)
    monkeypatch.setattr(content_mod, "digest_of", lambda data: hashed.append(len(data)) or real(data))

    async def main():
        def mk(conn):
            node = ns.make_inode(conn, ns.ROOT_INODE, b"big", stat.S_IFREG | 0o644, 0, 0)
            ns.set_content(conn, node.id, 3 * BLOCK_SIZE, None, ds,
                           [ns.BlobRow(d, BLOCK_SIZE, ops.content.blobs.stored_size(d), "") for d in ds], None)
            return node.id
        ino = await ops.db.write(mk)
        info = await ops.ops.open(ino, os.O_RDWR, Ctx())
        await ops.ops.write(info.fh, BLOCK_SIZE + 5, b"!")
        await ops.ops.release(info.fh)
        after = ns.blocks_of(ops.db.ro, ino)
        got = await ops.ops.getxattr(ino, DIGEST_XATTR, Ctx())
        return after, got
    after, got = trio.run(main)
    assert len(hashed) == 1 and after[0] == ds[0] and after[2] == ds[2] and after[1] != ds[1]
    changed = blocks[1][:5] + b"!" + blocks[1][6:]
    assert ops.content.blobs.get(after[1]) == changed
    assert got.decode() == "sha256:" + hashlib.sha256(blocks[0] + changed + blocks[2]).hexdigest()


def test_a_write_past_the_end_changes_the_old_last_block_too(ops):
    """A file of a block and 10 bytes, written past its end in a later block:
    its old, partly filled last block now runs on with zeros and is stored
    anew (found by fsstress: it was named again as committed, 10 bytes long)."""
    from pffs.namespace import BLOCK_SIZE
    head = bytes([7]) * BLOCK_SIZE
    ds = [ops.content.blobs.put(head).digest, ops.content.blobs.put(b"0123456789").digest]

    async def main():
        def mk(conn):
            node = ns.make_inode(conn, ns.ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0)
            ns.set_content(conn, node.id, BLOCK_SIZE + 10, None, ds,
                           [ns.BlobRow(ds[0], BLOCK_SIZE, 1, ""), ns.BlobRow(ds[1], 10, 1, "")], None)
            return node.id
        ino = await ops.db.write(mk)
        info = await ops.ops.open(ino, os.O_RDWR, Ctx())
        await ops.ops.write(info.fh, 3 * BLOCK_SIZE + 1, b"!")
        await ops.ops.release(info.fh)
        return ino
    ino = trio.run(main)
    after = ns.blocks_of(ops.db.ro, ino)
    assert len(after) == 4 and after[0] == ds[0]
    sizes = [len(ops.content.blobs.get(d)) for d in after]
    assert sizes == [BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE, 2]
    assert ops.content.blobs.get(after[1])[:12] == b"0123456789\0\0"


def test_an_unlinked_open_file_stays_until_its_last_handle_and_lookup_go(ops, monkeypatch):
    """unlink of a file open for reading, then forget of every lookup while a read
    of it waits for its blob: the inode and its bytes stay until the release, and
    go then."""
    import threading

    import trio.testing
    data = os.urandom(100_000)
    fetching, go_on = threading.Event(), threading.Event()
    real_get = ops.content.get

    def held_get(digest):
        fetching.set()
        go_on.wait(30)
        return real_get(digest)

    def exists(ino):
        return ops.db.ro.execute("SELECT 1 FROM inodes WHERE id=?", (ino,)).fetchone() is not None
    out = {}

    async def main():
        info, attr = await ops.ops.create(ns.ROOT_INODE, b"f", 0o100644, os.O_WRONLY, Ctx())
        ino = attr.st_ino
        await ops.ops.write(info.fh, 0, data)
        await ops.ops.release(info.fh)                     # committed: a blob
        await ops.ops.lookup(ns.ROOT_INODE, b"f", Ctx())   # (two lookups now)
        fh = (await ops.ops.open(ino, os.O_RDONLY, Ctx())).fh
        await ops.ops.unlink(ns.ROOT_INODE, b"f", Ctx())
        assert exists(ino)
        monkeypatch.setattr(ops.content, "get", held_get)
        async with trio.open_nursery() as nursery:
            async def read():
                out["read"] = await ops.ops.read(fh, 0, len(data))
            nursery.start_soon(read)
            await trio.to_thread.run_sync(fetching.wait)     # the read waits for its blob
            await ops.ops.forget([(ino, 2)])                 # the kernel lets go of the name
            out["after forget"] = exists(ino)
            go_on.set()
        out["after read"] = exists(ino)
        await ops.ops.release(fh)
        out["after release"] = exists(ino)
    trio.run(main)
    assert out["read"] == data
    assert out["after forget"] and out["after read"]
    assert not out["after release"]


def test_a_folder_listed_during_the_fork_that_fills_it_shows_none_then_every_page(ops, monkeypatch):
    """readdir of b/pages, opened before ``pffs fork a b`` and read while the fork's
    transaction is under way in the writer, lists no page (none is committed) and
    does not wait for it; listed again from the start once the fork committed
    (folded: one row for every page), it lists every page."""
    import json
    import threading

    import pyfuse3
    from manifests import good
    from pffs.names import FORK_XATTR_B as FORK_XATTR
    from pffs.namespace import changes
    from pffs.types import digest_of

    pages = [os.urandom(2048) for _ in range(3)]       # the geometry of good(): 2 KiB pages
    m = good()
    m["pages"] = [digest_of(p) for p in pages]
    forking, go_on = threading.Event(), threading.Event()
    real_fork = ns.fork_pages

    def held_fork(*args, **kw):
        created = real_fork(*args, **kw)
        forking.set()            # (in the writer, its transaction not committed)
        go_on.wait(30)
        return created

    def reply(token, name, attr, next_id):
        token.append(name)
        return True
    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)

    async def listed(fh):
        names: list[bytes] = []
        await ops.ops.readdir(fh, 0, names)
        return sorted(names)
    out = {}

    async def main():
        root = ns.ROOT_INODE
        a = (await ops.ops.mkdir(root, b"a", 0o755, Ctx())).st_ino
        a_pages = (await ops.ops.mkdir(a, b"pages", 0o755, Ctx())).st_ino
        for i, p in enumerate(pages):
            info, _ = await ops.ops.create(a_pages, f"{i:06d}".encode(), 0o644, os.O_WRONLY, Ctx())
            await ops.ops.write(info.fh, 0, p)
            await ops.ops.release(info.fh)
        info, _ = await ops.ops.create(a, b"manifest.json", 0o644, os.O_WRONLY, Ctx())
        await ops.ops.write(info.fh, 0, json.dumps(m).encode())
        await ops.ops.release(info.fh)
        b = (await ops.ops.mkdir(root, b"b", 0o755, Ctx())).st_ino
        b_pages = (await ops.ops.mkdir(b, b"pages", 0o755, Ctx())).st_ino
        fh = await ops.ops.opendir(b_pages, Ctx())
        monkeypatch.setattr(changes, "fork_pages", held_fork)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.ops.setxattr, b, FORK_XATTR, b"/a/manifest.json", Ctx())
            await trio.to_thread.run_sync(forking.wait)
            with trio.fail_after(10):
                out["during"] = await listed(fh)
            go_on.set()
        out["after"] = await listed(fh)
        await ops.ops.releasedir(fh)
    trio.run(main)
    assert out["during"] == []
    assert out["after"] == [b"000000", b"000001", b"000002"]


def test_a_copy_names_a_blob_stored_ahead_only_if_the_store_still_holds_it(ops):
    """A live page stored ahead of its copy is unreferenced until the copy names
    it, so a gc may take it meanwhile: the copy then names nothing (and copies
    the bytes), rather than leave a row naming a blob that is not stored."""
    from pffs.types import digest_of
    page = os.urandom(1 << 16)

    async def main():
        row = await ops.content.workers.call(ops.content.store_bytes, page)
        assert row.digest == digest_of(page) and ops.content.blobs.contains(row.digest)
        info, _ = await ops.ops.create(ns.ROOT_INODE, b"a", 0o100644, os.O_WRONLY, Ctx())
        assert await ops.files.take_blob(info.fh, row.digest, row.raw_size, row)
        await ops.ops.release(info.fh)
        # The same page stored again, then taken by a gc before its copy names it.
        gone = await ops.content.workers.call(ops.content.store_bytes, page + b"x")
        assert gone.digest == digest_of(page + b"x")
        os.unlink(ops.content.blobs.path(gone.digest))
        info, _ = await ops.ops.create(ns.ROOT_INODE, b"b", 0o100644, os.O_WRONLY, Ctx())
        taken = await ops.files.take_blob(info.fh, gone.digest, gone.raw_size, gone)
        await ops.ops.release(info.fh)
        return taken, gone
    taken, gone = trio.run(main)
    assert taken is False
    conn = ops.db.ro
    a, b = ns.lookup(conn, ns.ROOT_INODE, b"a"), ns.lookup(conn, ns.ROOT_INODE, b"b")
    assert ns.read_file(conn, ops.content.blobs, a) == page
    assert ns.get_inode(conn, b).size == 0
    assert conn.execute("SELECT COUNT(*) FROM blobs WHERE digest=?", (gone.digest,)).fetchone()[0] == 0


def test_a_change_made_on_the_event_loop_never_waits_for_a_lock(ops):
    """``write_small`` runs a change on the loop only where it need not wait:
    its transaction's busy timeout is 0 (the write connection's own is back
    for any other use; switched only where it changes), and with the write
    lock held by another process the change goes to the writer thread, which
    waits for it while the loop runs on."""
    import sqlite3
    db = ops.db

    def busy_timeout(conn):
        return conn.execute("PRAGMA busy_timeout").fetchone()[0]

    def mk(conn):
        return ns.make_inode(conn, ns.ROOT_INODE, b"g", stat.S_IFREG | 0o644, 0, 0).id

    other = sqlite3.connect(db.path, isolation_level=None)
    ran_meanwhile = []

    async def main():
        assert await db.write_small(busy_timeout) == 0
        assert db.counts == {"on_loop": 1, "by_writer": 0, "timeout_switches": 1}
        def in_a_worker():      # (the write connection is the worker threads')
            with db.writing() as conn:
                return busy_timeout(conn)
        assert await trio.to_thread.run_sync(in_a_worker) == ns.BUSY_TIMEOUT_MS
        for _ in range(3):      # (changes in a row on the loop switch it once)
            assert await db.write_small(busy_timeout) == 0
        assert db.counts["timeout_switches"] == 3
        other.execute("BEGIN IMMEDIATE")
        async with trio.open_nursery() as nursery:
            async def meanwhile():
                with trio.fail_after(30):           # (a guard against a hang, not a timing)
                    while db.counts["by_writer"] == 0:
                        await trio.sleep(0.001)
                ran_meanwhile.append(True)
                other.execute("ROLLBACK")
            nursery.start_soon(meanwhile)
            ino = await db.write_small(mk)
        return ino

    ino = trio.run(main)
    other.close()
    assert ran_meanwhile == [True]
    assert db.counts == {"on_loop": 4, "by_writer": 1, "timeout_switches": 4}
    assert ns.lookup(db.ro, ns.ROOT_INODE, b"g") == ino


def test_a_read_only_mount_refuses_every_change_in_its_handlers(tmp_path):
    """-o ro: the kernel refuses changes with EROFS before it asks; whatever would
    reach the handlers anyway is refused there too, and nothing changes.
    Reads, listings and extended attributes are served as ever."""
    import errno

    import pyfuse3
    store = StoreDir(tmp_path / "store")
    store.create()
    ns.open_db(store.root).close()
    db = Database(store.db_path)
    content = ContentStore(store.blobs, store.staging_dir)
    rw = build(db, content, nursery=None)
    ro = build(db, content, nursery=None, read_only=True)
    R = ns.ROOT_INODE
    out: dict = {}

    async def main():
        info, attr = await rw.ops.create(R, b"f", 0o100644, os.O_WRONLY, Ctx())
        await rw.ops.write(info.fh, 0, b"data")
        await rw.ops.release(info.fh)
        d = await rw.ops.mkdir(R, b"d", 0o755, Ctx())
        await rw.ops.setxattr(attr.st_ino, b"user.tag", b"v1", Ctx())
        f = attr.st_ino
        before = db.ro.execute("SELECT COUNT(*), MAX(ctime_ns) FROM inodes").fetchone()
        fh = (await ro.ops.open(f, os.O_RDONLY, Ctx())).fh
        out["read"] = bytes(await ro.ops.read(fh, 0, 10))
        await ro.ops.release(fh)
        out["xattr"] = await ro.ops.getxattr(f, b"user.tag", Ctx())
        sa = pyfuse3.SetattrFields()        # (refused before its fields are looked at)
        wfh = (await rw.ops.open(f, os.O_WRONLY, Ctx())).fh     # (a handle the kernel would not give)
        calls = {
            "create": lambda: ro.ops.create(R, b"g", 0o100644, os.O_WRONLY, Ctx()),
            "open for writing": lambda: ro.ops.open(f, os.O_RDWR, Ctx()),
            "open O_TRUNC": lambda: ro.ops.open(f, os.O_RDONLY | os.O_TRUNC, Ctx()),
            "write": lambda: ro.ops.write(wfh, 0, b"x"),
            "fallocate": lambda: ro.ops.fallocate(wfh, 0, 0, 100),
            "copy_file_range": lambda: ro.ops.copy_file_range(wfh, 0, wfh, 10, 4, 0),
            "setattr": lambda: ro.ops.setattr(f, attr, sa, None, Ctx()),
            "mkdir": lambda: ro.ops.mkdir(R, b"e", 0o755, Ctx()),
            "mknod": lambda: ro.ops.mknod(R, b"p", 0o010644, 0, Ctx()),
            "symlink": lambda: ro.ops.symlink(R, b"s", b"f", Ctx()),
            "unlink": lambda: ro.ops.unlink(R, b"f", Ctx()),
            "rmdir": lambda: ro.ops.rmdir(R, b"d", Ctx()),
            "rename": lambda: ro.ops.rename(R, b"f", R, b"h", 0, Ctx()),
            "link": lambda: ro.ops.link(f, d.st_ino, b"l", Ctx()),
            "setxattr": lambda: ro.ops.setxattr(f, b"user.tag", b"v2", Ctx()),
            "removexattr": lambda: ro.ops.removexattr(f, b"user.tag", Ctx()),
        }
        out["refused"] = {}
        for what, call in calls.items():
            try:
                await call()
                out["refused"][what] = 0
            except pyfuse3.FUSEError as e:
                out["refused"][what] = e.errno
        await rw.ops.release(wfh)
        out["same"] = db.ro.execute("SELECT COUNT(*), MAX(ctime_ns) FROM inodes").fetchone() == before
        out["names"] = sorted(n for n, in db.ro.execute("SELECT name FROM dentries WHERE parent=?", (R,)))
        out["bytes"] = ns.read_file(db.ro, content.blobs, f)
        out["tag"] = ns.get_xattr(db.ro, f, b"user.tag")
    try:
        trio.run(main)
    finally:
        content.workers.stop()
        rw.stop()
        ro.stop()
        db.close()
    assert out["read"] == b"data" and out["xattr"] == b"v1"
    assert out["refused"] == {what: errno.EROFS for what in out["refused"]}
    assert out["same"] and out["names"] == [b"d", b"f"]
    assert out["bytes"] == b"data" and out["tag"] == b"v1"
