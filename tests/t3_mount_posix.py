"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
A real mount behaves as a POSIX filesystem (contract §3.1)."""

from __future__ import annotations

import errno
import os
import random
import stat
import subprocess

import pytest

SIZES = [0, 1, 4095, 4096, 147_456, (1 << 20) + 1, 64 << 20]


@pytest.mark.parametrize("size", SIZES)
def test_roundtrip_sizes(mnt, size):
    data = random.Random(size).randbytes(size)
    p = mnt / f"f{size}"
    p.write_bytes(data)
    assert p.stat().st_size == size
    assert p.read_bytes() == data
    st = p.stat()
    assert st.st_blocks == (size + 511) // 512
    assert st.st_blksize == 1 << 20


def test_big_file_crosses_blocks(mnt):
    # Larger than one 64 MiB block: stored as several blobs, read across the edge.
    size = (64 << 20) + 300_000
    rnd = random.Random(7)
    chunk = rnd.randbytes(1 << 20)
    with open(mnt / "big", "wb") as f:
        for i in range(size // len(chunk) + 1):
            f.write(chunk[: min(len(chunk), size - i * len(chunk))])
    with open(mnt / "big", "rb") as f:
        f.seek((64 << 20) - 10)
        got = f.read(20)
    off = (64 << 20) - 10
    expect = bytes(chunk[(off + k) % len(chunk)] for k in range(20))
    assert got == expect
    assert os.path.getsize(mnt / "big") == size


def test_random_offset_writes_and_holes(mnt):
    p = mnt / "sparse"
    ref = bytearray()
    rnd = random.Random(1)
    with open(p, "wb+") as f:
        for _ in range(200):
            off = rnd.randrange(0, 3 << 20)
            data = rnd.randbytes(rnd.randrange(1, 70_000))
            f.seek(off)
            f.write(data)
            if off > len(ref):
                ref.extend(bytes(off - len(ref)))
            ref[off:off + len(data)] = data
    assert p.read_bytes() == bytes(ref)
    # Past the end: a hole reads as zeros.
    with open(p, "r+b") as f:
        f.seek(len(ref) + 100_000)
        f.write(b"tail")
    got = p.read_bytes()
    assert got[len(ref):len(ref) + 100_000] == bytes(100_000)
    assert got.endswith(b"tail")


def test_truncate_up_and_down(mnt):
    p = mnt / "t"
    p.write_bytes(b"x" * 10_000)
    os.truncate(p, 100)
    assert p.read_bytes() == b"x" * 100
    os.truncate(p, 5000)
    assert p.read_bytes() == b"x" * 100 + bytes(4900)
    with open(p, "r+b") as f:
        f.truncate(3)
        f.write(b"abc")  # at offset 0
    assert p.read_bytes() == b"abc"
    os.truncate(p, 0)
    assert p.read_bytes() == b""


def test_overwrite_in_middle_keeps_rest(mnt):
    p = mnt / "m"
    p.write_bytes(bytes(range(256)) * 1000)
    with open(p, "r+b") as f:
        f.seek(1000)
        f.write(b"HELLO")
    data = p.read_bytes()
    assert data[1000:1005] == b"HELLO"
    assert data[:1000] == (bytes(range(256)) * 4)[:1000]
    assert len(data) == 256_000


def test_errnos(mnt):
    (mnt / "d").mkdir()
    (mnt / "d" / "f").write_bytes(b"1")
    cases = [
        (lambda: os.mkdir(mnt / "d"), errno.EEXIST),
        (lambda: os.rmdir(mnt / "d"), errno.ENOTEMPTY),
        (lambda: os.open(mnt / "nope", os.O_RDONLY), errno.ENOENT),
        (lambda: os.mkdir(mnt / "d" / "f" / "x"), errno.ENOTDIR),
        (lambda: os.unlink(mnt / "d"), errno.EISDIR),
        (lambda: os.rmdir(mnt / "d" / "f"), errno.ENOTDIR),
        (lambda: os.open(mnt / ("n" * 256), os.O_CREAT | os.O_WRONLY), errno.ENAMETOOLONG),
        (lambda: os.mkdir(mnt / ("n" * 256)), errno.ENAMETOOLONG),
        (lambda: os.open(mnt / "d" / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY), errno.EEXIST),
        (lambda: os.rename(mnt / "d", mnt / "d" / "sub"), errno.EINVAL),
        (lambda: os.link(mnt / "d", mnt / "dl"), errno.EPERM),
    ]
    for fn, want in cases:
        with pytest.raises(OSError) as ei:
            fn()
        assert ei.value.errno == want, (fn, ei.value)
    os.symlink("loop2", mnt / "loop1")
    os.symlink("loop1", mnt / "loop2")
    with pytest.raises(OSError) as ei:
        open(mnt / "loop1")
    assert ei.value.errno == errno.ELOOP
    name = "n" * 255
    (mnt / name).write_bytes(b"ok")
    assert (mnt / name).read_bytes() == b"ok"
    assert os.statvfs(mnt.path).f_namemax == 255


def test_rename_variants(mnt):
    (mnt / "a").write_bytes(b"A")
    (mnt / "b").write_bytes(b"B")
    os.rename(mnt / "a", mnt / "b")  # over an existing file
    assert (mnt / "b").read_bytes() == b"A" and not (mnt / "a").exists()
    (mnt / "d1").mkdir()
    (mnt / "d2").mkdir()
    os.rename(mnt / "d1", mnt / "d2")  # over an empty directory
    assert not (mnt / "d1").exists() and (mnt / "d2").is_dir()
    (mnt / "d3").mkdir()
    (mnt / "d3" / "x").write_bytes(b"x")
    with pytest.raises(OSError) as ei:
        os.rename(mnt / "d2", mnt / "d3")
    assert ei.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as ei:
        os.rename(mnt / "b", mnt / "d2")
    assert ei.value.errno == errno.EISDIR
    with pytest.raises(OSError) as ei:
        os.rename(mnt / "d2", mnt / "b")
    assert ei.value.errno == errno.ENOTDIR
    os.rename(mnt / "b", mnt / "d3" / "moved")
    assert (mnt / "d3" / "moved").read_bytes() == b"A"
    assert os.stat(mnt / "d3").st_nlink == 2
    os.rename(mnt / "d2", mnt / "d3" / "sub")
    assert os.stat(mnt / "d3").st_nlink == 3
    assert os.stat(mnt.path).st_nlink == 3  # root: . .. and d3


def test_unlink_open_handle_keeps_working(mnt):
    p = mnt / "u"
    p.write_bytes(b"before")
    with open(p, "r+b") as f:
        os.unlink(p)
        assert not p.exists()
        assert f.read() == b"before"
        f.write(b"-after")
        f.flush()
        f.seek(0)
        assert f.read() == b"before-after"
    assert not p.exists()


def test_hard_links_share_one_file(mnt):
    p = mnt / "orig"
    p.write_bytes(b"one")
    os.link(p, mnt / "alias")
    assert os.stat(p).st_nlink == 2
    assert os.stat(p).st_ino == os.stat(mnt / "alias").st_ino
    with open(mnt / "alias", "r+b") as f:
        f.write(b"TWO")
    assert p.read_bytes() == b"TWO"
    os.unlink(p)
    assert (mnt / "alias").read_bytes() == b"TWO"
    assert os.stat(mnt / "alias").st_nlink == 1


def test_symlinks_and_special_files(mnt):
    os.symlink("target/x", mnt / "sl")
    assert os.readlink(mnt / "sl") == "target/x"
    assert stat.S_ISLNK(os.lstat(mnt / "sl").st_mode)
    os.mkfifo(mnt / "fifo")
    assert stat.S_ISFIFO(os.stat(mnt / "fifo").st_mode)
    os.mknod(mnt / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    st = os.stat(mnt / "chr")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    import socket
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(mnt / "sock"))
    finally:
        s.close()
    assert stat.S_ISSOCK(os.stat(mnt / "sock").st_mode)


def test_chmod_chown_utimes_ns(mnt):
    p = mnt / "attrs"
    p.write_bytes(b"x")
    os.chmod(p, 0o640)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(p, ns=(1_000_000_123_456_789, 1_500_000_987_654_321))
    st = os.stat(p)
    assert st.st_atime_ns == 1_000_000_123_456_789
    assert st.st_mtime_ns == 1_500_000_987_654_321


def test_mtime_set_while_open_survives_close(mnt):
    p = mnt / "cpa"
    with open(p, "wb") as f:
        f.write(b"data")
        f.flush()
        os.utime(f.fileno(), ns=(10**18, 10**18))
    assert os.stat(p).st_mtime_ns == 10**18


def test_xattrs(mnt):
    p = mnt / "x"
    p.write_bytes(b"hello")
    os.setxattr(p, "user.note", b"v1")
    assert os.getxattr(p, "user.note") == b"v1"
    assert os.listxattr(p) == ["user.note"]
    digest = os.getxattr(p, "user.pffs.digest").decode()
    import hashlib
    assert digest == "sha256:" + hashlib.sha256(b"hello").hexdigest()
    with pytest.raises(OSError) as ei:
        os.setxattr(p, "user.pffs.digest", b"x")
    assert ei.value.errno == errno.EPERM
    os.removexattr(p, "user.note")
    with pytest.raises(OSError) as ei:
        os.getxattr(p, "user.note")
    assert ei.value.errno == errno.ENODATA
    with pytest.raises(OSError) as ei:
        os.setxattr(p, "security.foo", b"x")
    assert ei.value.errno == errno.EOPNOTSUPP
    # A directory tells how many names it holds, read-only and unlisted.
    (mnt / "d" / "sub").mkdir(parents=True)
    (mnt / "d" / "f").write_bytes(b"")
    os.symlink("f", mnt / "d" / "l")
    assert os.getxattr(mnt / "d", "user.pffs.entries") == b"3"
    os.unlink(mnt / "d" / "l")
    assert os.getxattr(mnt / "d", "user.pffs.entries") == b"2"
    assert os.getxattr(mnt / "d" / "sub", "user.pffs.entries") == b"0"
    assert os.listxattr(mnt / "d") == []
    for call in (lambda: os.setxattr(mnt / "d", "user.pffs.entries", b"9"),
                 lambda: os.removexattr(mnt / "d", "user.pffs.entries")):
        with pytest.raises(OSError) as ei:
            call()
        assert ei.value.errno == errno.EPERM
    with pytest.raises(OSError) as ei:
        os.getxattr(p, "user.pffs.entries")
    assert ei.value.errno == errno.ENODATA
    # Namespaces pffs does not keep say so (then `ls -l` stops asking for labels
    # and ACLs), on page files and on the hidden tree alike.
    for path in (p, mnt / ".pffs" / "stats.json"):
        for name in ("security.selinux", "system.posix_acl_access", "security.capability"):
            with pytest.raises(OSError) as ei:
                os.getxattr(path, name)
            assert ei.value.errno == errno.EOPNOTSUPP, (path, name)


def test_statfs_and_fsync(mnt):
    st = os.statvfs(mnt.path)
    assert st.f_namemax == 255 and st.f_blocks > 0
    fd = os.open(mnt / "fs", os.O_CREAT | os.O_WRONLY)
    os.write(fd, b"durable")
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(mnt.path, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    assert (mnt / "fs").read_bytes() == b"durable"


def test_permissions_enforced(mount_factory, tmp_path):
    import tempfile
    from pathlib import Path
    # Other users must reach the mount point, and -o allow_other lets them in at all.
    top = Path(tempfile.mkdtemp(prefix="pffs-perm-"))
    os.chmod(top, 0o755)
    mnt = None
    try:
        mnt = mount_factory(root=top / "m", store=tmp_path / "store", opts=["allow_other"])
        os.chmod(top / "m", 0o755)
        _check_permissions(mnt)
    finally:
        if mnt is not None and mnt.proc is not None:
            assert mnt.stop() == 0
        import shutil
        shutil.rmtree(top, ignore_errors=True)


def _check_permissions(mnt):
    (mnt / "private").mkdir(mode=0o700)
    (mnt / "private" / "secret").write_bytes(b"s")
    (mnt / "public").write_bytes(b"p")
    os.chmod(mnt / "public", 0o644)
    os.chmod(mnt.path, 0o755)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    r = subprocess.run(as_nobody + ["cat", str(mnt / "private" / "secret")], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = subprocess.run(as_nobody + ["cat", str(mnt / "public")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "p"
    r = subprocess.run(as_nobody + ["sh", "-c", f"echo x > {mnt / 'public'}"], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr


def test_hidden_pffs_folder(mnt):
    import json
    assert ".pffs" not in os.listdir(mnt.path)
    assert sorted(os.listdir(mnt / ".pffs")) == ["engine.sock", "stats.json", "store.json", "version"]
    (mnt / "f").write_bytes(b"12345")
    s1 = json.loads((mnt / ".pffs" / "stats.json").read_text())
    for key in ("sessions", "files", "logical_bytes", "unique_blobs", "unique_bytes",
                "stored_bytes", "dedup_ratio", "compression_ratio"):
        assert key in s1
    assert s1["files"] == 1 and s1["logical_bytes"] == 5
    (mnt / "g").write_bytes(b"123456")
    s2 = json.loads((mnt / ".pffs" / "stats.json").read_text())
    assert s2["files"] == 2 and s2["logical_bytes"] == 11  # never a stale cached copy
    assert os.readlink(mnt / ".pffs" / "engine.sock") == str(mnt.store / "engine.sock")
    with pytest.raises(OSError):
        (mnt / ".pffs" / "stats.json").write_text("x")
    with pytest.raises(OSError):
        os.mkdir(mnt / ".pffs")


def test_readdir_large_and_stable(mnt):
    d = mnt / "many"
    d.mkdir()
    names = {f"{i:06d}" for i in range(3000)}
    for n in names:
        (d / n).write_bytes(b"")
    assert set(os.listdir(d)) == names
    # Removing entries while listing never repeats or skips survivors.
    it = os.scandir(d)
    seen = set()
    for k, e in enumerate(it):
        seen.add(e.name)
        if k == 100:
            for n in sorted(names)[-500:]:
                os.unlink(d / n)
    it.close()
    survivors = set(os.listdir(d))
    assert survivors <= seen | survivors and len(survivors) == 2500


def _renameat2(src, dst, flags: int) -> int:
    """renameat2(2) with *flags*; 0 or the errno."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(-100, os.fsencode(src), -100, os.fsencode(dst), flags)
    return 0 if rc == 0 else ctypes.get_errno()


