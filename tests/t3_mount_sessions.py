"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Sessions on a real mount: manifest validation, forks, seal, durability (contract §3.3–3.7)."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess

import pytest

import manifests as ex
from mountutil import pffs, wait_for
from pffs import manifest as mf
from sessions import digest, make_manifest, varied_pages, write_session


def stats(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def bad_cases():
    return ex.BAD + [("oversize", ex.oversize(), "manifest")]


@pytest.mark.parametrize("how", ["close", "rename", "link"])
def test_bad_manifests_refused_old_kept(mnt, how):
    mnt.allow("refused manifest")
    s = mnt / "s"
    s.mkdir()
    good = ex.good_bytes()
    (s / "manifest.json").write_bytes(good)
    for name, data, _field in bad_cases():
        if how == "close":
            with pytest.raises(OSError) as ei:
                with open(s / "manifest.json", "wb") as f:
                    f.write(data)
        else:
            (s / "candidate").write_bytes(data)
            with pytest.raises(OSError) as ei:
                if how == "rename":
                    os.rename(s / "candidate", s / "manifest.json")
                else:
                    os.unlink(s / "manifest.json")
                    try:
                        os.link(s / "candidate", s / "manifest.json")
                    finally:
                        if not (s / "manifest.json").exists():
                            (s / "manifest.json").write_bytes(good)
            os.unlink(s / "candidate")
        assert ei.value.errno == errno.EINVAL, name
        assert (s / "manifest.json").read_bytes() == good, name
    log = mnt.log_text()
    assert log.count("refused manifest") >= len(bad_cases())
    assert "s/manifest.json" in log and "dtype: unknown dtype" in log


@pytest.mark.parametrize("how", ["rename", "link"])
def test_a_file_given_the_manifest_name_while_open_is_checked_at_close(mnt, how):
    """A file created under another name is checked at close once it is named manifest.json."""
    mnt.allow("refused manifest")
    s = mnt / "s"
    s.mkdir()
    good = ex.good_bytes()
    fd = os.open(s / "draft", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, good)
        if how == "rename":
            os.rename(s / "draft", s / "manifest.json")
        else:
            os.link(s / "draft", s / "manifest.json")
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"{not json", 0)
    finally:
        with pytest.raises(OSError) as ei:
            os.close(fd)
    assert ei.value.errno == errno.EINVAL
    assert (s / "manifest.json").read_bytes() == good


def test_new_bad_manifest_by_cp_fails(mnt, tmp_path):
    mnt.allow("refused manifest")
    bad = tmp_path / "manifest.json"
    bad.write_bytes(b"{not json")
    (mnt / "x").mkdir()
    r = subprocess.run(["cp", str(bad), str(mnt / "x" / "manifest.json")], capture_output=True, text=True)
    assert r.returncode != 0 and "Invalid argument" in r.stderr
    assert stats(mnt)["sessions"] == 0


def test_seed_page_table_manifest_accepted(mnt):
    (mnt / "seed").mkdir()
    (mnt / "seed" / "manifest.json").write_bytes(ex.seed_form())
    assert (mnt / "seed" / "manifest.json").read_bytes() == ex.seed_form()  # never rewritten
    assert stats(mnt)["sessions"] == 1


def test_metadata_only_fork(mnt, bf16_pages, tmp_path):
    pages = varied_pages(bf16_pages, 12)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    before = stats(mnt)
    # The manual recipe: mkdir -p b/pages && cp a/manifest.json b/
    (mnt / "b" / "pages").mkdir(parents=True)
    subprocess.run(["cp", str(mnt / "a" / "manifest.json"), str(mnt / "b")], check=True)
    names = sorted(os.listdir(mnt / "b" / "pages"))
    assert names == [mf.page_name(i) for i in range(12)]
    for i in range(12):
        assert (mnt / "b" / "pages" / mf.page_name(i)).read_bytes() == pages[i]
    after = stats(mnt)
    assert after["stored_bytes"] == before["stored_bytes"]
    assert after["sessions"] == 2
    st = os.stat(mnt / "b" / "pages" / "000000")
    assert st.st_uid == os.getuid() and st.st_size == len(pages[0])


