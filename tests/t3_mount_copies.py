"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Copies within the mount (copy_file_range) and a reader's close (FOPEN_NOFLUSH),
with pyfuse3 built from third_party/pyfuse3, and the same copies with the
features off."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pyfuse3
import pytest

from sessions import varied_pages, write_session

PATCHED = hasattr(pyfuse3.Operations, "copy_file_range") and hasattr(pyfuse3.FileInfo(), "noflush")
needs_patch = pytest.mark.skipif(not PATCHED, reason="pyfuse3 without third_party/pyfuse3's patch")


def stats(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def run(*cmd, cwd=None) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr}"
    return r.stdout


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_the_setup_builds_the_patched_pyfuse3():
    """(scripts/setup.sh builds it: every test below runs with the features on.)"""
    assert PATCHED


@needs_patch
def test_cp_r_of_a_session_within_the_mount_shares_its_blobs(mnt, bf16_pages, tmp_path):
    """cp -r a b: every file is one copy_file_range, no page byte is read or
    written through FUSE, no blob byte is stored, and b checks clean."""
    pages = varied_pages(bf16_pages, 24)
    write_session(mnt / "a", pages)
    big = os.urandom(1 << 20) * 70            # a file of two blocks
    (mnt / "a" / "notes.bin").write_bytes(big)
    before = stats(mnt)
    run("cp", "-r", mnt / "a", mnt / "b")
    after = stats(mnt)
    req = {k: after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in after["requests"]}
    assert after["stored_bytes"] == before["stored_bytes"]
    assert req.get("copy_file_range", 0) >= 26       # 24 pages, notes.bin, manifest.json
    assert req.get("write", 0) == 0
    manifest = os.stat(mnt / "a" / "manifest.json").st_size
    copied = {k: after["copies"][k] - before["copies"][k] for k in after["copies"]}
    # (manifest.json's bytes are copied: a manifest is checked as it takes its name)
    assert copied == {"shared_bytes": sum(map(len, pages)) + len(big), "copied_bytes": manifest}
    assert after["sessions"] == 2
    sums = run("sha256sum", *sorted(os.listdir(mnt / "a" / "pages")), cwd=mnt / "a" / "pages")
    (tmp_path / "sums").write_text(sums)
    run("sha256sum", "-c", "--quiet", tmp_path / "sums", cwd=mnt / "b" / "pages")
    assert sha(mnt / "b" / "notes.bin") == hashlib.sha256(big).hexdigest()
    assert (mnt / "b" / "manifest.json").read_bytes() == (mnt / "a" / "manifest.json").read_bytes()
    assert os.stat(mnt / "b" / "notes.bin").st_size == len(big)


def test_names_times_and_shared_blobs_are_written_without_a_thread_hand_off(mnt, bf16_pages):
    """With no other change in flight, a new name, a file given another's blobs
    and a change of times are committed on the event loop: cp -a of a session
    within the mount hands no transaction to the writer thread."""
    pages = varied_pages(bf16_pages, 8)
    write_session(mnt / "a", pages)
    # (the session's own commits are the commit threads'; let any in flight end)
    before = stats(mnt)["namespace_writes"]
    run("cp", "-a", mnt / "a", mnt / "b")
    after = stats(mnt)["namespace_writes"]
    assert after["by_writer"] - before["by_writer"] == 0
    # 2 folders and 9 files made, each given its content (or bytes) and its times
    assert after["on_loop"] - before["on_loop"] >= 2 * 2 + 9 * 2
    sums = run("sha256sum", *sorted(os.listdir(mnt / "a" / "pages")), cwd=mnt / "a" / "pages")
    assert run("sha256sum", *sorted(os.listdir(mnt / "b" / "pages")), cwd=mnt / "b" / "pages") == sums
    for name in ("manifest.json", "pages/000003"):
        assert os.stat(mnt / "b" / name).st_mtime_ns == os.stat(mnt / "a" / name).st_mtime_ns


