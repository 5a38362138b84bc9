"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Full disks and store limits (contract §3.9): ENOSPC to the writer, nothing lost, rm and gc work."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from lifecycle_helpers import gc, run, stats
from mountutil import pffs, wait_for
from pffs import manifest as mf
from sessions import make_manifest, varied_pages

FULL_LOG = (r"disk full|disk of .* is full|no space left|store limit|staged changes dropped"
            r"|namespace commit|store is full|namespace snapshot failed|periodic checkpoint")


def write_session_into(dst: Path, pages: list[bytes], seq_id: str) -> None:
    """Write a session through the mount, file by file; raises at the first failing close."""
    (dst / "pages").mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(pages):
        fd = os.open(dst / "pages" / mf.page_name(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, p)
        finally:
            os.close(fd)
    (dst / "manifest.json").write_bytes(make_manifest(pages, seq_id=seq_id).to_json())


def read_session(src: Path, n: int) -> list[bytes]:
    return [(src / "pages" / mf.page_name(i)).read_bytes() for i in range(n)]


def fill_until_enospc(m, bf16_pages, per_session: int, limit: int = 400) -> dict[str, list[bytes]]:
    """Write sessions until a close fails with ENOSPC; returns the complete ones."""
    done: dict[str, list[bytes]] = {}
    for k in range(limit):
        pages = varied_pages(bf16_pages, per_session, salt=1000 + k)
        try:
            write_session_into(m / f"s{k:03d}", pages, f"s{k}")
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            # The release after the failed close retries the commit, which
            # fails too; let it answer before the test goes on (an unmount
            # racing an unanswered release makes libfuse log an error).
            wait_for(lambda: "staged changes dropped" in m.log_text(), what="the release")
            (m / ".pffs" / "version").read_bytes()
            return done
        done[f"s{k:03d}"] = pages
    raise AssertionError(f"no ENOSPC after {limit} sessions")


def after_full(m, done: dict[str, list[bytes]], bf16_pages, per_session: int) -> None:
    """The daemon is up, stored sessions intact, rm and gc work, then writes succeed again."""
    assert m.proc.poll() is None
    assert (m / ".pffs" / "version").exists()
    assert len(done) >= 3
    for name, pages in done.items():
        assert read_session(m / name, per_session) == pages, name
    names = sorted(done)
    doomed = names[: len(names) // 2 + 1]
    run("rm", "-r", *[m / n for n in doomed])
    out = gc(m.store)
    assert "removed 0 blobs" not in out, out
    for n in doomed:
        del done[n]
    for k in range(3):
        pages = varied_pages(bf16_pages, per_session, salt=5000 + k)
        write_session_into(m / f"again{k}", pages, f"again{k}")
        done[f"again{k}"] = pages
    for name, pages in done.items():
        assert read_session(m / name, per_session) == pages, name


def test_max_size_gives_enospc_and_gc_makes_room(mount_factory, bf16_pages):
    m = mount_factory(opts=["max_size=4M"])
    m.allow(FULL_LOG)
    done = fill_until_enospc(m, bf16_pages, per_session=4)
    st = os.statvfs(m.path)
    assert st.f_blocks * st.f_frsize <= 4 << 20
    assert stats(m.path)["stored_bytes"] <= 4 << 20
    after_full(m, done, bf16_pages, per_session=4)
    assert "store limit of 4194304 bytes reached" in m.log_text()


@pytest.fixture
def small_tmpfs(tmp_path):
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (root needed): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_full_disk_gives_enospc_and_deletes_still_work(mount_factory, bf16_pages, small_tmpfs):
    m = mount_factory(store=small_tmpfs / "store")
    m.allow(FULL_LOG)
    assert (m.store / "reserve").stat().st_size == 16 << 20
    done = fill_until_enospc(m, bf16_pages, per_session=8)
    s = os.statvfs(small_tmpfs)
    # Full: what is left is the room kept in reserve for deletions (or less).
    assert s.f_bavail * s.f_frsize < (16 << 20) + (1 << 20)
    log = m.log_text()
    assert "no space left for blob" in log or "disk full" in log
    # Unmounted and mounted again while full: the daemon gives its reserve up
    # to open the namespace, and deletions still work.
    assert m.stop() == 0
    assert not m.log_problems(), m.log_problems()
    m.start()
    after_full(m, done, bf16_pages, per_session=8)
    assert m.stop() == 0
    assert not m.log_problems(), m.log_problems()
    r = m.check_store("--read-data")
    assert r.returncode == 0, r.stdout
    m.skip_check = True  # the store goes with the tmpfs


def test_a_write_that_ends_in_enospc_leaks_no_staging_file(mount_factory, small_tmpfs):
    """A file larger than the disk: its write fails with ENOSPC while its staging
    spills; rm and gc then free the room, and the next write succeeds (the spill
    file of the failed write is closed, not kept open, deleted, by the daemon)."""
    m = mount_factory(store=small_tmpfs / "store")
    m.allow(FULL_LOG)
    m.allow(r"staged changes dropped")
    big = os.urandom(100 << 20)
    with pytest.raises(OSError) as e:
        with open(m / "big", "wb") as f:
            f.write(big)
    assert e.value.errno == errno.ENOSPC
    if (m / "big").exists():
        os.unlink(m / "big")

    def staging_held():
        held = []
        for fd in os.listdir(f"/proc/{m.proc.pid}/fd"):
            try:
                held.append(os.readlink(f"/proc/{m.proc.pid}/fd/{fd}"))
            except FileNotFoundError:
                pass
        return [p for p in held if "/staging/" in p]
    # The daemon keeps nothing open in its staging folder once the file's
    # release (which the kernel sends after the close returns) is answered.
    wait_for(lambda: not staging_held(), what="the staging file to be closed")
    assert not list((m.store / "staging").iterdir())
    pffs("gc", "--store", m.store, "--grace", "0")
    small = os.urandom(10 << 20)
    (m / "small").write_bytes(small)
    assert (m / "small").read_bytes() == small
    m.skip_check = True  # the store goes with the tmpfs
