"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
fsync() of a file open for writing: durable at the cost of what changed (a
journal file of the staged bytes), committed at close; after kill -9, the
next mount commits what was fsynced."""

from __future__ import annotations

import hashlib
import json
import os

from mountutil import wait_for

BLOCK = 64 << 20


def stats(m) -> dict:
    return json.loads((m / ".pffs" / "stats.json").read_text())


def journals(m) -> list[str]:
    return sorted(p.name for p in (m.store / "staging").iterdir() if p.name.startswith("fsynced-"))


def kill9_and_remount(m, fd: int) -> None:
    """kill -9 of the daemon while *fd* is open (its close may then fail), and a new mount."""
    m.kill9()
    try:
        os.close(fd)
    except OSError:
        pass
    m.start()


def test_fsync_stores_nothing_until_close(mnt):
    """A database's pattern (small overwrites, each fsynced) stores no blob per
    fsync: the close commits once."""
    (mnt / "db").write_bytes(b"\0" * (1 << 20))
    before = stats(mnt)
    fd = os.open(mnt / "db", os.O_RDWR)
    try:
        for i in range(50):
            os.pwrite(fd, b"row %04d" % i, i * 4096)
            os.fsync(fd)
        mid = stats(mnt)
        assert mid["unique_blobs"] == before["unique_blobs"]
        assert mid["stored_bytes"] == before["stored_bytes"]
        assert len(journals(mnt)) == 1
        assert os.pread(fd, 8, 49 * 4096) == b"row 0049"
    finally:
        os.close(fd)
    after = stats(mnt)
    assert after["unique_blobs"] == before["unique_blobs"] + 1
    wait_for(lambda: journals(mnt) == [], what="the journal file to go (at release)")
    data = (mnt / "db").read_bytes()
    assert len(data) == 1 << 20 and data[49 * 4096:49 * 4096 + 8] == b"row 0049"


def test_kill9_after_fsync_keeps_the_fsynced_bytes(mount_factory):
    m = mount_factory()
    (m / "a").write_bytes(b"old" * 1000)
    fd = os.open(m / "a", os.O_RDWR)
    os.pwrite(fd, b"NEW", 0)
    os.truncate(m / "a", 2000)      # (by path: the size changes too)
    os.fsync(fd)
    assert journals(m)
    kill9_and_remount(m, fd)
    assert (m / "a").read_bytes() == b"NEW" + (b"old" * 1000)[3:2000]
    assert journals(m) == []
    assert "committed the fsynced bytes of /a (2000 bytes)" in m.log_text()


def test_kill9_after_fsync_of_a_sparse_file_of_several_blocks(mount_factory):
    m = mount_factory()
    fd = os.open(m / "big", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 2 * BLOCK + 10)
    os.pwrite(fd, b"first", 0)
    os.close(fd)
    fd = os.open(m / "big", os.O_RDWR)
    os.pwrite(fd, b"third", 2 * BLOCK + 5)
    os.fsync(fd)
    kill9_and_remount(m, fd)
    with open(m / "big", "rb") as f:
        assert os.fstat(f.fileno()).st_size == 2 * BLOCK + 10
        assert os.pread(f.fileno(), 5, 0) == b"first"
        assert os.pread(f.fileno(), 10, 2 * BLOCK) == b"\0" * 5 + b"third"
        assert os.pread(f.fileno(), 5, BLOCK) == b"\0" * 5
    assert journals(m) == []


def test_fsynced_file_removed_while_open_is_dropped_after_kill9(mount_factory):
    m = mount_factory()
    (m / "gone").write_bytes(b"x" * 5000)
    fd = os.open(m / "gone", os.O_RDWR)
    os.write(fd, b"y")
    os.fsync(fd)
    assert journals(m)
    os.unlink(m / "gone")
    kill9_and_remount(m, fd)
    assert not (m / "gone").exists()
    assert journals(m) == []
    wait_for(lambda: "the file is gone" in m.log_text(), what="the log line")


def test_close_after_fsync_leaves_no_journal_and_remount_replays_nothing(mount_factory):
    m = mount_factory()
    with open(m / "f", "wb") as f:
        f.write(b"abc" * 100)
        f.flush()
        os.fsync(f.fileno())
        f.write(b"def")
    wait_for(lambda: journals(m) == [], what="the journal file to go (at release)")
    m.stop()
    m.start()
    assert (m / "f").read_bytes() == b"abc" * 100 + b"def"
    assert "fsynced bytes" not in m.log_text()


def test_fsync_of_a_manifest_is_checked_as_before(mnt):
    """A manifest.json is committed (so validated) at fsync, not journaled."""
    (mnt / "s").mkdir()
    fd = os.open(mnt / "s" / "manifest.json", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"not json")
        try:
            os.fsync(fd)
            raise AssertionError("fsync of a bad manifest.json succeeded")
        except OSError as e:
            assert e.errno == 22
        assert journals(mnt) == []
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    mnt.allow("refused manifest")


def test_write_behind_stores_full_blocks_while_the_file_is_written(mnt):
    """A sequential writer's full blocks are stored before its close (so the
    close commits its last block only); the bytes read back as written."""
    chunk = bytes(range(256)) * 4096          # 1 MiB
    before = stats(mnt)
    mib = [chunk[i % 256:] + chunk[:i % 256] for i in range(3 * 64 + 1)]
    blobs = [hashlib.sha256(b"".join(mib[b * 64:(b + 1) * 64])).hexdigest() for b in range(3)]
    fd = os.open(mnt / "seq", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for b in mib:
            os.write(fd, b)
        # Blocks 0-2 are full: each is stored by write-behind while the file is open.
        wait_for(lambda: all((mnt.store / "blobs" / h[:2] / h).exists() for h in blobs),
                 what="three blocks stored before the close")
        assert stats(mnt)["unique_blobs"] == before["unique_blobs"]   # (named at the close)
    finally:
        os.close(fd)
    after = stats(mnt)
    assert after["unique_blobs"] == before["unique_blobs"] + 4
    with open(mnt / "seq", "rb") as f:
        for i in (0, 63, 64, 130, 192):
            f.seek(i << 20)
            assert f.read(1 << 20) == chunk[i % 256:] + chunk[:i % 256]


def test_write_behind_of_a_block_written_again_keeps_the_new_bytes(mnt):
    """A block changed after write-behind began storing it is stored again at the commit."""
    chunk = b"a" * (1 << 20)
    fd = os.open(mnt / "again", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for i in range(64):
            os.write(fd, chunk)
        for i in range(0, 64, 8):           # at once, while its job may still run
            os.pwrite(fd, b"B", (i << 20) + 5)
        os.write(fd, b"tail")
    finally:
        os.close(fd)
    with open(mnt / "again", "rb") as f:
        data = f.read()
    assert len(data) == (64 << 20) + 4
    for i in range(64):
        assert data[(i << 20) + 5] == (ord("B") if i % 8 == 0 else ord("a"))


def blob_files(m) -> int:
    return sum(len(files) for _, _, files in os.walk(m.store / "blobs"))


def test_write_behind_leaves_a_random_writers_blocks_to_the_commit(mnt):
    """A block whose bytes no single run of sequential writes wrote whole (a
    random writer's) is not stored before the close: it would be written again."""
    chunk = b"r" * (1 << 20)
    before = blob_files(mnt)
    fd = os.open(mnt / "random", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, chunk, 100 << 20)                 # (past the first block first)
        for i in range(63, -1, -1):                     # block 0 written backwards
            os.pwrite(fd, chunk, i << 20)
        os.pwrite(fd, chunk, 64 << 20)
        for i in range(66, 100):                        # block 1 from its middle on
            os.pwrite(fd, chunk, i << 20)
        os.pwrite(fd, chunk, 65 << 20)
        os.fsync(fd)                                    # (a write-behind job would have begun by now)
        staged = blob_files(mnt)
    finally:
        os.close(fd)
    assert staged == before + 2         # the commit at fsync: blocks 0 and 1, never a partial one
    assert blob_files(mnt) == staged


def test_an_edit_of_a_large_file_reads_in_only_the_blocks_it_changes(mount_factory):
    """A 1-byte write into a file of three blocks (each holding data) decodes one
    block, not three; reads of the others come from their blobs, as committed."""
    m = mount_factory()
    fd = os.open(m / "large", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 3 * BLOCK)
    for b in range(3):
        os.pwrite(fd, b"block %d" % b, b * BLOCK + 100)
    os.close(fd)
    m.stop()
    m.start()                                   # (an empty blob cache)
    fd = os.open(m / "large", os.O_RDWR)
    try:
        os.pwrite(fd, b"X", 2 * BLOCK + 100)
        assert stats(m)["cache"]["fetched_by_reads"] == 1
        assert os.pread(fd, 7, BLOCK + 100) == b"block 1"     # (from its blob)
        assert os.pread(fd, 7, 2 * BLOCK + 100) == b"Xlock 2"
    finally:
        os.close(fd)
    with open(m / "large", "rb") as f:
        assert [os.pread(f.fileno(), 7, b * BLOCK + 100) for b in range(3)] == \
            [b"block 0", b"block 1", b"Xlock 2"]
        assert os.fstat(f.fileno()).st_size == 3 * BLOCK


def test_fsynced_bytes_the_store_has_no_room_for_wait_for_a_mount_that_has(mount_factory):
    """A journal the next mount cannot commit (its store limit) is kept, with one
    warning, and committed by a later mount with room; the file reads as
    committed before (no half state) meanwhile."""
    m = mount_factory()
    old = os.urandom(1 << 20)
    (m / "f").write_bytes(old)
    fd = os.open(m / "f", os.O_RDWR)
    os.pwrite(fd, old[:1], 0)
    os.fsync(fd)                                    # (journaled: then every fsync of it is)
    os.pwrite(fd, os.urandom(3 << 20), 1 << 20)     # (incompressible: 3 MiB more to store)
    os.pwrite(fd, b"end", 4 << 20)
    os.fsync(fd)
    assert journals(m)
    m.kill9()
    try:
        os.close(fd)
    except OSError:
        pass
    m.opts = ["max_size=2M"]
    m.allow("not committed")
    m.start()
    wait_for(lambda: "kept for the next mount" in m.log_text(), what="the warning")
    assert journals(m)
    assert (m / "f").read_bytes() == old
    m.stop()
    m.opts = []
    m.start()
    data = (m / "f").read_bytes()
    assert len(data) == (4 << 20) + 3 and data[:1 << 20] == old and data.endswith(b"end")
    assert journals(m) == []
