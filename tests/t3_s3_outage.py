"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
A mount of an S3 store while its server is frozen, then stopped, then back:
cached pages still read, uncached ones and writes fail with EIO in bounded time,
nothing committed is lost, and everything works again without a remount."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time

import pytest

from mountutil import wait_for
from pffs import manifest as mf
from seaweed import s3_mounts, weed  # noqa: F401  (fixtures)
from sessions import varied_pages, write_session

TIMEOUT = 2        # -o s3_timeout: seconds to connect and per read
RETRIES = 2        # -o s3_retries: attempts in all
# An S3 request fails after at most RETRIES attempts of 2 * TIMEOUT plus backoff;
# a read is one request, a write at most a HEAD and a PUT.
BOUND = 2 * RETRIES * 2 * TIMEOUT + 5


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def expect_eio(fn) -> float:
    t0 = time.monotonic()
    with pytest.raises(OSError) as ei:
        fn()
    elapsed = time.monotonic() - t0
    assert ei.value.errno == errno.EIO, ei.value
    assert elapsed < BOUND, f"EIO took {elapsed:.1f} s"
    print(f"EIO after {elapsed:.1f} s")
    return elapsed


def test_server_outage_and_recovery(weed, s3_mounts, bf16_pages):
    bucket = weed.make_bucket()
    m = s3_mounts("m", f"s3://{bucket}/o", [f"s3_timeout={TIMEOUT}", f"s3_retries={RETRIES}",
                                           "lease=4s"])
    pages = varied_pages(bf16_pages, 8)
    cold = varied_pages(bf16_pages, 8, salt=1)
    write_session(m / "s", pages)
    write_session(m / "cold", cold)  # never read before the outage
    (m / "notes.txt").write_bytes(b"committed before the outage\n")
    # Forget every locally cached frame: the pages now live in the bucket only.
    assert m.stop() == 0
    shutil.rmtree(m.store / "blobs")
    m.start()
    m.allow(r"blob store unreachable|staged changes dropped|registration not renewed")
    pdir, cdir = m / "s" / "pages", m / "cold" / "pages"
    cached = {i: read(pdir / mf.page_name(i)) for i in (0, 1)}  # fetched, now in the cache
    assert cached == {0: pages[0], 1: pages[1]}
    assert read(m / "notes.txt") == b"committed before the outage\n"

    try:
        # Frozen: connections open but nothing answers (timeouts).
        os.killpg(weed.proc.pid, signal.SIGSTOP)
        try:
            assert read(pdir / mf.page_name(0)) == pages[0]
            expect_eio(lambda: read(cdir / mf.page_name(0)))
        finally:
            os.killpg(weed.proc.pid, signal.SIGCONT)

        # Stopped: connections refused.
        weed.stop()
        assert read(pdir / mf.page_name(1)) == pages[1]
        assert read(m / "notes.txt") == b"committed before the outage\n"
        expect_eio(lambda: read(cdir / mf.page_name(5)))

        def write_new():
            with open(m / "new.bin", "wb") as f:
                f.write(pages[7][::-1])
        expect_eio(write_new)

        def overwrite():
            with open(m / "notes.txt", "wb") as f:
                f.write(b"lost in the outage\n")
        expect_eio(overwrite)
        (m / "offline-dir").mkdir()                    # metadata works without the bucket
        assert sorted(os.listdir(pdir)) == [mf.page_name(i) for i in range(8)]
        # Once the failed writer's handle is released, its bytes are gone.
        wait_for(lambda: read(m / "notes.txt") == b"committed before the outage\n", timeout=10,
                 what="the failed overwrite to be dropped")
    finally:
        if weed.proc is None:
            weed.start()

    # Back, same mount: every page reads, writes land, nothing committed was lost.
    assert [read(pdir / mf.page_name(i)) for i in range(8)] == pages
    assert [read(cdir / mf.page_name(i)) for i in range(8)] == cold
    assert read(m / "notes.txt") == b"committed before the outage\n"
    assert (m / "new.bin").stat().st_size == 0       # created, but its bytes never made it
    (m / "new.bin").write_bytes(pages[7][::-1])
    assert read(m / "new.bin") == pages[7][::-1]
    wait_for(lambda: "bucket reachable again" in m.log_text(), timeout=20,
             what="the registration to be renewed")
    assert (m / "offline-dir").is_dir()
