"""Blob store: content addressing, verified reads, concurrent writers."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pffs.errors import CorruptBlob, IntegrityError, MissingBlob
from pffs.store.local import LocalBlobStore
from pffs.types import digest_of


@pytest.fixture
def store(tmp_path):
    s = LocalBlobStore(tmp_path / "store")
    s.create_dirs()
    return s


def test_put_get_contains_delete_iterate(store, bf16_pages):
    digests = [store.put(p).digest for p in bf16_pages[:10]]
    assert digests == [digest_of(p) for p in bf16_pages[:10]]
    for d, p in zip(digests, bf16_pages):
        assert store.contains(d)
        assert store.get(d) == p
        h = store.path(d)
        assert h.parent.name == d[7:9] and h.name == d[7:]
    assert sorted(store) == sorted(digests)
    assert store.delete(digests[0]) and not store.contains(digests[0])
    assert not store.delete(digests[0])
    assert sorted(store) == sorted(digests[1:])


def test_put_existing_is_kept(store):
    r1 = store.put(b"hello" * 1000)
    r2 = store.put(b"hello" * 1000)
    assert not r1.existed and r2.existed
    assert r1.stored_size == r2.stored_size < 5000


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=50000), codec=st.sampled_from(["raw", "zstd-1", "zstd-19", "planes-zstd1"]))
def test_roundtrip_through_store(store, data, codec):
    from pffs.codec import parse_codec
    d = store.put(data, codec=parse_codec(codec)).digest
    assert store.get(d) == data


def test_batch_groups_fsyncs(store, bf16_pages):
    batch = store.batch()
    ds = [store.put(p, batch=batch).digest for p in bf16_pages[:5]]
    store.put(bf16_pages[0], batch=batch)  # existing blobs are synced too
    assert len(batch) == 5
    batch.sync()
    assert len(batch) == 0
    assert all(store.get(d) == p for d, p in zip(ds, bf16_pages))


def test_flipped_byte_is_integrity_error(store, bf16_pages):
    d = store.put(bf16_pages[1]).digest
    path = store.path(d)
    blob = bytearray(path.read_bytes())
    for pos in (25, len(blob) // 2, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 1
        path.write_bytes(bad)
        with pytest.raises(CorruptBlob):
            store.get(d)


def test_flip_in_raw_blob_caught_by_digest(store):
    data = os.urandom(4096)  # stored raw
    d = store.put(data).digest
    path = store.path(d)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    # Fix up the header crc as well: the sha256 check must still catch it.
    import zlib, struct
    struct.pack_into("<I", blob, 16, zlib.crc32(blob[20:]))
    path.write_bytes(blob)
    with pytest.raises(CorruptBlob, match="sha256"):
        store.get(d)


def test_truncated_blob_is_integrity_error(store, bf16_pages):
    d = store.put(bf16_pages[2]).digest
    path = store.path(d)
    blob = path.read_bytes()
    for cut in (0, 10, 20, len(blob) - 1):
        path.write_bytes(blob[:cut])
        with pytest.raises(CorruptBlob):
            store.get(d)


def test_missing_blob_is_integrity_error(store):
    d = digest_of(b"never stored")
    with pytest.raises(MissingBlob):
        store.get(d)
    with pytest.raises(IntegrityError):
        store.header(d)



def _racer(root, data, barrier, n):
    s = LocalBlobStore(root)
    barrier.wait()
    for _ in range(n):
        s.put(data)
        # Remove it again so the next round races on a fresh write.
        try:
            os.unlink(s.path(digest_of(data)))
        except FileNotFoundError:
            pass
    s.put(data)


def test_concurrent_puts_from_two_processes(store, bf16_pages):
    data = bf16_pages[5] * 20  # ~3 MiB, so writes overlap
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_racer, args=(store.root, data, barrier, 20)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    d = digest_of(data)
    assert store.get(d) == data
    assert list(store) == [d]
    assert list(store.temp_files()) == []
