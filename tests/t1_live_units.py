"""Level t1, units: no mount and no engine.
Live-engine parts without a mount or an engine: the wire protocol (messages and
descriptors on a socket), the staging slot cache, and sessions being copied in."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import threading

import pytest
import trio
import trio.testing

from pffs import manifest as mf
from pffs.live import protocol
from pffs.live.channel import TrioChannel
from pffs.live.incoming import IncomingSession, memfd_with
from pffs.live.slots import READY, SlotCache
from sessions import make_manifest

# ------------------------------------------------------------------------------ protocol


def test_messages_and_descriptors_cross_a_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = protocol.Channel(a), protocol.Channel(b)
    r, w = os.pipe()
    sender = threading.Thread(target=lambda: (
        ca.send({"op": "x", "n": 1}, [r]),
        ca.send({"op": "big", "blob": "z" * (3 << 20)}),     # more than a socket buffer holds
        ca.send({"op": "y"})))
    sender.start()
    try:
        msg, fds = cb.recv()
        assert msg == {"op": "x", "n": 1} and len(fds) == 1
        os.write(w, b"hi")
        assert os.read(fds[0], 2) == b"hi"               # the same pipe, passed along
        os.close(fds[0])
        assert cb.recv()[0]["blob"] == "z" * (3 << 20)
        assert cb.recv() == ({"op": "y"}, [])
        sender.join()
        ca.close()
        assert cb.recv() is None
    finally:
        os.close(r)
        os.close(w)
        cb.close()


@pytest.mark.parametrize("raw, why", [
    (struct.pack("<I", protocol.MAX_MESSAGE + 1), "exceeds"),
    (struct.pack("<I", 5) + b"[1,2]", "JSON object"),
    (struct.pack("<I", 3) + b"{no", "not JSON"),
    (struct.pack("<I", 10) + b"{}", "inside a message"),
])
def test_malformed_messages_are_refused(raw, why):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendall(raw)
    a.close()
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.Channel(b).recv()
    b.close()


def test_trio_channel_speaks_the_same_protocol():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("t")

    async def main():
        chan = TrioChannel(trio.socket.from_stdlib_socket(b))
        await chan.send({"op": "ping"}, [fd])
        got, fds = protocol.Channel(a).recv()
        assert got == {"op": "ping"} and len(fds) == 1
        assert stat.S_ISREG(os.fstat(fds[0]).st_mode)
        os.close(fds[0])
        protocol.Channel(a).send({"re": 1, "ok": True})
        assert await chan.recv() == ({"re": 1, "ok": True}, [])
        a.close()
        assert await chan.recv() is None
        chan.close()
    try:
        trio.run(main)
    finally:
        os.close(fd)


def test_long_socket_paths_are_reached(tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    path = deep / "engine.sock"
    with protocol.ShortPath(path) as address:
        assert len(address) < 108
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(address)
        srv.listen(1)
    c = protocol.connect(path)
    conn, _ = srv.accept()
    pid, uid, _ = protocol.peer_credentials(conn)
    assert (pid, uid) == (os.getpid(), os.getuid())
    for s in (c, conn, srv):
        s.close()


def test_folder_names():
    assert protocol.valid_name("req-17") and protocol.valid_name("ü")
    for bad in ("", ".", "..", "a/b", "a\0b", "x" * 256, "tab\t", 7, None):
        assert not protocol.valid_name(bad), bad

# ------------------------------------------------------------------------------ slots


def test_slots_evict_least_recently_used_and_never_what_is_held():
    async def main():
        c = SlotCache(3)
        c.live_snaps.add(1)
        got = c.claim(3)
        assert sorted(got) == [0, 1, 2]
        c.loaded(got, [(1, 0), (1, 1), (1, 2)])
        c.hold(c.ready_slot((1, 0)))
        c.ready_slot((1, 1))                       # page 1 used after page 2
        assert c.claim(1) == [2]                   # least recently used first
        assert c.claim(1) == [1]
        assert c.claim(1) == []                    # page 0 is held: kept
        assert (1, 0) in c.slot_of
        c.unclaim([1, 2])
        # A released snapshot's pages go once let go.
        held = c.ready_slot((1, 0))
        c.drop_snapshot(1)
        assert (1, 0) in c.slot_of
        c.unhold(held)
        assert (1, 0) not in c.slot_of and c.state[held] != READY
        assert sorted(c.claim(5)) == [0, 1, 2]
    trio.run(main)


def test_a_claim_waits_for_a_slot_to_come_free():
    async def main():
        c = SlotCache(1)
        c.live_snaps.add(1)
        s = c.claim(1)
        c.loaded(s, [(1, 0)])
        c.hold(s[0])
        got = []
        async with trio.open_nursery() as n:
            async def claimer():
                got.extend(await c.claim_some(1))
            n.start_soon(claimer)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            c.unhold(s[0])
        assert got == s
    trio.run(main)

# ------------------------------------------------------------------------------ incoming


PB = 2 * 6 * 16 * 12 * 32 * 2     # tests' session geometry


def _incoming(n_pages: int):
    inc = IncomingSession("s", 1000, 0o755, 0, 0)
    pages = inc.make(inc.root, b"pages", stat.S_IFDIR | 0o755, 0, 0)
    data = [bytes([i]) * PB for i in range(n_pages)]
    m = make_manifest(data)
    return inc, pages, data, m


def _arrive(inc, parent, name, data):
    node = inc.make(parent, name, stat.S_IFREG | 0o644, 0, 0)
    inc.write(node, 0, data)
    inc.closed(node)
    return node


class _NotWalked(dict):
    """Children a folder's attributes must not go through (one GETATTR of
    pages/ a file of a copy into engines/ would make the copy O(pages^2))."""

    def values(self):
        raise AssertionError("a folder's attributes went through its children")

    items = __iter__ = values   # type: ignore[assignment]


def test_a_folder_being_copied_in_counts_its_subfolders_as_they_change():
    """Node.subdirs (the link count 2 + subfolders) follows mkdir, create,
    unlink, rmdir and rename, and a folder's attributes read it without
    going through its children."""
    from pffs.live.attrs import LiveAttrs
    from pffs.live.numbering import KernelCache
    from pffs.live.registry import LiveRegistry

    inc, pages, _, _ = _incoming(1)
    cache = KernelCache(None)
    attrs = LiveAttrs(LiveRegistry(cache), cache)

    def folders(node):
        return sum(stat.S_ISDIR(c.mode) for c in dict.values(node.children))

    a = inc.make(inc.root, b"a", stat.S_IFDIR | 0o755, 0, 0)
    b = inc.make(a, b"b", stat.S_IFDIR | 0o755, 0, 0)
    for i in range(300):
        inc.make(pages, mf.page_name(i).encode(), stat.S_IFREG | 0o644, 0, 0)
    inc.make(a, b"f", stat.S_IFREG | 0o644, 0, 0)
    assert (inc.root.subdirs, a.subdirs, b.subdirs, pages.subdirs) == (2, 1, 0, 0)
    inc.move(b, inc.root, b"b2")                  # a folder moved up a level
    assert (inc.root.subdirs, a.subdirs) == (3, 0)
    inc.move(a.children[b"f"], pages, b"f")       # a file moved: no folder counts change
    assert (inc.root.subdirs, a.subdirs, pages.subdirs) == (3, 0, 0)
    inc.detach(a)
    assert inc.root.subdirs == 2
    for node in (inc.root, pages, b):
        assert node.subdirs == folders(node)
        node.children = _NotWalked(node.children)
        assert attrs.node(node).st_nlink == 2 + folders(node)
    inc.drop()
    assert inc.root.subdirs == 0


def test_a_session_is_complete_once_the_manifest_and_every_page_arrived():
    inc, pages, data, m = _incoming(3)
    _arrive(inc, pages, b"000002", data[2])
    node = _arrive(inc, inc.root, b"manifest.json", m.to_json())
    inc.set_manifest(mf.parse(bytes(node.data)), bytes(node.data))
    assert not inc.complete()
    _arrive(inc, pages, b"000000", data[0])
    one = inc.make(pages, b"000001", stat.S_IFREG | 0o644, 0, 0)
    inc.write(one, 0, data[1][:100])
    assert not inc.complete()                    # still being written
    inc.write(one, 100, data[1][100:])
    inc.closed(one)
    assert inc.complete()
    inc.write(one, 0, b"x")                      # written again: not arrived until closed
    assert not inc.complete()
    inc.closed(one)
    assert inc.complete()
    inc.detach(one)
    assert not inc.complete()
    # A temp file renamed into place (rsync) arrives with its name.
    tmp = _arrive(inc, pages, b".000001.Xyz", data[1])
    assert not inc.complete()
    inc.move(tmp, pages, b"000001")
    assert inc.complete()
    assert [bytes(n.data) for n in inc.page_nodes()] == data
    # Page files not named canonically do not count; other files are ignored.
    assert inc.page_index(tmp) == 1 and inc.page_index(inc.root.children[b"manifest.json"]) is None
    assert inc.drop() == sum(len(d) for d in data) + len(m.to_json())


def test_moving_pages_away_or_the_manifest_out_makes_it_incomplete():
    inc, pages, data, m = _incoming(1)
    _arrive(inc, pages, b"000000", data[0])
    node = _arrive(inc, inc.root, b"manifest.json", m.to_json())
    inc.set_manifest(m, m.to_json())
    assert inc.complete()
    inc.move(pages, inc.root, b"elsewhere")
    assert not inc.complete()
    inc.move(pages, inc.root, b"pages")
    assert inc.complete()
    inc.move(node, inc.root, b"old.json")
    assert inc.manifest is None and not inc.complete()


def test_the_page_in_memfd_holds_pages_then_the_manifest():
    pages = [bytearray(b"a" * 8), bytearray(b"b" * 3), bytearray(b"c" * 8)]
    fd = memfd_with(pages, 8, b"{}")
    try:
        assert os.pread(fd, 100, 0) == b"a" * 8 + b"\0" * 8 + b"c" * 8 + b"{}"
        with pytest.raises(OSError) as ei:
            os.write(fd, b"x")                      # sealed
        assert ei.value.errno == errno.EPERM
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ store-ahead


def test_pages_are_stored_ahead_in_the_order_a_copy_asks_for_them():
    """CopyOut._store_ahead: a copy out of a live session (cp -r, one file at a
    time, page 0 first) finds its pages stored in that order, a snapshot's
    pages named by the digests its manifest lists."""
    from pffs.live.copyout import STORE_AT_ONCE, CopyOut
    from pffs.live.handles import LiveStore
    from pffs.live.pages import Snapshot

    started: list[int] = []
    stored: list[tuple[int, str | None]] = []

    class Engine:     # what the store-ahead asks of a live engine: its pages, a batch a gather
        def gather_batch(self) -> int:
            return 4

        def gather_soon(self, snap, ixs):
            pass

        async def with_page(self, snap, ix, fn, ahead=()):
            started.append(ix)
            return await fn(memoryview(bytes([ix])))

    async def main():
        engine = Engine()
        snap = Snapshot(1, "s", 12)
        snap.skeleton = make_manifest([bytes([i]) * 8 for i in range(12)])
        snap.manifest = b"{}"

        async def store_blob(data, digest=None):
            await trio.sleep(0)
            stored.append((data[0], digest))
            return data[0]

        async def fetch_blob(digest):
            raise AssertionError("no blob is read")
        async with trio.open_nursery() as nursery:
            copy_out = CopyOut(LiveStore(fetch_blob, store_blob), {"pages_stored": 0}, nursery)
            copy_out._store_ahead(engine, snap, range(12))   # type: ignore[arg-type]
            assert copy_out._store_runners == STORE_AT_ONCE
        assert all(snap.storing[i].is_set() for i in range(12))
        return snap
    snap = trio.run(main)
    assert started == list(range(12))
    assert sorted(ix for ix, _ in stored) == list(range(12))
    assert all(d == snap.skeleton.pages[ix] for ix, d in stored)    # (not hashed again)