def test_fork_without_pages_folder_creates_nothing(mnt, bf16_pages, tmp_path):
    write_session(tmp_path / "a", varied_pages(bf16_pages, 3))
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    (mnt / "m").mkdir()
    subprocess.run(["cp", str(mnt / "a" / "manifest.json"), str(mnt / "m")], check=True)
    assert os.listdir(mnt / "m") == ["manifest.json"]


def test_fork_of_unknown_pages_is_incomplete(mnt, bf16_pages, tmp_path):
    pages = varied_pages(bf16_pages, 4)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    m = make_manifest(pages + varied_pages(bf16_pages, 2, salt=9))
    (mnt / "c" / "pages").mkdir(parents=True)
    (mnt / "c" / "manifest.json").write_bytes(m.to_json())
    assert sorted(os.listdir(mnt / "c" / "pages")) == [mf.page_name(i) for i in range(4)]


def test_fork_into_a_partly_filled_pages_folder_keeps_what_is_there(mnt, bf16_pages, tmp_path):
    """Pages already named stay as they are; stored pages fill the rest; unknown ones stay missing."""
    pages = varied_pages(bf16_pages, 6)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    listed = pages[:3] + varied_pages(bf16_pages, 1, salt=9) + pages[4:]   # page 3 is stored nowhere
    (mnt / "c" / "pages").mkdir(parents=True)
    own = b"not a page of this session"
    (mnt / "c" / "pages" / "000001").write_bytes(own)
    (mnt / "c" / "manifest.json").write_bytes(make_manifest(listed).to_json())
    names = sorted(os.listdir(mnt / "c" / "pages"))
    assert names == [mf.page_name(i) for i in (0, 1, 2, 4, 5)]
    assert (mnt / "c" / "pages" / "000001").read_bytes() == own
    for i in (0, 2, 4, 5):
        assert (mnt / "c" / "pages" / mf.page_name(i)).read_bytes() == pages[i]
    inodes = {os.stat(mnt / "c" / "pages" / n).st_ino for n in names}
    inodes |= {os.stat(mnt / "a" / "pages" / mf.page_name(i)).st_ino for i in range(6)}
    assert len(inodes) == 11
    # The page that was missing comes in later; the same manifest again adds it.
    (mnt / "d").mkdir()
    (mnt / "d" / "p3").write_bytes(listed[3])
    (mnt / "c" / "manifest.json").unlink()
    (mnt / "c" / "manifest.json").write_bytes(make_manifest(listed).to_json())
    assert sorted(os.listdir(mnt / "c" / "pages")) == [mf.page_name(i) for i in range(6)]
    assert (mnt / "c" / "pages" / "000003").read_bytes() == listed[3]
    assert (mnt / "c" / "pages" / "000001").read_bytes() == own


def folds(mnt) -> int:
    """Folded forks in the mounted store's namespace (read beside the daemon)."""
    c = sqlite3.connect(f"file:{mnt.store / 'namespace.db'}?mode=ro", uri=True)
    try:
        return c.execute("SELECT COUNT(*) FROM folds").fetchone()[0]
    finally:
        c.close()


def test_a_fork_is_one_row_until_its_folder_is_looked_into(mnt, bf16_pages, tmp_path):
    """Every way into a folded fork's pages/ finds all its page files: a lookup, a listing,
    a new name, rmdir, rm -r, a rename of the folder; stats count them all along."""
    pages = varied_pages(bf16_pages, 4, salt=31)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    names = [mf.page_name(i) for i in range(4)]
    before = stats(mnt)
    for f in "bcdefg":
        assert "4 pages" in pffs("fork", mnt / "a", mnt / f).stdout
    assert folds(mnt) == 6
    after = stats(mnt)
    man = (mnt / "a" / "manifest.json").stat().st_size
    assert after["files"] == before["files"] + 6 * 5
    assert after["logical_bytes"] == before["logical_bytes"] + 6 * (sum(map(len, pages)) + man)
    assert after["stored_bytes"] == before["stored_bytes"]
    assert os.getxattr(mnt / "b" / "pages", "user.pffs.entries") == b"4"
    # A lookup.
    assert (mnt / "b" / "pages" / "000002").read_bytes() == pages[2]
    assert folds(mnt) == 5
    # A listing.
    assert sorted(os.listdir(mnt / "c" / "pages")) == names
    # A new name: the lookup that misses, then the create.
    (mnt / "d" / "pages" / "extra").write_bytes(b"x")
    assert sorted(os.listdir(mnt / "d" / "pages")) == names + ["extra"]
    # rmdir finds it full; rm -r lists it, then removes every file.
    with pytest.raises(OSError) as e:
        os.rmdir(mnt / "e" / "pages")
    assert e.value.errno == errno.ENOTEMPTY
    subprocess.run(["rm", "-r", str(mnt / "e")], check=True)
    assert not (mnt / "e").exists()
    # The folder renamed: still folded, its files come with it.
    os.rename(mnt / "f" / "pages", mnt / "f" / "moved")
    assert folds(mnt) == 2
    assert [(mnt / "f" / "moved" / n).read_bytes() for n in names] == pages
    assert [(mnt / "g" / "pages" / n).read_bytes() for n in names] == pages
    assert folds(mnt) == 0
    inodes = {os.stat(mnt / f / d / n).st_ino for f, d in
              (("a", "pages"), ("b", "pages"), ("c", "pages"), ("d", "pages"), ("f", "moved"), ("g", "pages"))
              for n in names}
    assert len(inodes) == 6 * 4
    now = stats(mnt)
    assert now["files"] == after["files"] - 5 + 1     # e's 5 files gone, d's extra
    assert now["unique_bytes"] == before["unique_bytes"] + len(b"x")


