"""Level t1, units: no mount and no engine.
The S3 blob store against a real S3 server (SeaweedFS), without a mount: layout and
frames, put-if-absent, verified reads, the bounded local cache, batches, trash,
binding cache folders, and bounded failure on a dead endpoint."""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time

import pytest

from pffs import codec
from pffs.errors import CorruptBlob, MissingBlob, PffsError, StoreUnavailable
from pffs.store.s3 import S3BlobStore, parse_url, url_of
from pffs.store.storedir import StoreDir
from pffs.types import digest_bytes, digest_hex
from seaweed import weed  # noqa: F401  (fixture)
from sessions import digest, varied_pages


@pytest.fixture
def store(weed, tmp_path):
    bucket = weed.make_bucket()
    s = S3BlobStore(tmp_path / "cache", f"s3://{bucket}/pre/fix")
    s.create_dirs()
    yield s
    s.close()


def test_urls():
    assert parse_url("s3://bkt/a//b/") == ("bkt", "a/b/")
    assert parse_url("s3://bkt") == ("bkt", "")
    assert url_of("s3://bkt/a/b/") == "s3://bkt/a/b" and url_of("/tmp/x") is None
    for bad in ("s3://B/x", "s3://ab/x", "s3://bkt/../x"):
        with pytest.raises(PffsError):
            parse_url(bad)


def test_blobs_keep_the_local_layout_and_frames(weed, store, bf16_pages):
    page = bf16_pages[0]
    d = digest(page)
    r = store.put(page)
    assert not r.existed and r.digest == d and r.raw_size == len(page)
    key = f"pre/fix/blobs/{digest_hex(d)[:2]}/{digest_hex(d)}"
    obj = weed.client.get_object(Bucket=store.bucket, Key=key)
    frame = obj["Body"].read()
    assert frame == codec.encode(page, store.codec, name=digest_bytes(d)) and len(frame) == r.stored_size
    assert obj["Metadata"] == {"pffs-raw-size": str(len(page)), "pffs-codec": "planes-zstd1"}
    # Put only if absent: a second put reuses the object.
    again = store.put(page)
    assert again.existed and again.stored_size == r.stored_size
    assert store.contains(d) and list(store) == [d]
    assert store.get(d) == page and store.header(d).raw_len == len(page)
    row = store.lookup(d)
    assert (row.raw_size, row.stored_size, row.codec) == (len(page), len(frame), "planes-zstd1")


def test_reads_are_verified(weed, store, bf16_pages):
    page = bf16_pages[1]
    d = digest(page)
    store.put(page)
    key = store.key(d)
    # A damaged cached frame is dropped and read again from the bucket.
    store.cache.store.path(d).write_bytes(b"PFB1 garbage")
    assert store.get(d) == page
    # A damaged object in the bucket is never returned.
    store.cache.discard(d)
    other = codec.encode(bf16_pages[2], store.codec)
    weed.client.put_object(Bucket=store.bucket, Key=key, Body=other)
    with pytest.raises(CorruptBlob, match="sha256"):
        store.get(d)
    assert d not in store.cache
    # A frame that names the other blob is refused by its name.
    named = codec.encode(bf16_pages[2], store.codec, name=digest_bytes(digest(bf16_pages[2])))
    weed.client.put_object(Bucket=store.bucket, Key=key, Body=named)
    with pytest.raises(CorruptBlob, match="names another blob"):
        store.get(d)
    assert d not in store.cache
    weed.client.delete_object(Bucket=store.bucket, Key=key)
    with pytest.raises(MissingBlob):
        store.get(d)


