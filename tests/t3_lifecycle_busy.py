"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
gc on a busy mount (contract §4): writers, readers and deletions running while gc sweeps lose nothing."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from lifecycle_helpers import gc
from mountutil import pffs
from pffs import manifest as mf
from sessions import make_manifest, varied_pages

BUSY_SECONDS = float(os.environ.get("PFFS_TEST_BUSY_SECONDS", "30"))
ENOUGH_WITHIN = 150.0      # further seconds the busy work may take to do enough of each kind
PAGES = 4


def write_session(dst, pages, seq_id) -> None:
    (dst / "pages").mkdir(parents=True)
    for i, p in enumerate(pages):
        (dst / "pages" / mf.page_name(i)).write_bytes(p)
    (dst / "manifest.json").write_bytes(make_manifest(pages, seq_id=seq_id).to_json())


@pytest.mark.slow
def test_gc_during_writes_reads_and_deletes_loses_nothing(mnt, bf16_pages):
    # Kept sessions draw from one pool; short-lived ones from another, small
    # enough that new sessions keep reusing blobs that deleted sessions have
    # just turned into garbage: the race gc must get right.
    kept_pool = varied_pages(bf16_pages, 12, salt=77)
    churn_pool = varied_pages(bf16_pages, 10, salt=78)
    stop = threading.Event()
    lock = threading.Lock()
    kept: dict[str, list[bytes]] = {}      # sessions never deleted: readers check them
    errors: list[str] = []
    counts = {"written": 0, "deleted": 0, "reads": 0, "gcs": 0}

    def writer(w: int) -> None:
        rng = random.Random(w)
        churn: list[tuple[str, list[bytes]]] = []
        n = 0
        try:
            while not stop.is_set():
                keep = n % 4 == 0
                pages = rng.sample(kept_pool if keep else churn_pool, PAGES)
                name = f"w{w}-{n}"
                write_session(mnt / name, pages, name)
                n += 1
                with lock:
                    counts["written"] += 1
                    if keep:
                        kept[name] = pages
                    else:
                        churn.append((name, pages))
                if len(churn) > 1:
                    victim, vpages = churn.pop(0)
                    # gc has run meanwhile: the session must still read back whole.
                    for i, p in enumerate(vpages):
                        if (mnt / victim / "pages" / mf.page_name(i)).read_bytes() != p:
                            errors.append(f"writer {w}: {victim} page {i} differs")
                    for i in range(PAGES):
                        os.unlink(mnt / victim / "pages" / mf.page_name(i))
                    os.rmdir(mnt / victim / "pages")
                    os.unlink(mnt / victim / "manifest.json")
                    os.rmdir(mnt / victim)
                    with lock:
                        counts["deleted"] += 1
        except Exception as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(f"writer {w}: {e!r}")

    def reader(r: int) -> None:
        rng = random.Random(100 + r)
        try:
            while not stop.is_set():
                with lock:
                    items = list(kept.items())
                if not items:
                    time.sleep(0.01)
                    continue
                name, pages = rng.choice(items)
                for i, p in enumerate(pages):
                    got = (mnt / name / "pages" / mf.page_name(i)).read_bytes()
                    if got != p:
                        errors.append(f"reader {r}: {name} page {i} differs")
                with lock:
                    counts["reads"] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"reader {r}: {e!r}")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    # The race needs each kind of work to have happened a few times: gc runs
    # for BUSY_SECONDS and then on until it has (a loaded host does less in
    # the same time), up to a deadline only a stuck writer or reader reaches.
    end = time.monotonic() + BUSY_SECONDS
    deadline = end + ENOUGH_WITHIN
    removed = 0

    def enough() -> bool:
        with lock:
            done = dict(counts)
        return done["gcs"] >= 5 and done["deleted"] >= 10 and done["reads"] >= 10 and removed > 0
    try:
        while (time.monotonic() < end or not enough()) and time.monotonic() < deadline and not errors:
            out = gc(mnt.store)
            removed += int(out.split("removed ")[1].split(" blobs")[0])
            counts["gcs"] += 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert counts["gcs"] >= 5 and counts["deleted"] >= 10 and counts["reads"] >= 10, counts
    assert removed > 0, "gc never found garbage: the test did not race it"

    for name, pages in kept.items():
        assert [(mnt / name / "pages" / mf.page_name(i)).read_bytes() for i in range(PAGES)] == pages
    assert mnt.stop() == 0
    r = pffs("check", "--store", mnt.store, "--read-data", check=False)
    assert r.returncode == 0, r.stdout
    assert "DAMAGE" not in r.stdout and "incomplete" not in r.stdout


def test_a_namespace_lock_held_by_another_process_stalls_only_what_waits_for_it(mnt):
    """Another process (gc, check) holding the namespace's write lock makes a
    create wait for it, in the writer thread: the mount keeps answering
    meanwhile, and the create completes once the lock is let go."""
    import json
    import sqlite3

    from mountutil import wait_for
    from pffs import namespace as ns

    (mnt / "d").mkdir()

    def writes() -> dict:
        return json.loads((mnt / ".pffs" / "stats.json").read_text())["namespace_writes"]

    before = writes()
    other = sqlite3.connect(mnt.store / ns.DB_NAME, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    done = threading.Event()
    failed: list[BaseException] = []

    def create() -> None:
        try:
            (mnt / "d" / "new").write_bytes(b"x")
        except BaseException as e:      # (reported by the test, not lost in the thread)
            failed.append(e)
        finally:
            done.set()

    t = threading.Thread(target=create, daemon=True)
    t.start()
    try:
        # The create was handed to the writer thread, which waits for the lock...
        wait_for(lambda: writes()["by_writer"] > before["by_writer"], what="the create at the writer")
        assert not done.is_set()
        # ...while the event loop goes on answering (it never waited for the lock;
        # the kernel itself keeps d locked until the create is answered).
        assert "d" in os.listdir(mnt.path)
        assert (mnt / ".pffs" / "version").read_text().startswith("pffs ")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert done.wait(30), "the create did not complete once the lock was let go"
    assert not failed
    assert (mnt / "d" / "new").read_bytes() == b"x"