def test_pffs_fork_and_seal(mnt, bf16_pages, tmp_path):
    pages = varied_pages(bf16_pages, 10)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    before = stats(mnt)
    r = pffs("fork", mnt / "a", mnt / "f")
    assert "10 pages" in r.stdout
    assert sorted(os.listdir(mnt / "f" / "pages")) == [mf.page_name(i) for i in range(10)]
    assert (mnt / "f" / "manifest.json").read_bytes() == (mnt / "a" / "manifest.json").read_bytes()
    assert stats(mnt)["stored_bytes"] == before["stored_bytes"]
    r = pffs("fork", mnt / "a", mnt / "f", check=False)
    assert r.returncode != 0 and "already exists" in r.stderr
    # Change a page: check reports the disagreement, seal fixes the manifest.
    new = varied_pages(bf16_pages, 1, salt=77)[0]
    (mnt / "f" / "pages" / "000004").write_bytes(new)
    r = pffs("seal", mnt / "f")
    assert "1 changed" in r.stdout
    m = mf.parse((mnt / "f" / "manifest.json").read_bytes())
    assert m.pages[4] == digest(new) and m.pages[3] == digest(pages[3])
    # A wrong-sized page is refused by seal, naming it.
    (mnt / "f" / "pages" / "000002").write_bytes(b"short")
    r = pffs("seal", mnt / "f", check=False)
    assert r.returncode != 0 and "000002" in r.stderr


def whole_lists(mnt) -> list[tuple[str, int, int]]:
    c = sqlite3.connect(f"file:{mnt.store / 'namespace.db'}?mode=ro", uri=True)
    try:
        return c.execute("SELECT manifest, files, bytes FROM whole_lists").fetchall()
    finally:
        c.close()


