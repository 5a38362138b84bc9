"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
What an operator and their tools expect of a mount: the options mount(8),
fstab and habit give, ``mount -t fuse.pffs`` and an fstab line (through
mount.fuse3), a read-only mount that changes nothing in its store, and
fallocate(2)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import manifests as ex
from mountutil import is_mounted, pffs
from pffs import manifest as mf
from pffs.store.storedir import StoreDir
from sessions import varied_pages, write_session


def mount_options(path: Path) -> tuple[str, set[str]]:
    """(file system type, options) of the mount on *path*, as /proc/self/mounts has them."""
    with open("/proc/self/mounts") as f:
        for line in f:
            _src, mp, fstype, opts = line.split()[:4]
            if mp == str(path):
                return fstype, set(opts.split(","))
    raise AssertionError(f"{path} is not mounted")


def stored(path: Path) -> int:
    """stored_bytes as `pffs stats` tells it of the mount on *path*."""
    return json.loads(pffs("stats", "--json", path).stdout)["stored_bytes"]


# -- options --------------------------------------------------------------------


def test_the_options_mount8_and_habit_give_are_taken(mount_factory):
    """`-o allow_other,default_permissions` (sshfs habit) and what mount(8),
    fstab and systemd pass mount as they say: the kernel's flags reach the
    kernel's mount, the others change nothing.  An unknown option is still
    one line and no mount."""
    m = mount_factory(opts=["allow_other,default_permissions,noatime,nodev,nosuid,noexec,relatime",
                            "rw,async,defaults,nofail,_netdev,auto,user,x-systemd.automount,comment=x"])
    fstype, opts = mount_options(m.path)
    assert fstype == "fuse.pffs"
    assert {"rw", "allow_other", "default_permissions", "noatime", "nodev", "nosuid", "noexec"} <= opts
    (m / "f").write_bytes(b"written")
    assert (m / "f").read_bytes() == b"written"
    other = m.path.parent / "other"
    other.mkdir()
    r = pffs("mount", "--store", m.store.parent / "store2", "-o", "default_permissions,bogus", other,
             check=False)
    assert r.returncode == 1 and r.stderr.strip() == "pffs mount: unknown mount option 'bogus'", r.stderr
    assert not is_mounted(other)


# -- mount -t fuse.pffs, fstab --------------------------------------------------


def ended(pid: int) -> bool:
    """Whether process *pid* has exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# mount(8) drops PATH (and HOME) from the environment of the helpers it runs,
# and mount.fuse3 runs `pffs` through /bin/sh, whose own PATH then holds
# /usr/local/bin: this runs in a mount namespace of its own, where a folder
# holding a `pffs` (the one beside this Python) is bound over /usr/local/bin,
# and says what happened as JSON.  The FUSE mount is made in that namespace
# and used and unmounted there; leaving it detaches whatever is left.
IN_NAMESPACE = r"""
import hashlib, json, os, re, subprocess, sys, time
bindir, store, mnt, data, cmd = sys.argv[1:5] + [json.loads(sys.argv[5])]
subprocess.run(["mount", "--bind", bindir, "/usr/local/bin"], check=True)

