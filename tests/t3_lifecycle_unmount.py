"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
`pffs umount` and SIGTERM unmount whatever clients are doing: a shell whose
folder is in the mount, a writer and readers in the middle of their loops.
Nothing a client had closed is lost, the daemon exits 0, and no client is left
blocked (their requests end when the daemon's end of the connection does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mountutil import is_mounted, pffs, wait_for

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

WRITER = """
import os, sys
mnt = sys.argv[1]
chunk = os.urandom(1 << 20)
n = 0
try:
    while True:
        with open(os.path.join(mnt, f"w{n % 4}"), "wb") as f:
            for _ in range(8):
                f.write(chunk)
        # (Renamed into place: an unmount between its open and its write
        # would leave "closed" empty, and the index of the last file unknown.)
        with open(os.path.join(mnt, "closed.new"), "w") as f:
            f.write(str(n))
        os.rename(os.path.join(mnt, "closed.new"), os.path.join(mnt, "closed"))
        n += 1
        with open(os.path.join(mnt, "half"), "ab") as f:
            f.write(chunk)
            print("busy", flush=True)
            f.write(chunk)
except OSError as e:
    print("stopped:", e.strerror, flush=True)
"""

READER = """
import os, sys
path = sys.argv[1]
try:
    while True:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
        print("read", flush=True)
except OSError as e:
    print("stopped:", e.strerror, flush=True)
"""


def busy_clients(m) -> list[subprocess.Popen]:
    (m / "big").write_bytes(os.urandom(32 << 20))
    procs = [
        subprocess.Popen(["sh", "-c", "cd \"$1\" && exec sleep 600", "sh", str(m.path)]),
        subprocess.Popen([sys.executable, "-c", WRITER, str(m.path)], stdout=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, "-c", READER, str(m / "big")], stdout=subprocess.PIPE, text=True),
    ]
    held = open(m / "big", "rb")        # (an open file too)
    procs[1].stdout.readline()          # each has done some work
    procs[2].stdout.readline()
    procs.append(held)
    return procs


def end_clients(procs) -> None:
    held = procs.pop()
    try:
        held.close()
    except OSError:
        pass
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)     # (nothing is left blocked in a request: a kill ends each)


def stopped_in(m, start: float) -> float:
    wait_for(lambda: not is_mounted(m.path) and m.proc.poll() is not None, timeout=60,
             what="the unmount and the daemon's exit")
    took = time.monotonic() - start
    print(f"unmounted and exited {took:.2f} s after the request")
    return took


@pytest.mark.parametrize("how", ["sigterm", "pffs-umount"])
def test_unmount_while_clients_are_busy(mount_factory, how):
    m = mount_factory()
    procs = busy_clients(m)
    try:
        start = time.monotonic()
        if how == "sigterm":
            m.proc.send_signal(signal.SIGTERM)
        else:
            r = pffs("umount", m.path, check=False)
            assert r.returncode == 0, r.stderr
            assert "busy" in r.stderr and str(m.path) in r.stderr
        stopped_in(m, start)
        assert m.proc.returncode == 0
    finally:
        end_clients(procs)
    closed = int((m.path / "closed").read_text()) if (m.path / "closed").exists() else None
    assert closed is None   # (unmounted: the path is the empty folder below)
    m.proc = None
    m._stderr.close()
    m.start()
    # Every file the writer closed is whole.
    n = int((m / "closed").read_text())
    assert (m / f"w{n % 4}").stat().st_size == 8 << 20
    assert (m / "big").stat().st_size == 32 << 20


def test_a_connection_the_kernel_aborts_ends_the_daemon_in_order(mount_factory):
    """An abort of the FUSE connection (fusectl's abort file, as `umount -f` or an
    administrator would) ends the daemon with status 0, no traceback in its log;
    what was closed before it is kept."""
    ctl = Path("/sys/fs/fuse/connections")
    if not os.path.ismount(ctl):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(ctl)], check=True)
    m = mount_factory()
    (m / "kept").write_bytes(b"k" * 100_000)
    (ctl / str(os.minor(os.stat(m.path).st_dev)) / "abort").write_text("1")
    wait_for(lambda: m.proc.poll() is not None, timeout=60, what="the daemon's exit")
    assert m.proc.returncode == 0
    assert m.stop() == 0
    m.start()
    assert (m / "kept").read_bytes() == b"k" * 100_000


def test_econnaborted_from_the_session_loop_is_the_end_of_the_session():
    """/dev/fuse answering ECONNABORTED (the kernel aborted the connection) ends
    pyfuse3's loop with that error, inside exception groups: the daemon takes it
    as the end of the session (and commits what is staged), anything else not."""
    from pffs.daemon.mount import _connection_aborted
    aborted = ConnectionAbortedError(103, "fuse_session_receive_buf failed")
    assert _connection_aborted(ExceptionGroup("trio", [ExceptionGroup("pyfuse3", [aborted])]))
    assert _connection_aborted(aborted)
    assert not _connection_aborted(ExceptionGroup("trio", [aborted, OSError(5, "EIO")]))
    assert not _connection_aborted(BaseExceptionGroup("trio", [KeyboardInterrupt()]))
    assert not _connection_aborted(RuntimeError())
