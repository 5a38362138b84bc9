"""FUSE handlers called in-process, without a mount, over a real store: what the
kernel cannot be made to do on purpose."""

from __future__ import annotations

import logging
import stat

import pytest
import trio

from pffs import namespace as ns
from pffs.fs.content import ContentStore
from pffs.fs.db import Database
from pffs.fs.operations import Operations
from pffs.storedir import StoreDir


@pytest.fixture
def ops(tmp_path):
    store = StoreDir(tmp_path / "store")
    store.create()
    ns.open_db(store.root).close()
    db = Database(store.db_path)
    content = ContentStore(store.blobs, store.staging_dir)
    o = Operations(db, content)
    yield o
    content.workers.stop()
    o.prefetcher.stop()
    db.close()


def test_a_forget_past_the_lookup_count_is_said_once(ops, caplog):
    """The kernel forgetting more lookups than pffs counted is a counting bug:
    one warning (never a silent clamp), and the inode is let go as before."""
    async def main():
        def mk(conn):
            return ns.make_inode(conn, ns.ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0).id
        ino = await ops.db.write(mk)
        ops._lookup_inc(ino, 2)
        await ops.forget([(ino, 2)])          # as counted: nothing said
        await ops.forget([(ino, 3)])          # three more than counted
        await ops.forget([(ino, 1)])          # (said once only)
        return ino
    with caplog.at_level(logging.WARNING, logger="pffs.fs"):
        ino = trio.run(main)
    said = [r.getMessage() for r in caplog.records if "forget of inode" in r.getMessage()]
    assert said == [f"forget of inode {ino}: the kernel forgot 3 lookups, pffs counted 0"]
    assert ino not in ops.lookups


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