def test_the_fork_xattr_gives_a_folder_the_manifest_it_names(mnt, bf16_pages, tmp_path):
    """What `pffs fork` asks of the daemon: setxattr(DST, user.pffs.fork, path of SRC's
    manifest.json from the mount's root) makes DST/manifest.json hold that blob, and the
    pages appear, with no byte of the manifest written; every refusal leaves DST as it was."""
    pages = varied_pages(bf16_pages, 5, salt=41)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    man = (mnt / "a" / "manifest.json").read_bytes()
    before = stats(mnt)
    (mnt / "b" / "pages").mkdir(parents=True)
    os.setxattr(mnt / "b", "user.pffs.fork", b"a/manifest.json")
    assert (mnt / "b" / "manifest.json").read_bytes() == man
    assert os.getxattr(mnt / "b" / "manifest.json", "user.pffs.digest") == digest(man).encode()
    assert os.stat(mnt / "b" / "manifest.json").st_ino != os.stat(mnt / "a" / "manifest.json").st_ino
    assert os.getxattr(mnt / "b" / "pages", "user.pffs.entries") == b"5"
    assert [(mnt / "b" / "pages" / mf.page_name(i)).read_bytes() for i in range(5)] == pages
    now = stats(mnt)
    assert now["sessions"] == before["sessions"] + 1
    assert now["stored_bytes"] == before["stored_bytes"]
    assert now["logical_bytes"] == before["logical_bytes"] + len(man) + sum(map(len, pages))
    # Write-only and unlisted.
    with pytest.raises(OSError) as e:
        os.getxattr(mnt / "b", "user.pffs.fork")
    assert e.value.errno == errno.ENODATA
    assert "user.pffs.fork" not in os.listxattr(mnt / "b")
    # Refusals.
    (mnt / "c" / "pages").mkdir(parents=True)
    (mnt / "notes").write_bytes(b"{}")
    for value, err in ((b"a/manifest.json", errno.EEXIST),   # (into b, which has one)
                       ):
        with pytest.raises(OSError) as e:
            os.setxattr(mnt / "b", "user.pffs.fork", value)
        assert e.value.errno == err
    for value, err in ((b"a/pages/000001", errno.EINVAL), (b"notes", errno.EINVAL),
                       (b"a/../a/manifest.json", errno.EINVAL), (b".pffs/version", errno.EINVAL),
                       (b"nothing/manifest.json", errno.ENOENT), (b"notes/manifest.json", errno.ENOTDIR),
                       (b"a", errno.EINVAL)):
        with pytest.raises(OSError) as e:
            os.setxattr(mnt / "c", "user.pffs.fork", value)
        assert e.value.errno == err, value
    assert os.listdir(mnt / "c") == ["pages"] and os.listdir(mnt / "c" / "pages") == []


def test_the_fork_xattr_checks_permissions_as_the_kernel_would(mount_factory, bf16_pages, tmp_path):
    """nobody may fork, into a folder of its own, a manifest it may read, and no other:
    search permission on each folder on the way, read permission on the file."""
    top = mount_factory.open_root("pffs-fork-perm-")   # other users must reach the mount
    mnt = mount_factory(root=top / "m", store=tmp_path / "store", opts=["allow_other"])
    os.chmod(top / "m", 0o755)
    os.chmod(mnt.path, 0o755)
    pages = varied_pages(bf16_pages, 3, salt=42)
    write_session(tmp_path / "a", pages)
    (mnt / "t").mkdir()
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "t" / "a")], check=True)
    for f in ("n1", "n2", "n3"):
        (mnt / f / "pages").mkdir(parents=True)
        os.chown(mnt / f, 65534, 65534)

    def as_nobody(folder: str) -> subprocess.CompletedProcess:
        code = f"import os; os.setxattr({str(mnt / folder)!r}, 'user.pffs.fork', b't/a/manifest.json')"
        return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "/usr/bin/python3", "-c", code], cwd="/", capture_output=True, text=True,
                              timeout=60)
    r = as_nobody("n1")
    assert r.returncode == 0, r.stderr
    st = os.stat(mnt / "n1" / "manifest.json")
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert [os.stat(mnt / "n1" / "pages" / mf.page_name(i)).st_uid for i in range(3)] == [65534] * 3
    os.chmod(mnt / "t" / "a" / "manifest.json", 0o600)
    r = as_nobody("n2")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    os.chmod(mnt / "t" / "a" / "manifest.json", 0o644)
    os.chmod(mnt / "t", 0o700)
    r = as_nobody("n3")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    for f in ("n2", "n3"):
        assert os.listdir(mnt / f) == ["pages"] and os.listdir(mnt / f / "pages") == []


def test_a_page_list_found_whole_is_remembered_until_it_goes(mnt, bf16_pages, tmp_path):
    """The first fold of a manifest's bytes counts their stored pages; later forks of those
    bytes take the count from whole_lists, which goes with the page list."""
    pages = varied_pages(bf16_pages, 6, salt=43)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    d = digest((mnt / "a" / "manifest.json").read_bytes())
    assert whole_lists(mnt) == []
    pffs("fork", mnt / "a", mnt / "b")
    assert whole_lists(mnt) == [(d, 6, sum(map(len, pages)))]
    assert len(os.listdir(mnt / "b" / "pages")) == 6        # unfolded: the row stays
    for f in "cd":
        assert "6 pages" in pffs("fork", mnt / "b", mnt / f).stdout
    assert [(mnt / "d" / "pages" / mf.page_name(i)).read_bytes() for i in range(6)] == pages
    # An incomplete session's list is not whole.
    m = make_manifest(pages[:2] + varied_pages(bf16_pages, 1, salt=44))
    (mnt / "e" / "pages").mkdir(parents=True)
    (mnt / "e" / "manifest.json").write_bytes(m.to_json())
    assert len(os.listdir(mnt / "e" / "pages")) == 2
    assert len(whole_lists(mnt)) == 1
    subprocess.run(["rm", "-r", *(str(mnt / f) for f in "abcd")], check=True)
    # The page files' inodes, and with the last of them the page list, go at
    # the kernel's FORGET, which it sends when it will (later on a busy host).
    wait_for(lambda: whole_lists(mnt) == [], what="the whole list to go with its page list")