def ended(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True

def until(cond):
    end = time.monotonic() + 30
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()

out = {}
r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
out["mount"] = [r.returncode, r.stderr]
with open("/proc/self/mounts") as f:
    out["mounted"] = [line.split()[2:4] for line in f if line.split()[1] == mnt]
if r.returncode == 0:
    out["holder"] = open(os.path.join(store, "lock")).read().strip()
    pid = int(re.search(r" pid (\d+)$", out["holder"]).group(1))
    out["alive"] = not ended(pid)
    os.mkdir(os.path.join(mnt, "d"))
    subprocess.run(["cp", data, os.path.join(mnt, "d", "f")], check=True)
    out["sha256sum"] = subprocess.run(["sha256sum", os.path.join(mnt, "d", "f")], capture_output=True,
                                      text=True, check=True).stdout.split()[0]
    r = subprocess.run(["umount", mnt], capture_output=True, text=True, timeout=60)
    out["umount"] = [r.returncode, r.stderr]
    with open("/proc/self/mounts") as f:
        out["after"] = [line.split()[2] for line in f if line.split()[1] == mnt]
    out["ended"] = until(lambda: ended(pid))
print(json.dumps(out))
"""


def mounted_by_mount8(mount_factory, tmp_path, how: str) -> None:
    """Mount a store by mount(8) (*how*: "type" or "fstab"), copy a file in and
    sha256sum it, umount(8) it: the daemon ends, and a remount has the bytes."""
    store, mnt, bindir = tmp_path / "store", tmp_path / "mnt", tmp_path / "bin"
    mnt.mkdir()
    bindir.mkdir()
    pffs_bin = Path(sys.executable).parent / "pffs"
    assert pffs_bin.exists(), f"{pffs_bin}: pffs is not installed beside this Python"
    (bindir / "pffs").symlink_to(pffs_bin)
    data = tmp_path / "data"
    data.write_bytes(os.urandom(3 << 20))
    if how == "type":
        cmd = ["mount", "-t", "fuse.pffs", str(store), str(mnt), "-o", "allow_other,default_permissions,noatime"]
    else:
        fstab = tmp_path / "fstab"
        fstab.write_text(f"# pffs\n{store} {mnt} fuse.pffs "
                         "nodev,nosuid,noatime,allow_other,default_permissions,nofail,_netdev 0 0\n")
        cmd = ["mount", "--fstab", str(fstab), str(mnt)]
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", IN_NAMESPACE,
                        str(bindir), str(store), str(mnt), str(data), json.dumps(cmd)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mount"] == [0, ""], out
    # mount(8) returned with the store mounted, its daemon detached.
    [[fstype, opts]] = out["mounted"]
    assert fstype == "fuse.pffs" and {"allow_other", "noatime"} <= set(opts.split(",")), out
    if how == "fstab":
        assert {"nodev", "nosuid"} <= set(opts.split(","))
    assert out["holder"].startswith(f"pffs mount {mnt} pid ") and out["alive"]
    assert out["sha256sum"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert out["umount"] == [0, ""] and out["after"] == [] and out["ended"], out
    assert StoreDir(store).in_use() is None
    log = (store / "pffs.log").read_text()
    assert f"unmounted {mnt}" in log
    assert [line for line in log.splitlines()
            if "Traceback" in line or re.search(r" (WARNING|ERROR|CRITICAL) ", line)] == []
    again = mount_factory("again", store=store)
    assert (again / "d" / "f").read_bytes() == data.read_bytes()


def test_mount_t_fuse_pffs_mounts_and_umount_ends_the_daemon(mount_factory, tmp_path):
    """`mount -t fuse.pffs STORE MNT -o ...`: mount.fuse3 runs `pffs STORE MNT -o ...`,
    which returns once the mount answers; `umount MNT` ends the daemon cleanly."""
    mounted_by_mount8(mount_factory, tmp_path, "type")


def test_an_fstab_line_mounts(mount_factory, tmp_path):
    """An fstab line (here a file of its own, `mount --fstab FILE MNT`) with the
    options boot-time mounts use: nofail and _netdev are mount(8)'s."""
    mounted_by_mount8(mount_factory, tmp_path, "fstab")


def test_the_mount_helper_form_refuses_as_pffs_mount_does(tmp_path):
    """`pffs STORE MNT -o OPTS` says what is wrong in one line, as `pffs mount` would;
    a mistyped command is not taken for it."""
    (tmp_path / "mnt").mkdir()
    r = pffs(tmp_path / "store", tmp_path / "mnt", "-o", "rw,bogus", check=False)
    assert r.returncode == 1 and r.stderr.strip() == "pffs mount: unknown mount option 'bogus'", r.stderr
    r = pffs(tmp_path / "store", tmp_path / "nope", "-o", "rw", check=False)
    assert r.returncode == 1 and "mount point does not exist" in r.stderr, r.stderr
    r = pffs("mout", tmp_path / "mnt", "-o", "rw", check=False)
    assert r.returncode == 2 and "invalid choice: 'mout'" in r.stderr, r.stderr
    assert not is_mounted(tmp_path / "mnt")


# -- read-only ------------------------------------------------------------------


def store_state(store: Path) -> dict[str, tuple]:
    """Every file of *store* that holds its namespace or blobs, and what else a
    mount might leave: path → (size, mtime_ns, sha256 of small files)."""
    out: dict[str, tuple] = {}
    for dirpath, _dirs, files in os.walk(store):
        for name in files:
            p = Path(dirpath, name)
            rel = str(p.relative_to(store))
            if rel in ("pffs.log", "lock", "gc.lock", "gc.intent"):
                continue       # (what a read-only daemon may write: docs/operations.md)
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                continue       # (engine.sock, left by a killed daemon)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size < 64 << 20 else ""
            out[rel] = (st.st_size, st.st_mtime_ns, digest)
    return out


def folds(store: Path) -> int:
    """Folded forks in *store*'s namespace, read without changing a byte of it."""
    import sqlite3
    c = sqlite3.connect(f"file:{store / 'namespace.db'}?immutable=1", uri=True)
    try:
        return c.execute("SELECT COUNT(*) FROM folds").fetchone()[0]
    finally:
        c.close()


def refused(fn) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno or 0
    return 0


def test_a_read_only_mount_reads_and_changes_nothing(mount_factory, bf16_pages, tmp_path):
    """-o ro: reads (sha256sum as the manifest says, also of a folded fork,
    which the daemon unfolds in its own copy of the namespace), and every
    change refused with EROFS, by Python's calls and by the tools; the
    store's namespace and blobs are byte for byte as they were, the fork
    still folded, and a read-write mount afterwards finds everything."""
    rw = mount_factory("rw")
    pages = varied_pages(bf16_pages, 5, salt=77)
    man = write_session(tmp_path / "src" / "a", pages)
    subprocess.run(["cp", "-r", str(tmp_path / "src" / "a"), str(rw / "a")], check=True)
    pffs("fork", rw / "a", rw / "b")
    (rw / "notes").write_bytes(b"kept as written\n")
    os.setxattr(rw / "notes", "user.tag", b"v1")
    assert rw.stop() == 0
    store = rw.store
    assert folds(store) == 1
    before = store_state(store)
    assert "namespace.db" in before and any(k.startswith("blobs/") for k in before)

    ro = mount_factory("ro", store=store, opts=["ro"])
    pid = ro.proc.pid
    copies = lambda: list(Path(tempfile.gettempdir()).glob(f"pffs-ro-{pid}-*"))  # noqa: E731
    assert len(copies()) == 1        # the daemon's own copy of the namespace
    _, opts = mount_options(ro.path)
    assert "ro" in opts
    # Reads, the folded fork's pages too.
    for s in ("a", "b"):
        names = [mf.page_name(i) for i in range(len(pages))]
        assert sorted(os.listdir(ro / s / "pages")) == names
        out = subprocess.run(["sha256sum", *names], cwd=ro / s / "pages", capture_output=True, text=True,
                             check=True).stdout.split()
        assert ["sha256:" + h for h in out[0::2]] == man.pages
    assert (ro / "notes").read_bytes() == b"kept as written\n"
    assert os.getxattr(ro / "notes", "user.tag") == b"v1"
    assert json.loads((ro / ".pffs" / "stats.json").read_text())["sessions"] == 2

    # Every change, by Python's calls: EROFS.
    f, d = ro / "notes", ro / "a"
    changes = {
        "create": lambda: os.open(ro / "new", os.O_CREAT | os.O_WRONLY, 0o644),
        "open for writing": lambda: os.open(f, os.O_WRONLY),
        "open O_TRUNC": lambda: os.open(f, os.O_RDONLY | os.O_TRUNC),
        "truncate": lambda: os.truncate(f, 0),
        "unlink": lambda: os.unlink(f),
        "mkdir": lambda: os.mkdir(ro / "newdir"),
        "rmdir": lambda: os.rmdir(ro / "b" / "pages"),
        "rename": lambda: os.rename(f, ro / "renamed"),
        "rename onto manifest.json": lambda: os.rename(f, d / "manifest.json"),
        "link": lambda: os.link(f, ro / "linked"),
        "symlink": lambda: os.symlink("notes", ro / "sym"),
        "mknod": lambda: os.mkfifo(ro / "fifo"),
        "chmod": lambda: os.chmod(f, 0o600),
        "chown": lambda: os.chown(f, 1, 1),
        "utime": lambda: os.utime(f, ns=(1, 1)),
        "setxattr": lambda: os.setxattr(f, "user.tag", b"v2"),
        "removexattr": lambda: os.removexattr(f, "user.tag"),
    }
    got = {what: refused(fn) for what, fn in changes.items()}
    assert got == {what: errno.EROFS for what in changes}
    # ... and by the tools.
    (tmp_path / "local").write_bytes(b"x")
    tools = [["touch", str(f)], ["touch", str(ro / "new")], ["rm", str(f)], ["rm", "-r", str(d)],
             ["mkdir", str(ro / "newdir")], ["cp", str(tmp_path / "local"), str(ro / "copied")],
             ["cp", "-r", str(d), str(ro / "c")],
             ["setfattr", "-n", "user.tag", "-v", "v3", str(f)], ["fallocate", "-l", "1M", str(f)],
             [sys.executable, "-m", "pffs.cli", "fork", str(d), str(ro / "c")]]
    for cmd in tools:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "Read-only file system" in r.stderr, (cmd, r.returncode, r.stderr)
    assert (ro / "notes").read_bytes() == b"kept as written\n"

    assert ro.stop() == 0
    assert copies() == []
    after = store_state(store)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                             if before.get(k) != after.get(k)}
    assert folds(store) == 1
    # The store takes changes again once mounted read-write.
    rw2 = mount_factory("rw2", store=store)
    assert sorted(os.listdir(rw2 / "b" / "pages")) == [mf.page_name(i) for i in range(len(pages))]
    (rw2 / "notes").write_bytes(b"changed\n")


