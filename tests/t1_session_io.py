"""Level t1, units: no mount and no engine.
The write path's crash-safety steps (engine_bridge.transport.store_puts.PagePuts)
against a real local store folder, and the sink and source protocols'
optional members: declared, with defaults, for foreign sinks and sources too."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch

from engine_bridge import Bridge, DirSink, DirSource, KVPool, MemorySession, RefCountingAllocator, SeqBlocks
from engine_bridge.errors import IncompleteSession, WrongSizePage
from engine_bridge.transport.choose import (
    PageSinkAdapter,
    SinkAdapter,
    SourceAdapter,
    as_page_sink,
    as_sink,
    as_source,
)
from engine_bridge.transport.direct import DirectSink, DirectSource
from engine_bridge.transport.mountinfo import StoreAccess
from engine_bridge.transport.session_io import PageSink, SessionSink, SessionSource, SinkBase, SourceBase
from engine_bridge.transport.store_blobs import BlobSink, BlobSource
from engine_bridge.transport.store_puts import PagePuts
from pffs.client.offline import StoreSessionSink, StoreSessionSource
from pffs.codec import DEFAULT_CODEC
from pffs.store.local import LocalBlobStore
from pffs.store.storedir import GC_LOCK_NAME, PINS_DIR, GcLock, StoreDir
from pffs.types import digest_of

# --------------------------------------------------------------- PagePuts


@pytest.fixture
def access(tmp_path) -> StoreAccess:
    store = StoreDir(tmp_path / "store")
    store.create()
    return StoreAccess(mountpoint=str(tmp_path), root=store.root, codec=DEFAULT_CODEC)


def lock_is_free(root) -> bool:
    """Whether gc could take the gc lock exclusively now (a non-blocking try)."""
    fd = os.open(root / GC_LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def pinned_in_files(root) -> set[str]:
    out: set[str] = set()
    for p in (root / PINS_DIR).iterdir():
        out.update(line.strip() for line in p.read_text().splitlines() if line.strip())
    return out


def pin_files(root) -> list:
    return list((root / PINS_DIR).iterdir())


def test_page_puts_pin_and_hold_until_stored_then_the_pins_alone_until_closed(access):
    root = access.root
    pages = [os.urandom(4096) for _ in range(6)]
    puts = PagePuts(access)
    assert not lock_is_free(root)            # held shared from the start
    assert len(pin_files(root)) == 1
    digests = [puts.put(memoryview(p)) for p in pages[:3]]
    digests.append(puts.put(pages[3], digest_of(pages[3]), durable=True))
    assert digests == [digest_of(p) for p in pages[:4]]
    # After the puts, before stored(): every digest pinned, the lock still held.
    assert pinned_in_files(root) == set(digests)
    assert not lock_is_free(root)
    assert set(digests) <= GcLock(root).pinned()    # what gc reads inside its section
    assert all(access.blobs().contains(d) for d in digests)

    puts.stored()
    # The lock goes before the caller names the pages; the pins stay.
    assert lock_is_free(root)
    assert pinned_in_files(root) == set(digests)
    assert set(digests) <= GcLock(root).pinned()
    with pytest.raises(ValueError):
        puts.put(pages[4])                   # a pin added without the lock would not be kept

    puts.close()
    assert pin_files(root) == []
    assert lock_is_free(root)
    puts.close()                             # idempotent


def test_page_puts_pin_each_page_before_it_is_put_while_the_lock_is_held(access):
    root = access.root
    seen = []

    class Watched(LocalBlobStore):
        def put(self, data, digest=None, **kw):
            seen.append((digest, digest in pinned_in_files(root), lock_is_free(root), kw.get("batch")))
            return super().put(data, digest, **kw)

    blobs = Watched(root, codec=DEFAULT_CODEC)
    pages = [os.urandom(2048) for _ in range(8)]
    with PagePuts(access, blobs) as puts:
        threads = [threading.Thread(target=puts.put, args=(p,)) for p in pages]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        puts.put(pages[0], durable=True)
        puts.stored()
    assert len(seen) == 9
    assert all(pinned and not free for _, pinned, free, _ in seen)
    assert [b is None for *_, b in seen].count(True) == 1   # the durable one: no batch
    assert pin_files(root) == [] and lock_is_free(root)


def test_page_puts_closed_before_stored_let_the_lock_and_the_pins_go(access):
    root = access.root
    with PagePuts(access) as puts:
        puts.put(os.urandom(1000))
        assert not lock_is_free(root) and len(pin_files(root)) == 1
    assert lock_is_free(root) and pin_files(root) == []
    with pytest.raises(RuntimeError):
        with PagePuts(access) as puts:
            raise RuntimeError("the caller failed")
    assert lock_is_free(root) and pin_files(root) == []


def test_direct_sink_keeps_its_steps_through_page_puts(access, tmp_path):
    """DirectSink's own steps (the lock held until commit, pins until named) go
    through PagePuts; its abort lets everything go."""
    sink = DirectSink(tmp_path / "s", access)
    assert isinstance(sink.puts, PagePuts)
    d = sink.write_page(0, memoryview(b"x" * 100))
    assert not lock_is_free(access.root) and d in pinned_in_files(access.root)
    sink.abort()
    assert lock_is_free(access.root) and pin_files(access.root) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".s.tmp")]


# ------------------------------------------------- protocols and their defaults


GEOM = dict(block_size=4, n_layers=2, n_heads=2, head_dim=8)


def bridge(n_blocks: int = 12, seed: int = 0) -> Bridge:
    pool = KVPool.allocate(num_blocks=n_blocks, dtype=torch.float32, **GEOM)
    gen = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return Bridge(pool, RefCountingAllocator(pool.num_blocks), engine_name="t")


def seq_of(n: int) -> SeqBlocks:
    return SeqBlocks("s", list(range(n)), n * GEOM["block_size"] - 1)


class ForeignSink:
    """A sink with only the core methods (no ``concurrent``, no base class)."""

    def __init__(self):
        self.inner = MemorySession()
        self.calls: list[tuple[int, int]] = []

    def write_page(self, ix, data):
        self.calls.append((ix, threading.get_ident()))
        return self.inner.write_page(ix, data)

    def write_manifest(self, data):
        self.inner.write_manifest(data)

    def commit(self):
        self.inner.commit()

    def abort(self):
        self.inner.abort()


class ForeignSource:
    """A source with only the core methods (no page_digest even)."""

    def __init__(self, session: MemorySession, pages: dict[int, bytes] | None = None):
        self.session = session
        self.pages = dict(session.pages) if pages is None else pages
        self.reads: list[int] = []

    def read_manifest(self):
        return self.session.read_manifest()

    def read_page(self, ix):
        self.reads.append(ix)
        try:
            return self.pages[ix]
        except KeyError:
            raise FileNotFoundError(ix) from None


def test_every_sink_and_source_has_the_protocols_members():
    for cls in (DirSink, MemorySession, BlobSink, DirectSink):
        assert issubclass(cls, SinkBase) and isinstance(cls.concurrent, bool)
    for cls in (DirSource, MemorySession, BlobSource, DirectSource):
        assert issubclass(cls, SourceBase)
    from engine_bridge.attach.agent import _ShmSource
    assert issubclass(_ShmSource, SourceBase)
    # pffs does not import the bridge: its offline sink and source carry the members themselves.
    assert isinstance(StoreSessionSink.concurrent, bool)
    for name in ("page_digest", "page_size", "read_page_into", "read_page_into_checked", "why_mismatch"):
        assert callable(getattr(StoreSessionSource, name))
    m = MemorySession()
    assert as_sink(m) is m and as_source(m) is m


def test_source_base_defaults():
    class Plain(SourceBase):
        def read_manifest(self):
            return b"{}"

        def read_page(self, ix):
            return b"abcd"

    s = Plain()
    assert isinstance(s, SessionSource)
    assert s.page_digest(0) is None and s.page_size(0) is None and s.why_mismatch(0) is None
    out = bytearray(4)
    assert s.read_page_into_checked(0, memoryview(out)) == (4, None) and out == b"abcd"
    out = bytearray(3)
    assert s.read_page_into(0, memoryview(out)) == 4 and out == bytes(3)   # another size: untouched


def test_a_foreign_sink_and_source_with_only_the_core_methods_still_work():
    br = bridge()
    sink = ForeignSink()
    wrapped = as_sink(sink)
    assert not isinstance(sink, SessionSink)
    assert isinstance(wrapped, SinkAdapter) and isinstance(wrapped, SessionSink)
    assert wrapped.concurrent is False
    m = br.page_out([seq_of(10)], sink)
    # concurrent False: pages in order, from one thread.
    assert [ix for ix, _ in sink.calls] == list(range(10))
    assert len({t for _, t in sink.calls}) == 1
    assert [sink.inner.digests[i] for i in range(10)] == m.pages

    src = ForeignSource(sink.inner)
    wrapped_src = as_source(src)
    assert isinstance(wrapped_src, SourceAdapter) and isinstance(wrapped_src, SessionSource)
    assert wrapped_src.page_size(0) is None and wrapped_src.page_digest(0) is None
    assert wrapped_src.why_mismatch(0) is None
    res = br.page_in(src)
    assert len(res.blocks) == 10 and sorted(set(src.reads)) == list(range(10))
    for a, b in zip(range(10), res.blocks):
        assert all(torch.equal(layer[:, a], layer[:, b]) for layer in br.pool.layers)
    br.allocator.free(res.blocks)

    # No page_size: no pre-check; a missing or wrong-size page is refused when read.
    pages = dict(sink.inner.pages)
    del pages[3]
    with pytest.raises(IncompleteSession):
        br.page_in(ForeignSource(sink.inner, pages))
    pages = dict(sink.inner.pages)
    pages[4] = pages[4][:-1]
    with pytest.raises(WrongSizePage):
        br.page_in(ForeignSource(sink.inner, pages))


def test_a_foreign_source_keeps_the_optional_members_it_has():
    br = bridge()
    mem = MemorySession()
    br.page_out([seq_of(6)], mem)

    class WithSizes(ForeignSource):
        def page_digest(self, ix):
            return self.session.page_digest(ix)

        def page_size(self, ix):
            return len(self.pages[ix]) if ix in self.pages else self.missing(ix)

        def missing(self, ix):
            raise FileNotFoundError(ix)

        def read_page_into(self, ix, out):
            self.into = getattr(self, "into", 0) + 1
            data = self.read_page(ix)
            if len(data) == len(out):
                out[:] = data
            return len(data)

    src = WithSizes(mem)
    wrapped = as_source(src)
    assert isinstance(wrapped, SourceAdapter)
    assert wrapped.page_size(0) == br.pool.page_bytes and wrapped.page_digest(1) == mem.digests[1]
    res = br.page_in(src)
    assert src.into == 6
    br.allocator.free(res.blocks)
    # With page_size the pre-check refuses a missing page before any read.
    pages = dict(mem.pages)
    del pages[5]
    src = WithSizes(mem, pages)
    with pytest.raises(IncompleteSession):
        br.page_in(src)
    assert src.reads == []


def test_not_a_sink_or_source_is_refused():
    with pytest.raises(TypeError):
        as_sink(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        as_source(object())  # type: ignore[arg-type]


def test_write_blocks_takes_a_sink_of_pages_alone(access):
    """Bridge.write_blocks needs write_page (and concurrent) only: a BlobSink
    (an agent's ``store``) as it is, an object with write_page alone from one
    thread, in order."""
    br = bridge()
    sink = BlobSink(access)
    assert isinstance(sink, PageSink) and as_page_sink(sink) is sink and not isinstance(sink, SessionSink)
    digests = br.write_blocks(list(range(5)), [GEOM["block_size"]] * 5, sink)
    assert [sink.rows[i][0] for i in range(5)] == digests
    assert all(access.blobs().contains(d) for d in digests)

    calls = []

    class PagesOnly:
        def write_page(self, ix, data):
            calls.append((ix, threading.get_ident()))
            return digest_of(data)
    assert isinstance(as_page_sink(PagesOnly()), PageSinkAdapter)
    assert br.write_blocks(list(range(5)), [GEOM["block_size"]] * 5, PagesOnly()) == digests
    assert [ix for ix, _ in calls] == list(range(5)) and len({t for _, t in calls}) == 1
    with pytest.raises(TypeError):
        as_page_sink(object())