def test_cache_is_bounded_lru_by_bytes(weed, store, bf16_pages):
    pages = varied_pages(bf16_pages, 6)
    frame_size = len(codec.encode(pages[0], store.codec))
    store.set_cache_limit(3 * frame_size + frame_size // 2)
    for p in pages:
        store.put(p)
    assert store.cache.used <= store.cache.limit
    cached = [digest(p) in store.cache for p in pages]
    assert cached == [False, False, False, True, True, True]
    assert len(list(store.cache.store)) == 3
    # Evicted blobs come back from the bucket, and are cached again (evicting the oldest).
    assert store.get(digest(pages[0])) == pages[0]
    assert digest(pages[0]) in store.cache and digest(pages[3]) not in store.cache
    # The LRU order survives a restart (file times).
    fresh = S3BlobStore(store.root, store.url)
    fresh.set_cache_limit(store.cache.limit)
    assert digest(pages[0]) in fresh.cache and fresh.cache.used == store.cache.used


def test_batch_uploads_run_in_parallel_and_sync_waits(weed, store, bf16_pages):
    pages = varied_pages(bf16_pages, 16, salt=3)
    batch = store.batch()
    results = [store.put(p, batch=batch) for p in pages]
    assert not any(r.existed for r in results)
    assert batch.sync() == []
    keys = weed.objects(store.bucket, "pre/fix/blobs/")
    assert {"sha256:" + k.rsplit("/", 1)[1] for k in keys} == {digest(p) for p in pages}
    # A failed upload makes sync raise (here: refused credentials).
    refused = S3BlobStore(store.root, store.url, options={
        "access_key": os.environ["AWS_ACCESS_KEY_ID"], "secret_key": "wrong"})
    page = varied_pages(bf16_pages, 1, salt=4)[0]
    refused._remember(digest(page), None)  # known absent: put goes straight to the upload
    b2 = refused.batch()
    refused.put(page, batch=b2)
    with pytest.raises(StoreUnavailable, match="access denied"):
        b2.sync()
    refused.close()


def test_set_aside_blobs_are_read_and_put_back(weed, store, bf16_pages):
    page = bf16_pages[3]
    d = digest(page)
    store.put(page)
    store.cache.discard(d)
    c = weed.client
    c.copy_object(Bucket=store.bucket, Key=store.key(d, "trash/"),
                  CopySource={"Bucket": store.bucket, "Key": store.key(d)})
    c.delete_object(Bucket=store.bucket, Key=store.key(d))
    assert store.get(d) == page
    c.head_object(Bucket=store.bucket, Key=store.key(d))  # back in place


def test_cache_folders_are_bound_to_one_url(weed, tmp_path):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/p"
    st = StoreDir(url, cache=tmp_path / "c", remote={
        "endpoint": weed.endpoint, "access_key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret_key": os.environ["AWS_SECRET_ACCESS_KEY"]})
    assert st.url == url and st.root == tmp_path / "c"
    cfg = json.loads((tmp_path / "c" / "remote.json").read_text())
    assert cfg == {"url": url, "endpoint": weed.endpoint}  # never a secret
    again = StoreDir(tmp_path / "c")
    assert again.url == url and again.blobs.endpoint == weed.endpoint
    with pytest.raises(PffsError, match="cache folder of"):
        StoreDir(f"s3://{bucket}/other", cache=tmp_path / "c")
    local = StoreDir(tmp_path / "local")
    local.create()
    (tmp_path / "local" / "namespace.db").write_bytes(b"")
    with pytest.raises(PffsError, match="local pffs store"):
        StoreDir(url, cache=tmp_path / "local")


def test_dead_endpoint_fails_in_bounded_time(tmp_path, bf16_pages):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    store = S3BlobStore(tmp_path, "s3://nobody/x", options={
        "endpoint": f"http://127.0.0.1:{port}", "access_key": "k", "secret_key": "s",
        "region": "us-east-1", "s3_timeout": "1", "s3_retries": "2"})
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="nobody/x"):
        store.put(bf16_pages[0])
    with pytest.raises(StoreUnavailable):
        store.get(digest(bf16_pages[0]))
    assert not store.contains(digest(bf16_pages[0]))
    assert time.monotonic() - t0 < 15
    store.close()


class Blackhole:
    """A TCP relay to a server that can swallow requests: while ``stall`` is set,
    the connection that sends next is black-holed for good (no answer, not closed)."""

    def __init__(self, port: int):
        self.target = port
        self.stall = False
        self.swallowed = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [c, u]
            threading.Thread(target=self._relay, args=(c, u), daemon=True).start()

    def _relay(self, c: socket.socket, u: socket.socket) -> None:
        holed = False
        try:
            while True:
                r, _, _ = select.select([c, u], [], [], 0.5)
                if self.closed:
                    return
                for s in r:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is c and self.stall:
                        holed = True
                        self.swallowed.set()
                    if not holed:
                        (u if s is c else c).sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.closed = True
        for s in [self.sock, *self.conns]:
            s.close()


def test_a_timeout_that_straddles_an_answer_does_not_hold_the_store(weed, tmp_path, bf16_pages):
    """A request that times out after the endpoint answered others since it began
    does not mark the endpoint silent: the next request is sent, not refused."""
    hole = Blackhole(weed.s3)
    bucket = weed.make_bucket()
    store = S3BlobStore(tmp_path, f"s3://{bucket}/x", options={
        "endpoint": f"http://127.0.0.1:{hole.port}", "s3_timeout": "1", "s3_retries": "1"})
    try:
        a, b = bf16_pages[0], bf16_pages[1]
        store.put(a), store.put(b)
        store.cache.discard(digest(a)), store.cache.discard(digest(b))
        failed = []

        def slow():
            try:
                store.get(digest(a))
            except StoreUnavailable as e:
                failed.append(e)
        hole.stall = True
        t = threading.Thread(target=slow)
        t.start()
        assert hole.swallowed.wait(10)
        hole.stall = False
        assert store.get(digest(b)) == b          # answered while the first request hangs
        t.join(30)
        assert failed and "timeout" in str(failed[0]).lower(), failed
        store.cache.discard(digest(b))
        assert store.get(digest(b)) == b          # sent at once, not refused as "no answer"
        assert store.get(digest(a)) == a
        # With nothing answered since it began, a timeout does hold: the next
        # request fails at once instead of waiting out the timeout again.
        store.cache.discard(digest(a)), store.cache.discard(digest(b))
        hole.swallowed.clear()
        hole.stall = True
        with pytest.raises(StoreUnavailable, match="(?i)timeout"):
            store.get(digest(a))
        with pytest.raises(StoreUnavailable, match="no answer a moment ago"):
            store.get(digest(b))                  # refused without a request
    finally:
        store.close()
        hole.close()


