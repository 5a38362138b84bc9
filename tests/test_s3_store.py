"""The S3 blob store against a real S3 server (SeaweedFS), without a mount: layout and
frames, put-if-absent, verified reads, the bounded local cache, batches, trash,
binding cache folders, and bounded failure on a dead endpoint."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from pffs import codec
from pffs.errors import CorruptBlob, MissingBlob, PffsError, StoreUnavailable
from pffs.store.s3 import S3BlobStore, parse_url, url_of
from pffs.storedir import StoreDir
from pffs.types import digest_hex
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
    assert frame == codec.encode(page, store.codec) and len(frame) == r.stored_size
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