def test_a_read_only_mount_after_a_crash_reads_the_commits_still_in_the_wal(mount_factory):
    """kill -9 of a read-write daemon leaves its last commits in namespace.db's
    WAL: a read-only mount reads them (its copy is made through SQLite), and
    leaves the database and its WAL as they were for the next read-write
    mount to take in."""
    rw = mount_factory("rw")
    (rw / "f").write_bytes(b"closed before the crash\n")
    rw.kill9()
    wal = rw.store / "namespace.db-wal"
    assert wal.stat().st_size > 0
    keep = ("namespace.db", "namespace.db-wal")
    before = {k: v for k, v in store_state(rw.store).items() if k in keep}
    ro = mount_factory("ro", store=rw.store, opts=["ro"])
    assert (ro / "f").read_bytes() == b"closed before the crash\n"
    assert ro.stop() == 0
    # (-shm, the WAL's index, may be rebuilt: it holds nothing of the namespace.)
    assert {k: v for k, v in store_state(rw.store).items() if k in keep} == before
    again = mount_factory("again", store=rw.store)
    assert (again / "f").read_bytes() == b"closed before the crash\n"


class _LiveEngine:
    """An engine adapter (engine_bridge.attach.engine_adapter) running one request."""

    def __init__(self, n_blocks: int):
        import torch
        from engine_bridge import Bridge, KVPool, RefCountingAllocator, SeqBlocks
        from engine_bridge.attach.engine_adapter import StepLock
        pool = KVPool.allocate(num_blocks=n_blocks, dtype=torch.float32, block_size=16, n_layers=2, n_heads=2,
                               head_dim=8)
        gen = torch.Generator().manual_seed(5)
        for layer in pool.layers:
            layer.copy_(torch.randn(layer.shape, generator=gen))
        self.bridge = Bridge(pool, RefCountingAllocator(n_blocks), engine_name="t")
        self.lock = StepLock()
        blocks = self.bridge.allocator.allocate(n_blocks)
        self.seq = SeqBlocks("req-1", blocks, n_blocks * 16 - 3, list(range(n_blocks * 16 - 3)))
        self.loaded: list = []

    def sequences(self):
        return [self.seq]

    def pin(self, blocks):
        self.bridge.allocator.incref(blocks)

    def unpin(self, blocks):
        self.bridge.allocator.free(blocks)

    def page_in(self, source):
        self.loaded.append(source)
        return []