def test_a_background_write_that_times_out_does_not_hold_the_store(weed, tmp_path, bf16_pages):
    """A mount's registration write that gets no answer (a server restarting
    under it) leaves the endpoint open: the next blob request is sent."""
    hole = Blackhole(weed.s3)
    bucket = weed.make_bucket()
    store = S3BlobStore(tmp_path, f"s3://{bucket}/x", options={
        "endpoint": f"http://127.0.0.1:{hole.port}", "s3_timeout": "1", "s3_retries": "1"})
    try:
        a = bf16_pages[0]
        store.put(a)
        store.cache.discard(digest(a))
        hole.stall = True
        with pytest.raises(StoreUnavailable, match="(?i)timeout"):
            store.put_object("mounts/test", b"{}", background=True)
        assert hole.swallowed.is_set()
        hole.stall = False
        assert store.get(digest(a)) == a          # sent, not refused as "no answer"
        # The same write on a user's behalf holds it.
        store.cache.discard(digest(a))
        hole.swallowed.clear()
        hole.stall = True
        with pytest.raises(StoreUnavailable, match="(?i)timeout"):
            store.put_object("mounts/test", b"{}")
        hole.stall = False
        with pytest.raises(StoreUnavailable, match="no answer a moment ago"):
            store.get(digest(a))
    finally:
        store.close()
        hole.close()


def test_a_page_costs_one_lean_request_and_no_boto3_call(weed, tmp_path, bf16_pages):
    """A blob's PUT and GET, a small object's PUT and GET and a HEAD go on the
    lean path (pffs.store.s3lean: botocore's signer, one keep-alive
    connection a thread), one request each, none through boto3's request
    machinery (counted by its before-send event); a kept-alive connection the
    server closed (a restart) is opened again for the next request."""
    bucket = weed.make_bucket()
    s = S3BlobStore(tmp_path / "a", f"s3://{bucket}/p")
    s.create_dirs()
    boto_sends = []
    s.client.meta.events.register("before-send.s3", lambda **kw: boto_sends.append(kw["request"].url))
    pages = varied_pages(bf16_pages, 4, salt=11)
    for p in pages:
        s._remember(digest(p), None)        # (known absent: a put is its PUT alone)
    before = s.lean.requests
    assert [s.put(p).existed for p in pages] == [False] * 4
    assert s.lean.requests - before == 4
    assert s.put_object("small/x", b"abc", {"who": "me"}, if_absent=True)
    assert not s.put_object("small/x", b"abd", if_absent=True)
    body, meta = s.get_object("small/x")
    assert body == b"abc" and meta["who"] == "me" and meta["last_modified"] > 0
    assert s.get_object("small/none") is None
    assert s.lean.requests - before == 8
    # Another host's store: empty cache, each page one GET.
    b = S3BlobStore(tmp_path / "b", s.url)
    b.create_dirs()
    b.client.meta.events.register("before-send.s3", lambda **kw: boto_sends.append(kw["request"].url))
    assert b.get(digest(pages[0])) == pages[0] and b.lean.requests == 1
    assert b.stat(digest(pages[1]), fresh=True).raw_size == len(pages[1]) and b.lean.requests == 2
    assert boto_sends == []
    weed.restart()      # (the connection this thread kept alive is closed by the server)
    assert b.get(digest(pages[2])) == pages[2] and b.lean.requests == 3
    s.close()
    b.close()


def test_a_forked_process_opens_its_own_connection(weed, store, bf16_pages):
    """A process forked after a request (an engine forking its workers with a
    store found already) reads on a connection of its own: two processes on
    one kept-alive socket would read each other's answers."""
    store.put(varied_pages(bf16_pages, 1, salt=12)[0])
    assert store.get_object("none") is None     # (this thread's connection, kept alive)
    mine = store.lean._kept().sock.getsockname()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:        # the child: one read, its connection's local address to the parent
        code = 1
        try:
            os.close(r)
            ok = store.get_object("none") is None
            os.write(w, json.dumps([ok, list(store.lean._kept().sock.getsockname())]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        ok, theirs = json.loads(f.read() or b"[false, []]")
    _, status = os.waitpid(pid, 0)
    assert status == 0 and ok
    assert tuple(theirs) != tuple(mine)
    assert store.get_object("none") is None and store.lean._kept().sock.getsockname() == mine