def test_rename_whiteout_is_refused_not_taken_as_a_plain_rename(mnt):
    import errno
    (mnt / "a").write_bytes(b"kept")
    assert _renameat2(mnt / "a", mnt / "b", 4) == errno.EINVAL      # RENAME_WHITEOUT
    assert (mnt / "a").read_bytes() == b"kept" and not (mnt / "b").exists()
    assert _renameat2(mnt / "a", mnt / "b", 1) == 0                 # RENAME_NOREPLACE still works
    assert (mnt / "b").read_bytes() == b"kept"


def test_sizes_past_the_largest_file_get_efbig(mnt):
    """truncate(1) past the largest size pffs keeps, whatever the staging folder's
    filesystem allows: EFBIG and one log line, never EIO and a traceback."""
    import subprocess
    (mnt / "f").write_bytes(b"x")
    r = subprocess.run(["truncate", "-s", "999999999999999", str(mnt / "f")], capture_output=True, text=True)
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr
    with open(mnt / "f", "r+b") as f:
        with pytest.raises(OSError) as e:
            os.pwrite(f.fileno(), b"y", 1 << 50)
        assert e.value.errno == 27   # EFBIG
    assert (mnt / "f").read_bytes() == b"x"
    assert "refused (the largest file is" in mnt.log_text()


def test_a_4_tib_sparse_file_costs_its_written_block_only(mnt):
    """truncate -s 4T, a 1-byte write at 4 TiB - 1, rm: holes are not read, hashed,
    compressed or stored (each hole is the one zero blob), and a small write
    into the big file commits the block it touched.  Before, each of these
    steps took time in proportion to the size (4 TiB: hours)."""
    import json
    import subprocess

    def stored():
        return json.loads((mnt / ".pffs" / "stats.json").read_text())["stored_bytes"]
    s0 = stored()
    f = mnt / "sparse"
    f.touch()
    subprocess.run(["truncate", "-s", "4T", str(f)], check=True, timeout=120)
    assert os.stat(f).st_size == 4 << 40
    with open(f, "r+b") as fh:
        os.pwrite(fh.fileno(), b"!", (4 << 40) - 1)
    with open(f, "rb") as fh:
        assert os.pread(fh.fileno(), 3, (4 << 40) - 3) == b"\0\0!"
        assert os.pread(fh.fileno(), 4, 1 << 40) == b"\0\0\0\0"
    assert stored() - s0 < 1 << 20     # the zero blob and the last block, compressed
    os.unlink(f)
    assert not f.exists()