def test_a_read_only_mount_serves_a_live_engine_and_takes_nothing_from_it(mount_factory, bf16_pages, tmp_path):
    """An engine attaches to a read-only mount: its live request reads as a
    session (sha256sum as its manifest.json says); copying a session into
    engines/, pffs fork into or out of it, and copying a live one out all
    fail with EROFS, the engine loads nothing, and the store is as it was."""
    from engine_bridge.attach.agent import Agent
    rw = mount_factory("rw")
    write_session(tmp_path / "src" / "a", varied_pages(bf16_pages, 3, salt=78))
    subprocess.run(["cp", "-r", str(tmp_path / "src" / "a"), str(rw / "a")], check=True)
    assert rw.stop() == 0
    before = store_state(rw.store)
    ro = mount_factory("ro", store=rw.store, opts=["ro"])
    engine = _LiveEngine(4)
    with Agent(engine, ro.path, "e"):
        live = ro / "engines" / "e" / "req-1"
        listed = mf.parse((live / "manifest.json").read_bytes()).pages
        names = sorted(os.listdir(live / "pages"))
        out = subprocess.run(["sha256sum", *names], cwd=live / "pages", capture_output=True, text=True,
                             check=True).stdout.split()
        assert len(names) == 4 and ["sha256:" + h for h in out[0::2]] == listed
        cli = [sys.executable, "-m", "pffs.cli"]
        for cmd in (["cp", "-r", str(ro / "a"), str(ro / "engines" / "e" / "a")],
                    [*cli, "fork", str(ro / "a"), str(ro / "engines" / "e")],
                    [*cli, "fork", str(live), str(ro / "snap")],
                    ["cp", "-r", str(live), str(ro / "snap")]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert r.returncode != 0 and "Read-only file system" in r.stderr, (cmd, r.returncode, r.stderr)
        assert engine.loaded == []
        assert not (ro / "snap").exists() and os.listdir(ro / "engines" / "e") == ["req-1"]
    assert ro.stop() == 0
    assert store_state(rw.store) == before


def test_a_read_only_mount_of_no_store_is_refused(tmp_path):
    """-o ro makes no store: one line, nothing mounted, no namespace made."""
    (tmp_path / "mnt").mkdir()
    r = pffs("mount", "--store", tmp_path / "empty", "-o", "ro", tmp_path / "mnt", check=False)
    assert r.returncode == 1 and "no pffs store here (a read-only mount needs one)" in r.stderr, r.stderr
    assert not is_mounted(tmp_path / "mnt")
    assert not (tmp_path / "empty" / "namespace.db").exists()


# -- fallocate --------------------------------------------------------------------

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10


def fallocate(fd: int, mode: int, off: int, length: int) -> int:
    """fallocate(2): 0, or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return 0 if libc.fallocate(fd, mode, off, length) == 0 else ctypes.get_errno()


def needs_patched_pyfuse3() -> None:
    import pyfuse3
    assert getattr(pyfuse3, "PFFS_PATCH", 0) >= 5, \
        "pyfuse3 without third_party/pyfuse3's fallocate (PFFS_PATCH 5): run scripts/setup.sh"


def test_fallocate_grows_a_file_as_a_hole(mnt):
    """`fallocate -l 1G f`: the file is 1 GiB of zeros and the store holds no more
    than a few compressed zeros; within the size it changes nothing, past it
    the bytes before stay; posix_fallocate too; past the largest file, EFBIG."""
    needs_patched_pyfuse3()
    s0 = stored(mnt.path)
    f = mnt / "f"
    subprocess.run(["fallocate", "-l", "1G", str(f)], check=True, capture_output=True, timeout=120)
    assert f.stat().st_size == 1 << 30
    with open(f, "rb") as fh:
        for off in (0, 4095, 1 << 29, (1 << 30) - 4096):
            assert os.pread(fh.fileno(), 4096, off) == bytes(min(4096, (1 << 30) - off))
        assert os.pread(fh.fileno(), 10, 1 << 30) == b""
    assert stored(mnt.path) - s0 < 1 << 20
    # Past the end of written bytes: they stay, the rest reads as zeros.
    g = mnt / "g"
    g.write_bytes(b"abc")
    subprocess.run(["fallocate", "-l", "10000", str(g)], check=True, capture_output=True)
    assert g.read_bytes() == b"abc" + bytes(9997)
    # Within the size: nothing changes.
    mtime = g.stat().st_mtime_ns
    subprocess.run(["fallocate", "-o", "10", "-l", "20", str(g)], check=True, capture_output=True)
    assert g.stat().st_size == 10000 and g.read_bytes() == b"abc" + bytes(9997)
    assert g.stat().st_mtime_ns == mtime
    # glibc's posix_fallocate asks the same, and no longer writes a byte per block.
    with open(mnt / "h", "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, 5 << 20)
    assert (mnt / "h").stat().st_size == 5 << 20
    r = subprocess.run(["fallocate", "-l", "17T", str(mnt / "huge")], capture_output=True, text=True)
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr
    assert (mnt / "huge").stat().st_size == 0


def test_fallocate_modes_pffs_does_not_keep_are_eopnotsupp(mnt):
    """--keep-size, --punch-hole, --zero-range (and fallocate(2) with those modes):
    EOPNOTSUPP, the file as it was; mode 0 still works after them."""
    needs_patched_pyfuse3()
    f = mnt / "f"
    data = os.urandom(200_000)
    f.write_bytes(data)
    for flag in ("--keep-size", "--punch-hole", "--zero-range"):
        r = subprocess.run(["fallocate", flag, "-o", "4096", "-l", "8192", str(f)], capture_output=True,
                           text=True)
        # (util-linux says "Operation not supported", or for --keep-size "keep size mode is unsupported")
        assert r.returncode != 0 and re.search("not supported|unsupported", r.stderr), (flag, r.stderr)
    with open(f, "r+b") as fh:
        for mode in (FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_ZERO_RANGE):
            assert fallocate(fh.fileno(), mode, 0, 4096) == errno.EOPNOTSUPP, mode
        assert fallocate(fh.fileno(), 0, 0, 300_000) == 0
    assert f.read_bytes() == data + bytes(100_000)
    assert "mode 0x1 refused" in mnt.log_text()


def test_fallocate_of_a_manifest_is_checked_at_its_close(mnt):
    """A manifest.json grown by fallocate holds zeros after its JSON: its close
    refuses it (EINVAL) and the manifest stays as it was."""
    needs_patched_pyfuse3()
    mnt.allow("refused manifest")
    s = mnt / "s"
    s.mkdir()
    good = ex.good_bytes()
    (s / "manifest.json").write_bytes(good)
    fd = os.open(s / "manifest.json", os.O_WRONLY)
    try:
        assert fallocate(fd, 0, 0, len(good) + 100) == 0
    finally:
        with pytest.raises(OSError) as e:
            os.close(fd)
    assert e.value.errno == errno.EINVAL
    assert (s / "manifest.json").read_bytes() == good