def test_pffs_fork_of_a_refused_manifest_says_why(mnt):
    # Only a file that takes the name is validated: a symlink named
    # manifest.json may point at anything, and the fork's copy is refused.
    mnt.allow("refused manifest")
    (mnt / "x").mkdir()
    (mnt / "x" / "notes.txt").write_text("not json\n")
    os.symlink("notes.txt", mnt / "x" / "manifest.json")
    r = pffs("fork", mnt / "x", mnt / "y", check=False)
    assert r.returncode == 1
    assert f"{mnt / 'x' / 'manifest.json'}: manifest: not valid JSON" in r.stderr
    assert not (mnt / "y").exists()


def test_unmount_remount_keeps_everything(mount_factory, bf16_pages, tmp_path):
    from sessions import tree_digest
    m = mount_factory()
    write_session(tmp_path / "a", varied_pages(bf16_pages, 6))
    subprocess.run(["cp", "-a", str(tmp_path / "a"), str(m / "a")], check=True)
    os.setxattr(m / "a" / "manifest.json", "user.k", b"v")
    os.symlink("a", m / "link")
    want = tree_digest(m.path)
    times = os.stat(m / "a" / "pages" / "000001").st_mtime_ns
    assert m.stop() == 0
    m.start()
    assert tree_digest(m.path) == want
    assert os.getxattr(m / "a" / "manifest.json", "user.k") == b"v"
    assert os.stat(m / "a" / "pages" / "000001").st_mtime_ns == times
    assert stats(m)["sessions"] == 1


def test_kill9_keeps_closed_files(mount_factory, bf16_pages):
    m = mount_factory()
    pages = varied_pages(bf16_pages, 20)
    for i, p in enumerate(pages):
        (m / f"p{i}").write_bytes(p)
    fd = os.open(m / "open-unflushed", os.O_CREAT | os.O_WRONLY)
    os.write(fd, b"never closed")
    m.kill9()
    try:
        os.close(fd)  # the connection is gone; the close may report it
    except OSError:
        pass
    m.start()
    for i, p in enumerate(pages):
        assert (m / f"p{i}").read_bytes() == p
    r = m.check_store()
    # The store is in use by the new mount: check refuses it with one clear line.
    assert r.returncode != 0 and "in use" in r.stderr


def test_kill9_keeps_a_fork_nothing_looked_into(mount_factory, bf16_pages, tmp_path):
    """A fork whose manifest's close returned is there after kill -9, folded until listed."""
    m = mount_factory()
    pages = varied_pages(bf16_pages, 5, salt=32)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(m / "a")], check=True)
    pffs("fork", m / "a", m / "b")
    m.kill9()
    m.start()
    assert folds(m) == 1
    assert os.getxattr(m / "b" / "pages", "user.pffs.entries") == b"5"
    assert [(m / "b" / "pages" / mf.page_name(i)).read_bytes() for i in range(5)] == pages
    assert sorted(os.listdir(m / "b" / "pages")) == [mf.page_name(i) for i in range(5)]
    assert folds(m) == 0


def test_truncate_by_path_while_open_for_reading_is_committed(mount_factory):
    m = mount_factory()
    (m / "t").write_bytes(b"x" * 1000)
    reader = open(m / "t", "rb")
    os.truncate(m / "t", 10)
    m.kill9()
    try:
        reader.close()
    except OSError:
        pass
    m.start()
    assert (m / "t").read_bytes() == b"x" * 10


