"""Level t3, real mounts: damage to a blob heals, and reads can be made to check every
byte's sha256.

A save of content whose blob is damaged stores it again (the put checks the frame
it would reuse); a read that finds a blob damaged sets it aside, so the next write of
its bytes heals it; a truncated frame is found by ``pffs check`` without
``--read-data``.  ``-o verify=sha256`` refuses a frame made to fit (other bytes,
their crc32 recomputed, the name kept) with EIO through the mount and on the
direct path (docs/format.md, "What a read checks").
"""

from __future__ import annotations

import errno
import hashlib
import json

import pytest
import torch
from sessions import write_session
from t3_direct import assert_refused_naming, bridge_of, one_seq, pool_of

from engine_bridge import DamagedPage
from pffs import codec
from pffs.manifest import page_name
from pffs.store.storedir import StoreDir
from pffs.types import Digest, digest_bytes, digest_hex


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def flip(path, at: int | None = None) -> None:
    frame = bytearray(path.read_bytes())
    frame[len(frame) // 2 if at is None else at] ^= 0x40
    path.write_bytes(bytes(frame))


def forge(blobs, d: str, good: bytes) -> bytes:
    """Blob *d*'s file (of bytes *good*) rewritten as a frame of other bytes: their crc32, *d*'s name."""
    other = bytearray(good)
    other[100] ^= 0x01
    blobs.path(Digest(d)).write_bytes(codec.encode(bytes(other), blobs.codec, name=digest_bytes(Digest(d))))
    return bytes(other)


def test_a_save_of_damaged_content_stores_it_again(mount_factory, bf16_pages):
    pages = bf16_pages[:4]
    first = mount_factory("m1")
    m = write_session(first / "a", pages)
    assert first.stop() == 0
    blobs = StoreDir(first.store).blobs
    flip(blobs.path(m.pages[1]))
    p2 = blobs.path(m.pages[2])
    p2.write_bytes(p2.read_bytes()[:-100])
    # A truncated frame is found without --read-data; a flipped byte only with it.
    r = first.check_store()
    assert r.returncode != 0 and m.pages[2] in r.stdout and "truncated" in r.stdout, r.stdout
    r = first.check_store("--read-data")
    assert r.returncode != 0 and m.pages[1] in r.stdout and m.pages[2] in r.stdout, r.stdout

    mnt = mount_factory("m2", store=first.store)
    for m_ in (first, mnt):     # (both read the store's log from where they began)
        m_.allow(r"blob sha256:[0-9a-f]{64}: the stored frame is damaged .*: storing it again")
    m2 = write_session(mnt / "b", pages)
    assert m2.pages == m.pages
    for s in ("a", "b"):
        assert [sha((mnt / s / "pages" / page_name(i)).read_bytes()) for i in range(4)] == m.pages
    for d in m.pages:
        blobs.get(Digest(d), rehash=True)     # (healed on disk, not only served)


def test_a_read_that_finds_a_blob_damaged_sets_it_aside_and_the_next_write_heals_it(mnt, bf16_pages):
    pages = bf16_pages[:3]
    m = write_session(mnt / "a", pages)
    blobs = StoreDir(mnt.store).blobs
    flip(blobs.path(m.pages[1]))
    # (The kernel asks again after an EIO: the blob is set aside by then.)
    mnt.allow(r"read /a/pages/000001: blob sha256:[0-9a-f]{64}: (crc32|not in the store)")
    mnt.allow(r"blob sha256:[0-9a-f]{64} is damaged .*: set aside in damaged/")
    with pytest.raises(OSError) as e:
        (mnt / "a" / "pages" / "000001").read_bytes()
    assert e.value.errno == errno.EIO
    assert (mnt.store / "damaged" / digest_hex(Digest(m.pages[1]))).exists()
    assert not blobs.path(m.pages[1]).exists()
    (mnt / "c").write_bytes(pages[1])           # the same bytes, under any name
    assert (mnt / "a" / "pages" / "000001").read_bytes() == pages[1]


def test_a_direct_page_out_of_damaged_content_stores_it_again(mnt):
    pool = pool_of(8, seed=21)
    br = bridge_of(pool)
    seq = one_seq(pool)
    m = br.page_out([seq], mnt / "a")
    want = [torch.cat([layer[:, b] for layer in pool.layers]).clone() for b in seq.block_ids]
    blobs = StoreDir(mnt.store).blobs
    p3 = blobs.path(m.pages[3])
    p3.write_bytes(p3.read_bytes()[:-7])
    flip(blobs.path(m.pages[5]))
    assert br.page_out([seq], mnt / "b").pages == m.pages
    for s in ("a", "b"):
        res = br.page_in(mnt / s)
        got = [torch.cat([layer[:, b] for layer in pool.layers]) for b in res.blocks]
        # (the last block's slots past the sequence's end read back as zeros)
        assert all(torch.equal(x, y) for x, y in zip(got[:7], want[:7])) and len(got) == 8
        br.allocator.free(res.blocks)


def test_verify_sha256_refuses_a_frame_made_to_fit_through_the_mount_and_the_direct_path(mount_factory):
    first = mount_factory("m1")
    pool = pool_of(8, seed=23)
    m = bridge_of(pool).page_out([one_seq(pool)], first / "a")
    blobs = StoreDir(first.store).blobs
    d = m.pages[3]
    good = blobs.get(Digest(d))
    forged = forge(blobs, d, good)
    # What crc32 checking leaves open: the forged bytes are served.
    assert (first / "a" / "pages" / page_name(3)).read_bytes() == forged
    assert json.loads((first / ".pffs" / "store.json").read_text())["verify"] == "crc32"
    assert first.stop() == 0

    mnt = mount_factory("m2", store=first.store, opts=["verify=sha256"])
    assert json.loads((mnt / ".pffs" / "store.json").read_text())["verify"] == "sha256"
    for m_ in (first, mnt):
        m_.allow(r"read /a/pages/000003: blob sha256:[0-9a-f]{64}: (sha256 of the stored bytes does not"
                 r" match|not in the store)")
        m_.allow(r"blob sha256:[0-9a-f]{64} is damaged .*: set aside in damaged/")
    assert_refused_naming(mnt / "a", 3, d, "sha256 of the stored bytes does not match")
    assert DamagedPage.errno == errno.EIO
    forge(blobs, d, good)                       # (the refusal set the forged file aside)
    with pytest.raises(OSError) as e:
        (mnt / "a" / "pages" / page_name(3)).read_bytes()
    assert e.value.errno == errno.EIO
    (mnt / "x").write_bytes(good)              # the page's own bytes heal it
    assert sha((mnt / "a" / "pages" / page_name(3)).read_bytes()) == d
