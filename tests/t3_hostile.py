"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Hostile input through the mount: each is refused or served correctly, the daemon stays up,
nothing else is harmed (contract §3.1, §3.3, §3.8)."""

from __future__ import annotations

import errno
import json
import os
import resource
import struct
import zlib

import pytest
import zstandard

from lifecycle_helpers import run
from mountutil import pffs
from pffs import codec
from pffs import manifest as mf
from pffs.store.storedir import StoreDir
from sessions import digest, varied_pages, write_session


@pytest.fixture
def canary(mnt, bf16_pages, tmp_path):
    """A session that must read back intact after whatever the test does."""
    pages = varied_pages(bf16_pages, 3, salt=900)
    write_session(tmp_path / "canary", pages, seq_id="canary")
    run("cp", "-r", tmp_path / "canary", mnt / "canary")

    def check():
        assert mnt.proc.poll() is None, "the daemon died"
        assert [(mnt / "canary" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)] == pages
    return check


def _manifest(**over) -> dict:
    d = {"layout": "paged-batchinvariant-v1", "page_size_tokens": 16, "n_layers": 2, "n_heads": 2,
         "head_dim": 8, "dtype": "bf16", "pages": ["sha256:" + "ab" * 32],
         "logical_seqs": [{"id": "r", "page_ixs": [0], "fill_in_last_page": 0}]}
    d.update(over)
    return d


def test_hostile_manifests_are_refused(mnt, canary):
    mnt.allow("refused manifest")
    (mnt / "v").mkdir()
    good = json.dumps(_manifest()).encode()
    (mnt / "v" / "manifest.json").write_bytes(good)
    cases = [
        ("over the page cap", json.dumps(_manifest(pages=["x"] * (mf.MAX_PAGES + 1))).encode(),
         f"exceed the limit of {mf.MAX_PAGES}"),
        ("a 10^9-token sequence", json.dumps(_manifest(
            page_size_tokens=1000, n_layers=1, n_heads=1, head_dim=1,
            logical_seqs=[{"id": "r", "page_ixs": [0] * 1_000_000, "fill_in_last_page": 0}])).encode(),
         f"more than {mf.MAX_TOKENS_PER_SEQ} tokens"),
        ("page 10^9 of one", json.dumps(_manifest(
            logical_seqs=[{"id": "r", "page_ixs": [10 ** 9], "fill_in_last_page": 0}])).encode(),
         "out of range"),
        ("over the sequence cap", json.dumps(_manifest(
            logical_seqs=[{"id": f"r{i}", "page_ixs": []} for i in range(mf.MAX_SEQS + 1)])).encode(),
         "logical_seqs"),
        ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        ("over the size cap", b'{"pad": "' + b" " * mf.MAX_MANIFEST_BYTES + b'"}',
         f"{mf.MAX_MANIFEST_BYTES}-byte cap"),
    ]
    for name, data, why in cases:
        with pytest.raises(OSError) as ei:
            with open(mnt / "v" / "manifest.json", "wb") as f:
                f.write(data)
        assert ei.value.errno == errno.EINVAL, name
        assert (mnt / "v" / "manifest.json").read_bytes() == good, name
        assert why in mnt.log_text(), name
    # A seed-form manifest whose page ids reach 10^9 lists two pages: served.
    seed = _manifest(page_table={"1000000000": "sha256:" + "cd" * 32, "0": "sha256:" + "ab" * 32})
    del seed["pages"]
    seed["logical_seqs"] = [{"id": "r", "page_ixs": [0, 1], "fill_in_last_page": 3}]
    (mnt / "v" / "manifest.json").write_bytes(json.dumps(seed).encode())
    assert json.loads(pffs("stats", "--json", mnt.path).stdout)["sessions"] == 2
    canary()


def test_directories_nested_1000_deep(mnt, canary, bf16_pages, tmp_path):
    deep = mnt.path
    for _ in range(1000):
        deep = deep / "d"
        deep.mkdir()
    pages = varied_pages(bf16_pages, 2, salt=901)
    write_session(tmp_path / "s", pages)
    run("cp", "-r", tmp_path / "s", deep / "s")
    assert [(deep / "s" / "pages" / mf.page_name(i)).read_bytes() for i in range(2)] == pages
    r = pffs("prune", mnt / "d", "--keep-last", "0", "--dry-run")
    assert "1 of 1 sessions would be removed" in r.stdout
    run("rm", "-rf", mnt / "d")
    assert not (mnt / "d").exists()
    canary()


def test_name_length_limits(mnt, canary):
    ok, long = "n" * 255, "L" * 256
    (mnt / ok).write_bytes(b"x")
    (mnt / "dir").mkdir()
    assert os.listdir(mnt / "dir") == []
    assert (mnt / ok).read_bytes() == b"x"
    attempts = {
        "create": lambda: open(mnt / long, "wb"),
        "mkdir": lambda: os.mkdir(mnt / long),
        "symlink": lambda: os.symlink("target", mnt / long),
        "link": lambda: os.link(mnt / ok, mnt / long),
        "rename": lambda: os.rename(mnt / ok, mnt / "dir" / long),
        "mknod": lambda: os.mkfifo(mnt / long),
    }
    for what, attempt in attempts.items():
        with pytest.raises(OSError) as ei:
            attempt()
        assert ei.value.errno == errno.ENAMETOOLONG, what
    assert os.statvfs(mnt.path).f_namemax == 255
    assert "name of 256 bytes refused (limit 255)" in mnt.log_text()
    assert (mnt / ok).read_bytes() == b"x"
    canary()


def _frame(codec_id: int, raw_len: int, crc: int, payload: bytes) -> bytes:
    return struct.pack("<4sBbHQI", codec.MAGIC, codec_id, 1, 0, raw_len, crc) + payload


def _zstd_declaring(size: int) -> bytes:
    """A tiny valid-looking zstd frame whose header declares *size* content bytes."""
    fhd = 0xE0  # 8-byte content size, single segment, no checksum, no dictionary
    last_raw_block = (1 | (0 << 1) | (1 << 3)).to_bytes(3, "little")
    return struct.pack("<IB", 0xFD2FB528, fhd) + size.to_bytes(8, "little") + last_raw_block + b"\0"


def _zstd_bomb_without_size(gib: int = 1) -> bytes:
    """zstd of *gib* GiB of zeros, content size left out (a few dozen KiB)."""
    c = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    chunk = bytes(1 << 20)
    out = [c.compress(chunk) for _ in range(gib << 10)]
    out.append(c.flush())
    return b"".join(out)


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


#: A read or a put that finds a blob damaged says so (and sets it aside, or stores it again).
SET_ASIDE = r"WARNING pffs.store: blob sha256:[0-9a-f]+(:| is damaged)"


def _stopped_with_session(mount_factory, bf16_pages, tmp_path, n: int, salt: int, allow: str):
    """(mount, pages, blob store): a session /s of *n* pages copied into a
    fresh mount, which is then stopped so that its blobs can be tampered with."""
    m = mount_factory()
    m.allow(allow)
    m.allow(SET_ASIDE)
    pages = varied_pages(bf16_pages, n, salt=salt)
    write_session(tmp_path / "s", pages)
    run("cp", "-r", tmp_path / "s", m / "s")
    assert m.stop() == 0
    return m, pages, StoreDir(m.store).blobs


def test_planted_decompression_bombs(mount_factory, bf16_pages, tmp_path):
    m, pages, blobs = _stopped_with_session(mount_factory, bf16_pages, tmp_path, 4, 902,
                                            r"ERROR pffs.fs: read /s/pages/00000[123]: blob sha256:")
    n = len(pages[0])
    crc = zlib.crc32(pages[1])
    bombs = {
        1: _frame(codec.CODEC_ZSTD, n, crc, _zstd_declaring(1 << 40)),
        2: _frame(codec.CODEC_ZSTD, n, crc, _zstd_bomb_without_size()),
        3: _frame(codec.CODEC_ZSTD, 1 << 40, crc, _zstd_declaring(1 << 40)),
    }
    for i, frame in bombs.items():
        blobs.path(digest(pages[i])).write_bytes(frame)

    m.start()
    for i in bombs:
        with pytest.raises(OSError) as ei:
            (m / "s" / "pages" / mf.page_name(i)).read_bytes()
        assert ei.value.errno == errno.EIO
    assert (m / "s" / "pages" / "000000").read_bytes() == pages[0]
    assert m.proc.poll() is None
    assert _peak_rss(m.proc.pid) < 1 << 30
    # A dedup hit never trusts a frame whose header promises the wrong length:
    # writing bytes whose digest names a planted frame stores them afresh.
    fresh = varied_pages(bf16_pages, 1, salt=903)[0]
    blobs.path(digest(fresh)).write_bytes(bombs[3])
    (m / "fresh").write_bytes(fresh)
    assert m.stop() == 0
    m.start()
    assert (m / "fresh").read_bytes() == fresh
    assert m.stop() == 0

    r = pffs("check", "--store", m.store, "--read-data", check=False)
    assert r.returncode == 1
    for i in bombs:
        assert f"/s/pages/{mf.page_name(i)}: blob {digest(pages[i])}" in r.stdout
    r = pffs("check", "--store", m.store, "--read-data", "--repair", check=False)
    assert r.returncode == 0 and r.stdout.count("moved to /lost+found/") == 3, r.stdout


def test_a_blob_file_holding_another_blob_or_damage_made_to_fit(mount_factory, bf16_pages, tmp_path):
    """A frame in another blob's place is refused by the name it holds (EIO,
    a log line naming the blob) though its bytes and crc32 are sound; bytes
    changed with a crc32 made to match pass a read's checks, and
    `pffs check --read-data`, which hashes every blob again, finds both."""
    m, pages, blobs = _stopped_with_session(mount_factory, bf16_pages, tmp_path, 3, 904,
                                            r"ERROR pffs.fs: read /s/pages/000001: blob sha256:")
    blobs.path(digest(pages[1])).write_bytes(blobs.path(digest(pages[0])).read_bytes())
    frame = bytearray(blobs.path(digest(pages[2])).read_bytes())
    hdr = codec.read_header(frame)
    assert hdr.named and hdr.codec.id == codec.CODEC_PLANES_ZSTD
    # One byte changed, framed anew under the old name: its crc32 fits the change.
    raw = bytearray(codec.decode(bytes(frame)))
    raw[100] ^= 0x01
    forged = codec.encode(bytes(raw), hdr.codec, name=codec.frame_name(frame))
    blobs.path(digest(pages[2])).write_bytes(forged)

    m.start()
    with pytest.raises(OSError) as ei:
        (m / "s" / "pages" / "000001").read_bytes()
    assert ei.value.errno == errno.EIO
    assert f"blob {digest(pages[1])}" in m.log_text() and "names another blob" in m.log_text()
    assert (m / "s" / "pages" / "000000").read_bytes() == pages[0]
    assert (m / "s" / "pages" / "000002").read_bytes() == bytes(raw)   # (made to fit: see docs/format.md)
    assert m.stop() == 0
    r = pffs("check", "--store", m.store, "--read-data", check=False)
    assert r.returncode == 1
    for i in (1, 2):
        assert f"/s/pages/{mf.page_name(i)}: blob {digest(pages[i])}" in r.stdout, r.stdout
    m.skip_check = True   # (the damage is on purpose)


@pytest.mark.slow
def test_ten_thousand_files_open_at_once(mnt, canary):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 10_000 + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    fds = []
    try:
        (mnt / "many").mkdir()
        for i in range(10_000):
            fd = os.open(mnt / "many" / f"f{i:05d}", os.O_RDWR | os.O_CREAT, 0o644)
            fds.append(fd)
            os.write(fd, b"file %d\n" % i)
        for i, fd in enumerate(fds):
            assert os.pread(fd, 64, 0) == b"file %d\n" % i
        while fds:
            os.close(fds.pop())
        for i in range(10_000):
            fds.append(os.open(mnt / "many" / f"f{i:05d}", os.O_RDONLY))
        for i, fd in enumerate(fds):
            assert os.pread(fd, 64, 0) == b"file %d\n" % i
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(os.listdir(mnt / "many")) == 10_000
    canary()