def test_page_files_read_back_after_every_kind_of_change(mnt, bf16_pages):
    """A sequential reader's view of a pages/ folder (read ahead in bulk) never
    outlives a change: rewritten, replaced, removed and recreated pages read
    back as they are now."""
    pages = varied_pages(bf16_pages, 12)
    write_session(mnt / "s", pages)
    pdir = mnt / "s" / "pages"

    def read_all():
        return {n: (pdir / n).read_bytes() for n in sorted(os.listdir(pdir))}
    assert list(read_all().values()) == pages
    new = varied_pages(bf16_pages, 3, salt=7)
    (pdir / mf.page_name(3)).write_bytes(new[0])                 # rewritten in place
    os.replace(pdir / mf.page_name(6), pdir / mf.page_name(5))   # replaced by a rename
    os.unlink(pdir / mf.page_name(8))                            # removed, then recreated
    (pdir / mf.page_name(8)).write_bytes(new[1])
    (pdir / mf.page_name(12)).write_bytes(new[2])                # appended
    want = {mf.page_name(i): p for i, p in enumerate(pages)}
    want[mf.page_name(3)], want[mf.page_name(5)] = new[0], pages[6]
    del want[mf.page_name(6)]
    want[mf.page_name(8)], want[mf.page_name(12)] = new[1], new[2]
    # Through fresh opens (the kernel's cache of a changed file is dropped on change).
    assert read_all() == want
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    assert read_all() == want


def test_sequential_readers_find_pages_prefetched(mount_factory, bf16_pages):
    """Pages created out of order are prefetched for a reader that follows
    the listing (cp -r, tar) and for one that follows page order (page-in, glob)."""
    import random
    m = mount_factory()
    n = 40
    pages = varied_pages(bf16_pages, n)
    order = list(range(n))
    random.Random(7).shuffle(order)
    (m / "s" / "pages").mkdir(parents=True)
    for i in order:
        (m / "s" / "pages" / mf.page_name(i)).write_bytes(pages[i])
    (m / "s" / "manifest.json").write_bytes(make_manifest(pages).to_json())

    def remount_and_read(names, listed=True):
        assert m.stop() == 0
        m.start()
        if listed:
            assert sorted(os.listdir(m / "s" / "pages")) == [mf.page_name(i) for i in range(n)]
        for name in names:
            assert (m / "s" / "pages" / name).read_bytes() == pages[mf.parse_page_name(name)]
        return stats(m)["cache"]["fetched_by_reads"]

    # Listing order is creation order here, not page order.
    listing = os.listdir(m / "s" / "pages")
    assert [mf.parse_page_name(x) for x in listing] == order
    by_page = [mf.page_name(i) for i in range(n)]
    # Only the first file a reader opens is fetched by its read; a reader in
    # page order after a listing also fetches its second (the listing's guess).
    assert remount_and_read(listing) == 1
    assert remount_and_read(by_page, listed=False) == 1
    assert remount_and_read(by_page) <= 2
    assert m.stop() == 0
    m.start()
    out = subprocess.run(["tar", "cf", "-", "-C", str(m / "s"), "."], check=True,
                         capture_output=True).stdout
    assert len(out) > n * len(pages[0])
    assert stats(m)["cache"]["fetched_by_reads"] <= 2


def test_large_blobs_are_prefetched_one_a_job_and_small_ones_several_a_job(mount_factory, bf16_pages):
    """A reader waiting for a large blob (a 2 MiB page) does not wait for the
    blobs fetched with it: each is its own job; small ones share jobs."""
    m = mount_factory()
    small = varied_pages(bf16_pages, 96)
    large = [b"".join(small[i:i + 4]) for i in range(0, 96, 4)]
    assert len(large[0]) >= 512 << 10 > len(small[0])
    for name, pages in (("l", large), ("s", small[:24])):
        (m / name / "pages").mkdir(parents=True)
        for i, p in enumerate(pages):
            (m / name / "pages" / mf.page_name(i)).write_bytes(p)
    assert m.stop() == 0
    m.start()
    for name, pages in (("l", large), ("s", small[:24])):
        before = stats(m)["cache"]
        for i, p in enumerate(pages):
            assert (m / name / "pages" / mf.page_name(i)).read_bytes() == p
        after = stats(m)["cache"]
        blobs = after["prefetched"] - before["prefetched"]
        jobs = after["prefetch_jobs"] - before["prefetch_jobs"]
        assert blobs >= 20, (name, blobs)
        if name == "l":
            assert jobs == blobs
        else:
            assert jobs <= blobs // 2, (blobs, jobs)


