"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
pffs du: what a session or folder shares, what it holds alone, and that rm -r
then gc give back exactly what it says.

contract §4 (gc roots: files' blobs and every digest a manifest lists),
docs/operations.md (du).
"""

from __future__ import annotations

import json
import os

from lifecycle_helpers import count, gc, rm_r, run, stats
from mountutil import pffs
from pffs import manifest as mf
from pffs.store.storedir import StoreDir
from sessions import digest, varied_pages, write_session


def du(*paths) -> dict:
    return json.loads(pffs("du", "--json", *paths).stdout)


def stored_size(store, data: bytes) -> int:
    """The size on disk of the blob holding *data*."""
    return StoreDir(store).blobs.path(digest(data)).stat().st_size


def session_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def folds(mnt) -> int:
    return count(mnt, "SELECT COUNT(*) FROM folds")


def test_a_forks_own_bytes_are_the_page_it_rewrote_and_rm_and_gc_free_exactly_them(mnt, bf16_pages):
    pages = varied_pages(bf16_pages, 4, salt=1)
    write_session(mnt / "a", pages)
    run("cp", "-r", mnt / "a", mnt / "b")
    new = varied_pages(bf16_pages, 1, salt=2)[0]
    (mnt / "b" / "pages" / "000001").write_bytes(new)
    assert new != pages[1]
    gc(mnt.store)           # (nothing is garbage yet: the figures below are the whole store)
    size, man = len(pages[0]), (mnt / "a" / "manifest.json").stat().st_size

    figures = du(mnt / "a", mnt / "b")
    a, b = figures["paths"]
    assert (a["path"], b["path"]) == (str(mnt / "a"), str(mnt / "b"))
    assert b["files"] == 5 and b["logical_bytes"] == 4 * size + man == session_bytes(mnt / "b")
    assert b["exclusive_blobs"] == 1
    assert b["exclusive_bytes"] == len(new)
    assert b["exclusive_stored_bytes"] == stored_size(mnt.store, new)
    # Its other pages and manifest.json are a's; a's page 1 is still listed by its manifest.json.
    assert b["shared_bytes"] == 4 * size + man
    assert b["unique_bytes"] == b["shared_bytes"] + b["exclusive_bytes"]
    # a has nothing of its own: b holds or lists every page a holds.
    assert a["exclusive_bytes"] == a["exclusive_stored_bytes"] == 0 and a["shared_bytes"] == 4 * size + man
    # Together they are the whole store.
    before = stats(mnt.path)
    assert figures["together"]["exclusive_stored_bytes"] == before["stored_bytes"]
    assert figures["together"]["exclusive_bytes"] == before["unique_bytes"] == 5 * size + man

    table = pffs("du", mnt / "a", mnt / "b").stdout.splitlines()
    assert table[0].split() == ["Total", "Shared", "Exclusive", "Frees", "Path"]
    assert table[2].split()[-1] == str(mnt / "b") and table[3].split()[-1] == "(together)"
    # Page files of 144 KiB: b's Exclusive column is one page.
    assert table[2].split()[4:6] == [f"{len(new) / 1024:.1f}", "KiB"]

    rm_r(mnt, mnt / "b")
    out = gc(mnt.store)
    assert f"removed 1 blobs ({b['exclusive_stored_bytes']} bytes)" in out
    after = stats(mnt.path)
    assert before["stored_bytes"] - after["stored_bytes"] == b["exclusive_stored_bytes"]
    assert [(mnt / "a" / "pages" / mf.page_name(i)).read_bytes() for i in range(4)] == pages


def test_a_folder_holding_a_session_and_its_fork_holds_all_their_bytes_alone(mnt, bf16_pages):
    pages = varied_pages(bf16_pages, 4, salt=3)
    (mnt / "team").mkdir()
    write_session(mnt / "team" / "a", pages)
    run("cp", "-r", mnt / "team" / "a", mnt / "team" / "b")
    (mnt / "team" / "b" / "pages" / "000002").write_bytes(varied_pages(bf16_pages, 1, salt=4)[0])
    write_session(mnt / "c", varied_pages(bf16_pages, 2, salt=5))   # outside, sharing nothing
    gc(mnt.store)

    team, = du(mnt / "team")["paths"]
    assert team["files"] == 10 and team["logical_bytes"] == session_bytes(mnt / "team")
    assert team["blobs"] == team["exclusive_blobs"] == 6    # 4 pages, b's own page, the manifest
    assert team["exclusive_bytes"] == team["unique_bytes"] and team["shared_bytes"] == 0
    assert team["exclusive_stored_bytes"] == team["stored_bytes"]
    # The whole mount: the store's figures (no garbage, no hard links).
    whole, = du(mnt.path)["paths"]
    before = stats(mnt.path)
    assert [whole[k] for k in ("files", "logical_bytes", "unique_bytes", "stored_bytes")] == \
        [before[k] for k in ("files", "logical_bytes", "unique_bytes", "stored_bytes")]
    assert whole["exclusive_stored_bytes"] == before["stored_bytes"]

    rm_r(mnt, mnt / "team")
    gc(mnt.store)
    after = stats(mnt.path)
    assert before["stored_bytes"] - after["stored_bytes"] == team["exclusive_stored_bytes"]


def test_what_a_manifest_outside_lists_is_shared_and_gc_keeps_it(mnt, bf16_pages):
    """A blob only a manifest.json outside lists (no file outside holds it) is
    shared, and so is one listed by a manifest record that rm -r leaves (a
    hard link to the manifest.json outside the folder)."""
    pages = varied_pages(bf16_pages, 4, salt=6)
    write_session(mnt / "a", pages)
    run("cp", "-r", mnt / "a", mnt / "b")
    new = varied_pages(bf16_pages, 1, salt=7)[0]
    (mnt / "a" / "pages" / "000001").write_bytes(new)   # a's manifest.json still lists pages[1]
    gc(mnt.store)

    b, = du(mnt / "b")["paths"]
    assert b["exclusive_bytes"] == 0 and b["shared_bytes"] == b["unique_bytes"] > 0
    before = stats(mnt.path)
    rm_r(mnt, mnt / "b")
    assert "removed 0 blobs" in gc(mnt.store)
    assert stats(mnt.path)["stored_bytes"] == before["stored_bytes"]

    # Only a holds its pages now, pages[1] by its manifest alone ...
    a, = du(mnt / "a")["paths"]
    assert a["exclusive_blobs"] == a["blobs"] == 6
    # ... until its manifest.json has a name outside a: that record lists every page but new.
    (mnt / "keep").mkdir()
    os.link(mnt / "a" / "manifest.json", mnt / "keep" / "a.json")
    a, = du(mnt / "a")["paths"]
    assert a["exclusive_blobs"] == 1 and a["exclusive_bytes"] == len(new)
    assert a["exclusive_stored_bytes"] == stored_size(mnt.store, new)
    before = stats(mnt.path)
    rm_r(mnt, mnt / "a")
    gc(mnt.store)
    assert before["stored_bytes"] - stats(mnt.path)["stored_bytes"] == a["exclusive_stored_bytes"]
    # What du called shared is still there: a fork of the kept manifest gets every page.
    (mnt / "c" / "pages").mkdir(parents=True)
    run("cp", mnt / "keep" / "a.json", mnt / "c" / "manifest.json")
    assert [(mnt / "c" / "pages" / mf.page_name(i)).read_bytes() for i in range(4)] == pages


def test_a_folded_fork_counts_its_page_files_without_being_looked_into(mnt, bf16_pages):
    pages = varied_pages(bf16_pages, 3, salt=8)
    write_session(mnt / "a", pages)
    assert "3 pages" in pffs("fork", mnt / "a", mnt / "f").stdout
    folded, = du(mnt / "f")["paths"]
    assert folds(mnt) == 1      # (du looked at no name in f/pages)
    assert folded["files"] == 4 and folded["logical_bytes"] == session_bytes(mnt / "a")
    assert folded["exclusive_bytes"] == 0 and folded["blobs"] == 4
    assert sorted(os.listdir(mnt / "f" / "pages")) == [mf.page_name(i) for i in range(3)]  # (unfolds it)
    assert du(mnt / "f")["paths"] == [folded]
    # Without a, the fork holds every page alone: through its manifest and its page files.
    rm_r(mnt, mnt / "a")
    alone, = du(mnt / "f")["paths"]
    assert alone["exclusive_blobs"] == 4 and alone["exclusive_stored_bytes"] == alone["stored_bytes"]


def test_a_path_outside_a_mount_or_missing_is_one_line_and_fails(mnt, tmp_path):
    (mnt / "s").mkdir()
    for path, why in ((tmp_path, "not in a mounted pffs"), (mnt / "gone", "no such file or directory"),
                      (mnt / ".pffs", "not stored")):
        r = pffs("du", mnt / "s", path, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"pffs du: {path}: ") and why in lines[0], lines
