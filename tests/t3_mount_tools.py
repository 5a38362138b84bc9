"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Ordinary tools on a real mount: cp, tar, rsync, sha256sum, du (contract §3.1, §3.2)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pffs import manifest as mf
from sessions import tree_digest, varied_pages, write_session


def run(*cmd, cwd=None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr}"
    return r.stdout


def stats(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


@pytest.fixture
def local_tree(tmp_path, bf16_pages):
    """A local tree with two sessions (sharing a prefix), plain files, links and odd entries."""
    src = tmp_path / "src"
    src.mkdir()
    pages = varied_pages(bf16_pages, 24)
    write_session(src / "agent-a", pages[:16])
    write_session(src / "team" / "agent-b", pages[:8] + pages[16:24])
    (src / "notes.txt").write_text("hello\n")
    (src / "empty").write_bytes(b"")
    os.symlink("agent-a/manifest.json", src / "latest")
    os.link(src / "notes.txt", src / "notes-hardlink")
    os.chmod(src / "notes.txt", 0o600)
    os.utime(src / "notes.txt", ns=(1_600_000_000_123_456_789, 1_600_000_000_987_654_321))
    os.mkfifo(src / "fifo")
    return src


def test_cp_r_and_sha256sum(mnt, local_tree):
    run("cp", "-r", str(local_tree / "agent-a"), str(mnt.path))
    man = json.loads((mnt / "agent-a" / "manifest.json").read_text())
    out = run("sha256sum", *sorted(os.listdir(mnt / "agent-a" / "pages")), cwd=mnt / "agent-a" / "pages")
    sums = [line.split()[0] for line in out.splitlines()]
    assert ["sha256:" + s for s in sums] == man["pages"]
    assert (mnt / "agent-a" / "manifest.json").read_bytes() == (local_tree / "agent-a" / "manifest.json").read_bytes()
    assert stats(mnt)["sessions"] == 1


def test_cp_a_keeps_modes_times_links(mnt, local_tree):
    run("cp", "-a", str(local_tree), str(mnt / "copy"))
    assert tree_digest(mnt / "copy") == tree_digest(local_tree)
    a, b = os.stat(local_tree / "notes.txt"), os.stat(mnt / "copy" / "notes.txt")
    assert (a.st_mode, a.st_mtime_ns) == (b.st_mode, b.st_mtime_ns)
    assert os.stat(mnt / "copy" / "notes-hardlink").st_ino == b.st_ino
    assert os.readlink(mnt / "copy" / "latest") == "agent-a/manifest.json"
    run("diff", "-r", "--no-dereference", "-x", "fifo", str(local_tree), str(mnt / "copy"))


def test_cp_al_ln_mv_rm(mnt, local_tree):
    run("cp", "-r", str(local_tree / "agent-a"), str(mnt.path))
    before = stats(mnt)["stored_bytes"]
    run("cp", "-al", str(mnt / "agent-a"), str(mnt / "agent-hl"))
    p, q = mnt / "agent-a" / "pages" / "000003", mnt / "agent-hl" / "pages" / "000003"
    assert os.stat(p).st_ino == os.stat(q).st_ino and os.stat(p).st_nlink == 2
    (mnt / "agent-c" / "pages").mkdir(parents=True)
    run("ln", str(mnt / "agent-a" / "pages" / "000000"), str(mnt / "agent-c" / "pages" / "000000"))
    assert os.stat(mnt / "agent-c" / "pages" / "000000").st_nlink == 3
    run("mv", str(mnt / "agent-hl"), str(mnt / "agent-moved"))
    run("mv", "-f", str(mnt / "agent-c" / "pages" / "000000"),
        str(mnt / "agent-moved" / "pages" / "000001"))  # over an existing name
    assert (mnt / "agent-moved" / "pages" / "000001").read_bytes() == \
        (mnt / "agent-a" / "pages" / "000000").read_bytes()
    assert stats(mnt)["stored_bytes"] == before
    run("rm", "-r", str(mnt / "agent-moved"), str(mnt / "agent-c"))
    assert sorted(os.listdir(mnt.path)) == ["agent-a"]
    assert os.stat(p).st_nlink == 1


def test_tar_both_ways(mnt, local_tree, tmp_path):
    tarball = tmp_path / "in.tar"
    run("tar", "-cf", str(tarball), "-C", str(local_tree), ".")
    (mnt / "t").mkdir()
    run("tar", "-xpf", str(tarball), "-C", str(mnt / "t"))
    assert tree_digest(mnt / "t") == tree_digest(local_tree)
    out_tar = tmp_path / "out.tar"
    run("tar", "-cf", str(out_tar), "-C", str(mnt / "t"), ".")
    back = tmp_path / "back"
    back.mkdir()
    run("tar", "-xpf", str(out_tar), "-C", str(back))
    assert tree_digest(back) == tree_digest(local_tree)


def test_rsync_in_and_out_twice(mnt, local_tree, tmp_path):
    run("rsync", "-aH", str(local_tree) + "/", str(mnt / "r") + "/")
    assert tree_digest(mnt / "r") == tree_digest(local_tree)
    again = run("rsync", "-aHni", str(local_tree) + "/", str(mnt / "r") + "/")
    assert again.strip() == "", again
    back = tmp_path / "back"
    run("rsync", "-aH", "--exclude=/engines", str(mnt.path) + "/", str(back) + "/")
    assert tree_digest(back / "r") == tree_digest(local_tree)
    again = run("rsync", "-aHni", "--exclude=/engines", str(mnt.path) + "/", str(back) + "/")
    assert again.strip() == "", again
    assert stats(mnt)["sessions"] == 2


def test_du_matches_apparent_sizes(mnt, local_tree):
    run("cp", "-r", str(local_tree / "agent-a"), str(mnt.path))
    apparent = int(run("du", "-s", "--apparent-size", "-B1", str(mnt / "agent-a")).split()[0])
    blocks = int(run("du", "-s", "-B1", str(mnt / "agent-a")).split()[0])
    files = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(mnt / "agent-a") for f in fs)
    assert apparent == files
    assert files <= blocks < files + 512 * 20


def test_same_session_twice_and_forks_add_no_bytes(mnt, local_tree):
    run("cp", "-r", str(local_tree / "agent-a"), str(mnt / "one"))
    s1 = stats(mnt)
    run("cp", "-r", str(local_tree / "agent-a"), str(mnt / "two"))
    run("cp", "-r", str(mnt / "one"), str(mnt / "three"))
    run("cp", "-a", str(mnt / "one"), str(mnt / "four"))
    s2 = stats(mnt)
    assert s2["stored_bytes"] == s1["stored_bytes"]
    assert s2["unique_blobs"] == s1["unique_blobs"]
    assert s2["sessions"] == 4
    assert s2["dedup_ratio"] >= 3.9
    assert s2["compression_ratio"] > 1.3