def test_files_changed_after_prefetch_read_back_changed(mount_factory, bf16_pages, tmp_path):
    """Prefetching keeps what it read of a directory across later commits;
    reads of files changed since still return their new bytes."""
    m = mount_factory()
    n = 12
    pages = varied_pages(bf16_pages, 2 * n)
    old, new = pages[:n], pages[n:]
    write_session(tmp_path / "a", old)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(m / "s")], check=True)
    (tmp_path / "new").write_bytes(new[5])
    for listed in (True, False):
        assert m.stop() == 0
        m.start()
        d = m / "s" / "pages"
        if listed:
            os.listdir(d)
        # The first open reads the content of the next files for prefetching.
        assert (d / mf.page_name(0)).read_bytes() == old[0]
        (d / mf.page_name(3)).write_bytes(new[3])           # rewritten in place
        with open(d / mf.page_name(4), "r+b") as f:          # changed in part
            f.seek(100)
            f.write(new[4][100:200])
        want4 = old[4][:100] + new[4][100:200] + old[4][200:]
        subprocess.run(["cp", str(tmp_path / "new"), str(m / "s" / "tmp")], check=True)
        os.rename(m / "s" / "tmp", d / mf.page_name(5))    # replaced by another file
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        want = [old[0], old[1], old[2], new[3], want4, new[5], *old[6:]]
        assert [(d / mf.page_name(i)).read_bytes() == want[i] for i in range(n)] == [True] * n
        # Back as they were, for the second round.
        for i in (3, 4, 5):
            (d / mf.page_name(i)).write_bytes(old[i])


def test_forks_record_the_same_gc_roots(mount_factory, bf16_pages, tmp_path):
    """A fork's manifest (bytes of one already accepted) shares its source's
    page list, which stays while any of them, or any page file a fork made
    from it, is left, and goes with the last."""
    from pffs import namespace as ns
    m = mount_factory()
    pages = varied_pages(bf16_pages, 9)
    write_session(tmp_path / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(m / "a")], check=True)
    for src, dst in (("a", "b"), ("b", "c")):
        (m / dst / "pages").mkdir(parents=True)
        subprocess.run(["cp", str(m / src / "manifest.json"), str(m / dst)], check=True)
        if src == "a":
            subprocess.run(["rm", "-r", str(m / "a")], check=True)
    for d in ("b", "c"):
        assert sorted(os.listdir(m / d / "pages")) == [mf.page_name(i) for i in range(9)]
        assert (m / d / "pages" / mf.page_name(8)).read_bytes() == pages[8]
    assert stats(m)["sessions"] == 2

    def recorded():
        conn = ns.open_db(m.store, create_missing=False, readonly=True)
        try:
            return (conn.execute("SELECT n_pages, digest FROM manifests").fetchall(),
                    conn.execute("SELECT manifest, page_ix, digest FROM manifest_pages"
                                 " ORDER BY manifest, page_ix").fetchall())
        finally:
            conn.close()
    assert m.stop() == 0
    rows, listed = recorded()
    assert len(rows) == 2 and rows[0] == rows[1] and rows[0][0] == 9
    man = rows[0][1]
    assert listed == [(man, i, digest(p)) for i, p in enumerate(pages)]  # one list, not two
    m.start()
    subprocess.run(["rm", "-r", str(m / "b")], check=True)
    assert m.stop() == 0
    assert recorded() == ([(9, man)], listed)
    m.start()
    (m / "c" / "manifest.json").write_bytes(make_manifest(pages[:3]).to_json())  # c's bytes change
    assert m.stop() == 0
    rows, listed2 = recorded()
    assert len(rows) == 1 and rows[0][0] == 3 and rows[0][1] != man
    new = [(rows[0][1], i, digest(p)) for i, p in enumerate(pages[:3])]
    # The first list stays while page files its fork made are left (c's pages/).
    assert listed2 == sorted(listed + new)
    m.start()
    for i in range(8):
        os.unlink(m / "c" / "pages" / mf.page_name(i))
    assert m.stop() == 0
    assert recorded()[1] == sorted(listed + new)
    m.start()
    os.unlink(m / "c" / "pages" / mf.page_name(8))
    assert m.stop() == 0
    assert recorded()[1] == new
