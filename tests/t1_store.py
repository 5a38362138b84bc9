"""Level t1, units: no mount and no engine.
Blob store: content addressing, verified reads, concurrent writers."""

from __future__ import annotations

import multiprocessing
import os
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pffs import codec
from pffs.errors import CorruptBlob, IntegrityError, MissingBlob
from pffs.store.local import LocalBlobStore
from pffs.types import digest_bytes, digest_of


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


def _fix_crc(blob: bytearray) -> None:
    # Make a damaged frame's crc32 match its (raw) payload again.
    hdr = codec.read_header(blob)
    struct.pack_into("<I", blob, 16, zlib.crc32(blob[hdr.payload_at:]))


def test_flip_in_raw_blob_caught_by_digest(store):
    """A raw frame flipped and given a matching crc32: an unnamed frame (as
    written before frames held their name) is refused by every read; a named
    one by a read that hashes again (pffs check --read-data)."""
    for named in (False, True):
        data = os.urandom(4096)  # stored raw
        d = digest_of(data)
        frame = codec.encode(data, "raw", name=digest_bytes(d) if named else None)
        store.put(data, d, frame=frame)
        path = store.path(d)
        blob = bytearray(path.read_bytes())
        assert codec.read_header(blob).named == named
        blob[-1] ^= 0xFF
        _fix_crc(blob)
        path.write_bytes(blob)
        with pytest.raises(CorruptBlob, match="sha256"):
            store.get(d, rehash=True)
        if not named:
            with pytest.raises(CorruptBlob, match="sha256"):
                store.get(d)


def test_a_named_frame_is_read_without_hashing_it_again(store, bf16_pages, monkeypatch):
    """Puts name their frames; a read checks the name and the crc32 instead of
    the sha256 (which a rehash and an unnamed frame still get)."""
    import pffs.store.local as local
    hashed = []

    def counted(data):
        hashed.append(len(data))
        return digest_of(data)
    page, old = bf16_pages[4], bf16_pages[5]
    d = store.put(page).digest
    assert codec.frame_name(store.path(d).read_bytes()) == digest_bytes(d)
    od = store.put(old, frame=codec.encode(old)).digest     # (an unnamed frame, as before)
    monkeypatch.setattr(local, "digest_of", counted)
    assert store.get(d) == page and hashed == []
    assert store.get(d, rehash=True) == page and hashed == [len(page)]
    assert store.get(od) == old and hashed == [len(page), len(old)]


def test_a_frame_under_another_blobs_name_is_refused_and_replaced(store, bf16_pages):
    a, b = bf16_pages[6], bf16_pages[7]
    da, db = store.put(a).digest, store.put(b).digest
    store.path(db).write_bytes(store.path(da).read_bytes())   # (a's frame at b's name)
    for rehash in (False, True):
        with pytest.raises(CorruptBlob, match="names another blob"):
            store.get(db, rehash=rehash)
    # A put of b does not take that frame for b's: it writes b's again.
    assert not store.put(b).existed
    assert store.get(db) == b


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
