"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
kill -9 of the daemon during a large copy (contract §3.7): every file whose close returned survives."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from lifecycle_helpers import copy_file, session_files
from mountutil import pffs, wait_for
from sessions import varied_pages, write_session

PAGE_SESSIONS = 28          # x 50 pages of 144 KiB: about 200 MiB
PAGES_PER_SESSION = 50
KILLS = 4


@pytest.mark.slow
def test_kill9_during_copy_keeps_every_closed_file(mount_factory, bf16_pages, tmp_path):
    src = tmp_path / "src"
    for k in range(PAGE_SESSIONS):
        write_session(src / f"s{k:02d}", varied_pages(bf16_pages, PAGES_PER_SESSION, salt=100 + k),
                      seq_id=f"s{k}")
    files = [f"s{k:02d}/{rel}" for k in range(PAGE_SESSIONS) for rel in session_files(src / f"s{k:02d}")]
    total = sum((src / f).stat().st_size for f in files)
    assert total > 190 << 20

    m = mount_factory()
    rng = random.Random(20240607)
    closed: list[str] = []
    i = 0
    kills = 0
    repaired = 0
    # Spread the kills over the copy, by progress (whatever this host's speed):
    # each comes a few milliseconds after the copy reaches a file chosen at
    # random, so mostly while a file is being written.
    kill_at = sorted(rng.sample(range(len(files) // 10, len(files) * 9 // 10), KILLS))
    while i < len(files):
        killed = threading.Event()
        pid = m.proc.pid
        timer = None

        def kill():
            os.kill(pid, signal.SIGKILL)
            killed.set()
        try:
            while i < len(files):
                if timer is None and kills < KILLS and i >= kill_at[kills]:
                    timer = threading.Timer(rng.uniform(0.0, 0.02), kill)
                    timer.start()
                rel = files[i]
                (m.path / rel).parent.mkdir(parents=True, exist_ok=True)
                copy_file(src / rel, m.path / rel)
                closed.append(rel)  # close() returned: this file must survive
                i += 1
        except OSError:
            assert killed.is_set() or (timer is not None and wait_for(killed.is_set, 10))
        if timer is not None:
            timer.cancel()
            timer.join()
        if not killed.is_set():
            break  # the copy finished before the kill
        kills += 1
        m.kill9()
        r = m.check_store()
        if r.returncode != 0:
            r = m.check_store("--repair")
            assert r.returncode == 0, r.stdout
            repaired += 1
        m.start()
        # Everything closed so far reads back; the file in flight at the kill is copied again.
        for rel in closed:
            assert (m.path / rel).read_bytes() == (src / rel).read_bytes(), f"{rel} after kill {kills}"
    assert kills == KILLS, f"only {kills} kills happened during the copy"
    assert len(closed) == len(files)
    for rel in files:
        assert (m.path / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert m.stop() == 0
    r = pffs("check", "--store", m.store, "--read-data", check=False)
    assert r.returncode == 0, r.stdout
    assert f"{PAGE_SESSIONS} sessions" in r.stdout
    assert repaired == 0, "check found damage after a kill -9"


def test_mount_right_after_kill9_cleans_up_the_dead_mount(mount_factory):
    """A service manager restarts pffs at once: the dead mount left by kill -9 is
    cleaned up by the next mount, even while the kernel still holds the mount
    point's attributes (cached for 10 s)."""
    m = mount_factory()
    (m.path / "kept").write_bytes(b"written before the kill\n")
    os.stat(m.path)         # the mount point's attributes, now in the kernel's cache
    m.proc.send_signal(signal.SIGKILL)
    m.proc.wait(30)
    m.proc = None
    m._stderr.close()
    # No unmount and no waiting in between; `pffs mount` returns once it serves.
    pffs("mount", "--store", m.store, m.path)
    try:
        assert (m.path / "kept").read_bytes() == b"written before the kill\n"
    finally:
        pffs("umount", m.path)
    assert "cleaning up a mount left by a dead daemon" in m.log_text()