def test_rm_r_deletes_page_files_on_the_event_loop(mnt, bf16_pages):
    """rm -r of a session: each unlink, and each page file's deletion once the
    kernel forgets it, is a transaction on the event loop (no thread hand-off);
    only deletions that may take a page list with them (manifest.json, the last
    page file of a fork) go to the writer thread. What is left reads the same."""
    import sqlite3

    from mountutil import pffs as pffs_cli
    from mountutil import wait_for
    from pffs import namespace as ns

    pages = varied_pages(bf16_pages, 16)
    write_session(mnt / "a", pages)
    run("cp", "-r", mnt / "a", mnt / "b")           # (b's files hold a's blobs)
    pffs_cli("fork", mnt / "a", mnt / "c")           # (c's through a's page list)
    sums = run("sha256sum", *sorted(os.listdir(mnt / "a" / "pages")), cwd=mnt / "a" / "pages")
    # (c's page files become inodes of their own as they are looked up)
    assert run("sha256sum", *sorted(os.listdir(mnt / "c" / "pages")), cwd=mnt / "c" / "pages") == sums
    db = sqlite3.connect(f"file:{mnt.store / ns.DB_NAME}?mode=ro", uri=True)

    def inodes() -> int:
        return db.execute("SELECT count(*) FROM inodes").fetchone()[0]

    for name in ("a", "c"):
        n = inodes()
        before = stats(mnt)["namespace_writes"]
        run("rm", "-r", mnt / name)
        # 16 pages, manifest.json, pages/ and the folder (deleted at the kernel's FORGET)
        wait_for(lambda: inodes() == n - 19, what=f"{name}'s inodes deleted")
        after = stats(mnt)["namespace_writes"]
        # (in the writer: manifest.json's, a fork's pages/ (its fold) and last page
        # file, and changes asked while one of them runs there; 38 before)
        assert after["by_writer"] - before["by_writer"] <= 8, (name, before, after)
        assert after["on_loop"] - before["on_loop"] >= 20      # (deletions may go in batches)
        assert run("sha256sum", *sorted(os.listdir(mnt / "b" / "pages")), cwd=mnt / "b" / "pages") == sums
    db.close()


@needs_patch
def test_cp_r_within_the_mount_decodes_no_blob(mnt, bf16_pages):
    """cp opens every source file and copies it with copy_file_range, never
    reading it: no blob is fetched ahead for it (read-ahead starts at a
    reader's first read, not at its open), and none is fetched but the
    manifest's, whose bytes are copied; a reader still gets its read-ahead."""
    pages = varied_pages(bf16_pages, 40)
    write_session(mnt / "a", pages)
    (mnt / "a" / "notes.bin").write_bytes(os.urandom(1 << 20))
    assert mnt.stop() == 0
    mnt.start()     # (nothing decoded in the daemon's cache)
    before = stats(mnt)["cache"]
    run("cp", "-r", mnt / "a", mnt / "b")
    after = stats(mnt)["cache"]
    assert after["prefetched"] == before["prefetched"]
    assert after["fetched_by_reads"] - before["fetched_by_reads"] <= 1     # manifest.json
    subprocess.run(["cat", *[mnt / "b" / "pages" / n for n in sorted(os.listdir(mnt / "b" / "pages"))]],
                   stdout=subprocess.DEVNULL, check=True, timeout=300)
    assert stats(mnt)["cache"]["prefetched"] > after["prefetched"]


@needs_patch
def test_copy_file_range_of_parts_and_of_files_being_written(mnt):
    """Ranges that are not a whole file, a source still being written, a target
    that is not empty: the bytes a copy would give, and the counts."""
    data = os.urandom(3 << 20)
    (mnt / "src").write_bytes(data)
    want = bytearray(os.urandom(1 << 20))
    (mnt / "dst").write_bytes(bytes(want))
    with open(mnt / "src", "rb") as s, open(mnt / "dst", "r+b") as d:
        n = os.copy_file_range(s.fileno(), d.fileno(), 500_000, 123_456, 4096)
        assert n == 500_000
        want[4096:4096 + n] = data[123_456:123_456 + n]
        n = os.copy_file_range(s.fileno(), d.fileno(), 10 << 20, (3 << 20) - 1000, 2 << 20)
        assert n == 1000                         # (up to the source's end)
        want.extend(bytes((2 << 20) - len(want)))
        want[2 << 20:] = data[-1000:]
        assert os.copy_file_range(s.fileno(), d.fileno(), 100, 3 << 20, 0) == 0   # at its end
    assert (mnt / "dst").read_bytes() == bytes(want)
    with open(mnt / "growing", "wb") as w:                 # staged, not committed yet
        w.write(b"x" * 100_000)
        w.flush()
        with open(mnt / "growing", "rb") as s, open(mnt / "copy", "wb") as d:
            assert os.copy_file_range(s.fileno(), d.fileno(), 1 << 20, 0, 0) == 100_000
    assert (mnt / "copy").read_bytes() == b"x" * 100_000
    with open(mnt / "src", "rb") as s, open(mnt / "dst", "wb") as d:   # O_TRUNC: whole, shared
        assert os.copy_file_range(s.fileno(), d.fileno(), 8 << 20, 0, 0) == len(data)
    assert (mnt / "dst").read_bytes() == data


