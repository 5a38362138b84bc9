"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
The daemon's malloc settings (pffs.daemon.heap): glibc's huge-page tunable reaches
the daemon's process however it is started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mountutil import is_mounted, lazy_unmount, pffs, wait_for

from pffs.daemon import heap

pytestmark = pytest.mark.timeout(120)


def _environ(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")


def test_the_supported_systems_glibc_takes_the_tunable():
    # Debian 12 has glibc 2.36 and Ubuntu 22.04 2.35; the tunable came in 2.35.
    assert heap._glibc_has_hugetlb(), os.confstr("CS_GNU_LIBC_VERSION")


def test_thp_environ_adds_the_tunable_and_keeps_a_users_choice(monkeypatch):
    monkeypatch.setattr(heap, "_glibc_has_hugetlb", lambda: True)
    assert heap.thp_environ({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = heap.thp_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
    assert env is not None
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
    # Set already, either way: nothing to add, so no re-exec (and no loop of them).
    assert heap.thp_environ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert heap.thp_environ({"GLIBC_TUNABLES": "x.y=1:glibc.malloc.hugetlb=1"}) is None
    # A libc without it (older glibc, musl): nothing to add, the daemon runs as before.
    monkeypatch.setattr(heap, "_glibc_has_hugetlb", lambda: False)
    assert heap.thp_environ({"A": "1"}) is None


def test_a_foreground_daemon_runs_with_the_tunable_same_pid(mnt):
    # `pffs mount -f` ran itself again with the tunable (glibc reads it at
    # exec only), in the process the mount's caller started.
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in _environ(mnt.proc.pid)
    (mnt.path / "f").write_bytes(b"x" * 100)
    assert (mnt.path / "f").read_bytes() == b"x" * 100


def test_a_detached_daemon_runs_with_the_tunable(tmp_path):
    store, mp = tmp_path / "store", tmp_path / "mp"
    mp.mkdir()
    try:
        pffs("mount", "--store", store, mp, timeout=60)
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and _cmdline(p).count(str(mp)) and "pffs.daemon.mount" in _cmdline(p)]
        assert len(pids) == 1
        assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in _environ(pids[0])
        pffs("umount", mp, timeout=60)
        wait_for(lambda: not is_mounted(mp), what="the unmount")
    finally:
        if is_mounted(mp):
            lazy_unmount(mp)


def _cmdline(p: Path) -> str:
    try:
        return p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_failed_re_exec_mounts_without_the_tunable(monkeypatch, capsys):
    # An optimisation only: if the exec fails, the daemon goes on in this process.
    monkeypatch.setattr(heap, "_glibc_has_hugetlb", lambda: True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def fail(*a):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(heap.os, "execve", fail)
    heap.reexec_with_thp()      # returns
    assert "could not run again with glibc.malloc.hugetlb=1" in capsys.readouterr().err
