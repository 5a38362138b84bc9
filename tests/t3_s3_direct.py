"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
The direct data path on an S3 store (SeaweedFS): the bridge puts page frames
into the bucket and gets them back itself, in parallel, and the mount carries
names only.

Counted FUSE requests, sessions identical to the mount path's, reads from the
mount's cache folder where it holds the frames, a bucket gc between the puts
and the manifest, a damaged object, and a client without credentials that
falls back to the mount."""

from __future__ import annotations

import json
import logging
import os

import torch

from engine_bridge import DirectSink, DirectSource, DirSink, DirSource, store_access
from engine_bridge import as_sink, as_source
from mountutil import pffs
from pffs.manifest import page_name
from seaweed import s3_mounts, weed  # noqa: F401  (fixtures)
from t3_direct import (assert_few_requests, assert_refused_naming, bridge_of, counted, one_seq, page_sums,
                       pool_of)


def blob_keys(weed, bucket: str, prefix: str, area: str = "blobs/") -> set[str]:
    return {"sha256:" + k.rsplit("/", 1)[1] for k in weed.objects(bucket, f"{prefix}/{area}")}


def gathered(pool, blocks) -> list[torch.Tensor]:
    return [torch.cat([layer[:, b] for layer in pool.layers]).clone() for b in blocks]


class CountingDownloads:
    """Counts the frames a bucket store fetched from the bucket (not from the cache)."""

    def __init__(self, monkeypatch, bucket):
        self.n = 0
        real = bucket.download

        def download(d):
            self.n += 1
            return real(d)
        monkeypatch.setattr(bucket, "download", download)


def test_page_out_and_in_through_the_bucket_take_a_few_fuse_requests(weed, s3_mounts, monkeypatch):
    """A 256-page page-out and page-in on an S3 mount each cost a few FUSE
    requests (t3_direct.assert_few_requests), the session is the mount path's
    byte for byte, every page is an object in the bucket, and a page-in takes
    the frames the mount's cache folder holds from there, the rest from the
    bucket."""
    bucket = weed.make_bucket()
    m = s3_mounts("m", f"s3://{bucket}/kv")
    access = store_access(m.path)
    assert access is not None and access.kind == "s3", "the S3 mount offers the direct path"
    info = json.loads((m / ".pffs" / "store.json").read_text())
    assert info["kind"] == "s3" and info["direct"] is True and "secret_key" not in json.dumps(info)
    assert info["verify"] == "sha256" and access.blobs().verify == "sha256"    # (an S3 store's default)
    pool = pool_of(256, seed=3)
    br = bridge_of(pool)
    seq = one_seq(pool)
    assert isinstance(as_sink(m / "direct"), DirectSink)
    n_out, made_out = counted(m, lambda: br.page_out([seq], m / "direct"))
    print("S3 direct page-out:", n_out, made_out)
    assert_few_requests(made_out)
    man = json.loads((m / "direct" / "manifest.json").read_bytes())
    assert set(man["pages"]) <= blob_keys(weed, bucket, "kv")

    downloads = CountingDownloads(monkeypatch, access.bucket)
    results = []

    def page_in(src):
        res = br.page_in(src)
        results.append(gathered(pool, res.blocks))
        br.allocator.free(res.blocks)
    assert isinstance(as_source(m / "direct"), DirectSource)
    n_in, made_in = counted(m, lambda: page_in(m / "direct"))
    print("S3 direct page-in:", n_in, made_in, "downloads", downloads.n)
    assert_few_requests(made_in)
    # The bridge's puts did not fill the mount's cache: every frame came from the bucket.
    assert downloads.n == 256

    # The mount path gives the same session, byte for byte, at several requests a page.
    n_mount, _ = counted(m, lambda: br.page_out([seq], DirSink(m / "mount")))
    assert n_mount > 256 * 3
    assert (m / "direct" / "manifest.json").read_bytes() == (m / "mount" / "manifest.json").read_bytes()
    assert page_sums(m / "direct") == page_sums(m / "mount") == man["pages"]
    assert sorted(os.listdir(m / "direct" / "pages")) == [page_name(i) for i in range(256)]
    page_in(DirSource(m / "mount"))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    # The mount path's puts left the frames in the mount's cache: now none is downloaded.
    downloads.n = 0
    page_in(m / "direct")
    assert downloads.n == 0
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]))
    assert "pages go through the mount" not in m.log_text()


def test_a_bucket_gc_between_the_puts_and_the_manifest_loses_nothing(weed, s3_mounts):
    """The bucket has no gc lock: its gc keeps blobs younger than its grace period,
    and one run with no grace at all sets the just-put pages aside; the
    manifest's adoption puts them back, and the session is whole."""
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/g"
    m = s3_mounts("m", url)
    pool = pool_of(12, seed=5)
    br = bridge_of(pool)
    gc_out = []

    class GcFirst(DirectSink):
        def commit(self):
            self.batch.sync()
            gc_out.append(pffs("gc", "--store", url, "--grace", "0").stdout)
            assert set(self.digests.values()) <= blob_keys(weed, bucket, "g", "trash/")
            super().commit()
    access = store_access(m.path)
    man = br.page_out([one_seq(pool)], GcFirst(m / "a", access))
    assert "set aside" in gc_out[0]
    assert page_sums(m / "a") == man.pages
    assert set(man.pages) <= blob_keys(weed, bucket, "g")
    res = bridge_of(pool_of(12, seed=6)).page_in(m / "a")
    assert len(res.blocks) == 12


def test_a_damaged_object_gives_an_integrity_error_naming_the_page(weed, s3_mounts):
    bucket = weed.make_bucket()
    m = s3_mounts("m", f"s3://{bucket}/d")
    pool = pool_of(8, seed=11)
    man = bridge_of(pool).page_out([one_seq(pool)], m / "a")
    key = f"d/blobs/{man.pages[3][7:9]}/{man.pages[3][7:]}"
    frame = bytearray(weed.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    frame[len(frame) // 2] ^= 0x40
    weed.client.put_object(Bucket=bucket, Key=key, Body=bytes(frame))
    assert_refused_naming(m / "a", 3, man.pages[3])
    m.skip_check = True  # the damage is on purpose


def test_a_client_the_bucket_refuses_goes_through_the_mount(weed, s3_mounts, monkeypatch, caplog):
    """Credentials the bucket refuses (the daemon has its own): one log line says
    why, and the page-out and page-in work through the mount."""
    bucket = weed.make_bucket()
    m = s3_mounts("m", f"s3://{bucket}/c")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    with caplog.at_level(logging.INFO, logger="engine_bridge.transport.mountinfo"):
        assert store_access(m.path) is None
        pool = pool_of(6, seed=2)
        br = bridge_of(pool)
        man = br.page_out([one_seq(pool)], m / "a")
        assert isinstance(as_source(m / "a"), DirSource)
        res = br.page_in(m / "a")
    said = [r.getMessage() for r in caplog.records if "pages go through the mount" in r.getMessage()]
    assert len(said) == 1 and "cannot reach the bucket" in said[0] and "access denied" in said[0], said
    assert len(res.blocks) == 6 and page_sums(m / "a") == man.pages