@needs_patch
def test_a_manifest_copied_within_the_mount_is_checked_and_forks(mnt, bf16_pages):
    pages = varied_pages(bf16_pages, 4)
    write_session(mnt / "a", pages)
    (mnt / "c" / "pages").mkdir(parents=True)
    run("cp", mnt / "a" / "manifest.json", mnt / "c" / "manifest.json")
    assert sorted(os.listdir(mnt / "c" / "pages")) == ["000000", "000001", "000002", "000003"]
    (mnt / "bad.json").write_bytes(b"{not json")
    (mnt / "d" / "pages").mkdir(parents=True)
    mnt.allow(r"refused manifest")
    r = subprocess.run(["cp", str(mnt / "bad.json"), str(mnt / "d" / "manifest.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Invalid argument" in r.stderr
    assert os.listdir(mnt / "d" / "pages") == []


@needs_patch
def test_a_cold_read_of_a_page_file_costs_three_requests(mnt, bf16_pages):
    """open, read, release: a reader's close sends no FLUSH (FOPEN_NOFLUSH)."""
    write_session(mnt / "a", varied_pages(bf16_pages, 2))
    path = mnt / "a" / "pages" / "000001"
    os.stat(path)                       # (the lookup: not part of the read)
    keys = ("open", "read", "flush", "release")
    s0 = stats(mnt)["requests"]
    s1 = stats(mnt)["requests"]         # (what reading stats.json itself costs)
    with open(path, "rb") as f:
        assert len(f.read()) == len(bf16_pages[0])
    s2 = stats(mnt)["requests"]
    counted = {k: (s2.get(k, 0) - s1.get(k, 0)) - (s1.get(k, 0) - s0.get(k, 0)) for k in keys}
    assert counted == {"open": 1, "read": 1, "flush": 0, "release": 1}


@pytest.mark.skipif(not hasattr(pyfuse3, "set_spin"), reason="pyfuse3 built with an older patch")
def test_a_client_sending_requests_one_after_another_finds_the_daemon_reading(mount_factory, bf16_pages,
                                                                               monkeypatch):
    """After answering a request, the daemon reads for the client's next one
    for a few tens of microseconds before it waits in trio (pyfuse3.set_spin):
    most of cp's requests, one after another, are read then, where each used
    to cost a wait.  Counted (stats.json's request_reads) over cp -r of 48
    files, against the same copy with PFFS_SPIN_US=0.  The spin here is 2 ms,
    not the default 30 us, so that the count does not depend on how fast the
    host runs cp (on a slow or loaded one cp's next request may come after
    30 us, and the copy then counts more waits)."""
    pages = varied_pages(bf16_pages, 48)
    waited = {}
    for spin in ("0", "2000"):
        monkeypatch.setenv("PFFS_SPIN_US", spin)
        m = mount_factory(f"m{spin}")
        write_session(m / "a", pages)
        before = stats(m)
        run("cp", "-r", m / "a", m / "b")
        after = stats(m)
        served = sum(after["requests"].values()) - sum(before["requests"].values())
        reads = {k: v - before["request_reads"][k] for k, v in after["request_reads"].items()}
        assert served >= 48 * 8, served
        # (stats.json's own requests are read too: the one asking for after's)
        assert served <= sum(reads.values()) <= served + 8, (served, reads)
        if spin == "0":
            assert reads["spun"] == 0, reads
        waited[spin] = reads["waited"] / served
    # (Without the spin most wait, 0.8 of them here; not asserted: on a
    # loaded host requests queue up, and fewer wait either way.)
    assert waited["2000"] < 0.25, waited


def test_with_the_features_off_copies_move_bytes_and_are_right(mount_factory, bf16_pages,
                                                                monkeypatch):
    """A stock pyfuse3 (as PFFS_STOCK_PYFUSE3=1 makes pffs act): one log line says
    what is off, cp -r copies the bytes through read and write, and the copy is right."""
    monkeypatch.setenv("PFFS_STOCK_PYFUSE3", "1")
    m = mount_factory()
    write_session(m / "a", varied_pages(bf16_pages, 6))
    before = stats(m)["requests"]
    run("cp", "-r", m / "a", m / "b")
    after = stats(m)["requests"]
    assert after.get("write", 0) - before.get("write", 0) >= 6
    for name in os.listdir(m / "a" / "pages"):
        assert sha(m / "b" / "pages" / name) == sha(m / "a" / "pages" / name)
    assert "without third_party/pyfuse3's patch" in m.log_text()
