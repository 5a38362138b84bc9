"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
The direct data path (engine_bridge.transport.direct): page bytes between the bridge
and a mounted store beside the FUSE loop, the mount carrying names only.

Counted FUSE requests, sessions identical to the mount path's, gc racing a
page-out, kill -9 of the engine mid page-out, a damaged blob, and an engine
of another uid that falls back to the mount."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_bridge import (Bridge, DamagedPage, DirSink, DirSource, DirectSink, DirectSource,
                           KVPool, RefCountingAllocator, SeqBlocks, store_access)
from engine_bridge import as_sink, as_source
from mountutil import by_timing, pffs, requests_made, wait_for
from pffs import codec
from pffs.manifest import page_name
from pffs.store.storedir import StoreDir

REPO = Path(__file__).resolve().parent.parent
GEOM = dict(block_size=16, n_layers=2, n_heads=2, head_dim=8)


def pool_of(n_blocks: int, seed: int = 0, **geom) -> KVPool:
    g = {**GEOM, **geom}
    pool = KVPool.allocate(num_blocks=n_blocks, dtype=torch.float32, **g)
    gen = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return pool


def bridge_of(pool: KVPool) -> Bridge:
    return Bridge(pool, RefCountingAllocator(pool.num_blocks), engine_name="t")


def one_seq(pool: KVPool, n_blocks: int | None = None) -> SeqBlocks:
    n = pool.num_blocks if n_blocks is None else n_blocks
    return SeqBlocks("s", list(range(n)), n * pool.block_size - 3, list(range(n * pool.block_size - 3)))


def counted(mnt, fn) -> tuple[int, dict]:
    """FUSE requests *fn* made: how many, and how many of each kind."""
    made = requests_made(mnt, fn)
    return sum(made.values()), made


# A direct page-out or page-in asks the mount a few requests whatever the
# session's size (docs/engines.md §5); a page-out through the mount asks
# several a page. Counted apart (mountutil.KERNEL_TIMED):
# - the kinds it causes itself, at most FEW in all: a page-out's two mkdirs,
#   manifest.json's create, write, flush and release, three getxattrs and the
#   rename (10 here), a page-in's open, release and getxattr (3);
# - each kind whose number follows the kernel's timing, at most FEW_TIMED:
#   the LOOKUPs and GETATTRs of the names it walks (5 and 4 here: seven paths
#   of one or two names below the root), asked again where their timeouts ran
#   out while a loaded host ran the test slowly, and FORGETs of whatever the
#   kernel trims meanwhile. (The sum was once bounded at 20: a loaded host
#   failed it with 21, two FORGETs and three GETATTRs among them.)
FEW = 20
FEW_TIMED = 32


def assert_few_requests(made: dict[str, int]) -> None:
    ops, timed = by_timing(made)
    assert sum(ops.values()) <= FEW, made
    assert all(n <= FEW_TIMED for n in timed.values()), made


def page_sums(session: Path) -> list[str]:
    names = sorted(os.listdir(session / "pages"))
    r = subprocess.run(["sha256sum", *names], cwd=session / "pages", capture_output=True, text=True,
                       check=True)
    return ["sha256:" + line.split()[0] for line in r.stdout.splitlines()]


def test_page_out_and_in_of_256_pages_take_a_few_fuse_requests(mnt):
    """A direct page-out and page-in of a 256-page session each cost a few
    FUSE requests (the first page-out of the process learning the store
    included; assert_few_requests), where the mount path costs several a
    page; both give the same session byte for byte."""
    pool = pool_of(256)
    br = bridge_of(pool)
    seq = one_seq(pool)
    # (The first page-out of this process: learning the store is counted too.)
    n_out, made_out = counted(mnt, lambda: br.page_out([seq], mnt / "direct"))
    n_mount, _ = counted(mnt, lambda: br.page_out([seq], DirSink(mnt / "mount")))
    print("direct page-out:", n_out, made_out, "| mount path:", n_mount)
    assert_few_requests(made_out)
    assert n_mount > 256 * 3
    # The same session either way: manifest bytes, page digests, file sizes, stats.
    assert (mnt / "direct" / "manifest.json").read_bytes() == (mnt / "mount" / "manifest.json").read_bytes()
    m = json.loads((mnt / "direct" / "manifest.json").read_bytes())
    assert page_sums(mnt / "direct") == page_sums(mnt / "mount") == m["pages"]
    assert sorted(os.listdir(mnt / "direct" / "pages")) == [page_name(i) for i in range(256)]

    results = {}

    def page_in(src):
        res = br.page_in(src)
        results[len(results)] = [torch.cat([layer[:, b] for layer in pool.layers]).clone()
                                 for b in res.blocks]
        br.allocator.free(res.blocks)
    assert isinstance(as_source(mnt / "direct"), DirectSource)
    n_in, made_in = counted(mnt, lambda: page_in(mnt / "direct"))
    n_in_mount, _ = counted(mnt, lambda: page_in(DirSource(mnt / "mount")))
    print("direct page-in:", n_in, made_in, "| mount path:", n_in_mount)
    assert_few_requests(made_in)
    assert n_in_mount > 256 * 3
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def test_a_session_put_beside_the_mount_is_an_ordinary_session(mnt):
    """Stats, forks, check and the page files of a direct page-out are those of any session."""
    pool = pool_of(40, seed=3)
    br = bridge_of(pool)
    before = json.loads((mnt / ".pffs" / "stats.json").read_text())
    m = br.page_out([one_seq(pool)], mnt / "a")
    after = json.loads((mnt / ".pffs" / "stats.json").read_text())
    assert after["sessions"] == before["sessions"] + 1
    assert after["unique_blobs"] == before["unique_blobs"] + len(m.pages) + 1
    assert after["stored_bytes"] > before["stored_bytes"]
    assert page_sums(mnt / "a") == m.pages
    subprocess.run(["cp", "-r", str(mnt / "a"), str(mnt / "b")], check=True)
    pffs("fork", mnt / "a", mnt / "c")
    assert json.loads((mnt / ".pffs" / "stats.json").read_text())["stored_bytes"] == after["stored_bytes"]
    store = json.loads((mnt / ".pffs" / "store.json").read_text())
    assert store["direct"] is True and store["kind"] == "local" and Path(store["root"]) == mnt.store


def test_gc_racing_a_direct_page_out_loses_nothing_thanks_to_the_pins(mnt):
    """Between its puts and the manifest's close the bridge holds no gc lock
    (the daemon's commit must take it): its pins alone keep the pages from a
    gc with no grace period.  Without them the same gc takes the pages."""
    pool = pool_of(12, seed=5)
    br = bridge_of(pool)
    store = StoreDir(mnt.store)
    access = store_access(mnt.path)

    class GcBeforeNaming(DirectSink):
        """Runs a gc at the worst moment: pages put, lock let go, manifest not yet written."""
        unpin = False

        def commit(self):
            self._hold.release()
            if self.unpin:
                self.pins.close()
            r = pffs("gc", "--store", mnt.store, "--grace", "0")
            self.gc_said = r.stdout
            super().commit()

    sink = GcBeforeNaming(mnt / "kept", access)
    m = br.page_out([one_seq(pool)], sink)
    assert "pinned" in sink.gc_said, sink.gc_said
    assert page_sums(mnt / "kept") == m.pages
    res = br.page_in(mnt / "kept")
    br.allocator.free(res.blocks)

    # The same with the pins gone: gc sweeps the unnamed pages.
    pool2 = pool_of(12, seed=6)
    sink = GcBeforeNaming(mnt / "lost", access)
    sink.unpin = True
    with pytest.raises(Exception) as e:
        bridge_of(pool2).page_out([one_seq(pool2)], sink)
    assert "could not be read back" in str(e.value)
    assert not (mnt / "lost").exists()
    assert not list(store.gc_lock.pinned())


def test_the_held_gc_lock_keeps_gc_out_while_pages_are_put(mnt):
    """From the first put until the pages are all put the gc lock is held shared."""
    import fcntl
    access = store_access(mnt.path)
    sink = DirectSink(mnt / "x", access)
    fd = os.open(mnt.store / "gc.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        sink.abort()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert not (mnt / "x").exists() and not [p for p in os.listdir(mnt.path) if p.startswith(".x.tmp")]


_KILLED_ENGINE = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from t3_direct import pool_of, bridge_of, one_seq
from engine_bridge import DirectSink, store_access

class Stalls(DirectSink):
    def write_page(self, ix, data):
        d = super().write_page(ix, data)
        if ix == 5:
            print("halfway", flush=True)
            sys.stdin.read()   # until killed
        return d

pool = pool_of(64, seed=9, n_layers=8)
bridge_of(pool).page_out([one_seq(pool)], Stalls(sys.argv[1] + "/snap", store_access(sys.argv[1])))
"""


def test_kill_9_of_the_engine_mid_page_out_leaves_no_session_and_a_clean_store(mnt):
    p = subprocess.Popen([sys.executable, "-c", _KILLED_ENGINE, str(mnt.path), str(REPO / "tests")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "halfway", p.stderr.read()
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(30)
    assert not (mnt / "snap").exists()
    assert json.loads((mnt / ".pffs" / "stats.json").read_text())["sessions"] == 0
    # No blob under its name with other bytes: every named frame decodes to its name.
    blobs = StoreDir(mnt.store).blobs
    named = list(blobs)
    assert named
    for d in named:
        blobs.get(d)
    # The dead engine's pin goes at the next gc, and its blobs with it.
    r = pffs("gc", "--store", mnt.store, "--grace", "0")
    assert not os.listdir(mnt.store / "pins"), r.stdout
    assert not list(StoreDir(mnt.store).blobs)
    # (The mount fixture runs `pffs check` on the store after the unmount.)


def test_a_damaged_blob_gives_an_integrity_error_naming_the_page(mnt):
    pool = pool_of(8, seed=11)
    br = bridge_of(pool)
    m = br.page_out([one_seq(pool)], mnt / "a")
    path = StoreDir(mnt.store).blobs.path(m.pages[3])
    frame = bytearray(path.read_bytes())
    frame[len(frame) // 2] ^= 0x40
    path.write_bytes(bytes(frame))
    assert_refused_naming(mnt / "a", 3, m.pages[3])
    mnt.skip_check = True  # the damage is on purpose


def test_a_direct_page_in_checks_each_frame_by_the_name_it_holds(mnt, monkeypatch):
    """Frames name their blob: a page-in straight from the store checks that
    name and the crc32 instead of hashing each page again (the mount path
    still hashes), and a frame under another page's name is refused naming
    the page."""
    import engine_bridge.core.bridge as bridge_mod
    from pffs.types import digest_of
    pool = pool_of(8, seed=5)
    br = bridge_of(pool)
    m = br.page_out([one_seq(pool)], mnt / "a")
    hashed = []

    def counted_digest(data):
        hashed.append(len(data))
        return digest_of(data)
    monkeypatch.setattr(bridge_mod, "digest_of", counted_digest)
    def page_in(src) -> list[torch.Tensor]:
        res = br.page_in(src)
        got = [torch.cat([layer[:, b] for layer in pool.layers]).clone() for b in res.blocks]
        br.allocator.free(res.blocks)
        return got
    direct = page_in(mnt / "a")
    assert hashed == []
    through_mount = page_in(DirSource(mnt / "a"))
    assert all(torch.equal(a, b) for a, b in zip(direct, through_mount)) and len(direct) == 8
    assert len(hashed) == 8
    blobs = StoreDir(mnt.store).blobs
    blobs.path(m.pages[3]).write_bytes(blobs.path(m.pages[4]).read_bytes())
    assert_refused_naming(mnt / "a", 3, m.pages[3], "names another blob")
    mnt.skip_check = True  # the damage is on purpose


def assert_refused_naming(session: Path, ix: int, digest: str, why: str = "") -> None:
    """A page-in of *session* into a fresh pool raises DamagedPage naming page
    *ix* and its blob, and leaves the pool and its allocator as they were."""
    fresh = pool_of(8, seed=12)
    before = fresh.clone_layers()
    fb = bridge_of(fresh)
    free = fb.allocator.num_free()
    with pytest.raises(DamagedPage) as e:
        fb.page_in(session)
    assert page_name(ix) in str(e.value) and digest in str(e.value) and why in str(e.value)
    assert fb.allocator.num_free() == free
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.layers))


def unreadable_by(uid: int, paths: list[Path]) -> str | None:
    """Why *uid* cannot read one of *paths* (a folder above it that it may not
    search), asked as that uid; None when it can read them all."""
    probe = "import os, sys; print(*[p for p in sys.argv[1:] if not os.access(p, os.R_OK | os.X_OK)])"
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                        "/usr/bin/python3", "-c", probe, *map(str, paths)],
                       cwd="/", capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise AssertionError(r.stderr)
    if not r.stdout.split():
        return None
    path = Path(r.stdout.split()[0])
    private = next((p for p in [*reversed(path.parents), path] if not os.stat(p).st_mode & 0o001), path)
    return f"uid {uid} cannot read {path}: {private} is mode {os.stat(private).st_mode & 0o777:o}"


def test_another_uid_without_access_to_the_store_goes_through_the_mount(mount_factory, tmp_path):
    """An engine as uid 65534 may use the mount (allow_other, a folder of its own)
    but not the store folder: it logs why and pages out and in through the mount."""
    top = mount_factory.open_root("pffs-direct-uid-")   # other users must reach the mount
    mnt = mount_factory(root=top / "m", store=tmp_path / "store", opts=["allow_other"])
    os.chmod(top / "m", 0o755)
    os.chmod(mnt.path, 0o755)
    (mnt / "nobody").mkdir()
    os.chown(mnt / "nobody", 65534, 65534)
    # The other uid runs this interpreter's packages (torch) and this checkout's.
    site = Path(torch.__file__).resolve().parent.parent
    why = unreadable_by(65534, [site / "torch", REPO / "pffs", REPO / "engine_bridge", REPO / "tests"])
    if why is not None:
        pytest.skip(why)
    code = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
        f"sys.path[:0] = [{str(REPO / 'tests')!r}]\n"
        "from t3_direct import pool_of, bridge_of, one_seq\n"
        "from engine_bridge import as_sink, store_access\n"
        f"dest = {str(mnt / 'nobody' / 'a')!r}\n"
        "assert store_access(dest) is None\n"
        "pool = pool_of(16, seed=13); br = bridge_of(pool)\n"
        "m = br.page_out([one_seq(pool)], dest)\n"
        "res = br.page_in(dest)\n"
        "print('pages', len(m.pages), len(res.blocks))\n")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "/usr/bin/python3", "-c", code], cwd="/", capture_output=True, text=True,
                       env={"PYTHONPATH": f"{site}:{REPO}", "PATH": os.environ["PATH"]}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pages 16 16" in r.stdout
    assert "pages go through the mount: cannot" in r.stderr and "uid 65534" in r.stderr, r.stderr
    st = os.stat(mnt / "nobody" / "a" / "manifest.json")
    assert st.st_uid == 65534


def test_no_direct_path_where_the_daemon_does_not_offer_it(mount_factory, monkeypatch):
    """A store limit (max_size) only the daemon enforces; PFFS_DIRECT=0 asks for the mount."""
    limited = mount_factory("lim", opts=["max_size=1G"])
    info = json.loads((limited / ".pffs" / "store.json").read_text())
    assert info["direct"] is False and "max_size" in info["reason"]
    assert store_access(limited.path) is None
    assert isinstance(as_sink(limited.path / "a"), DirSink)
    plain = mount_factory("plain")
    assert store_access(plain.path) is not None
    monkeypatch.setenv("PFFS_DIRECT", "0")
    assert store_access(plain.path) is None
    assert isinstance(as_source(plain.path / "a"), DirSource)


def test_decode_into_gives_the_bytes_decode_gives(bf16_pages):
    for name in ("planes-zstd1", "zstd-1", "raw"):
        for page in bf16_pages[:4] + [b"", b"x", bf16_pages[0][:101]]:
            f = codec.encode(page, name)
            out = bytearray(len(page))
            assert codec.decode_into(f, out) == len(page)
            assert bytes(out) == codec.decode(f)
            assert codec.decode_into(f, bytearray(len(page) + 2)) == len(page)  # (wrong size: untouched)


class _Loader:
    """An engine adapter whose page-ins are kept for the test to check (engine_bridge.attach.engine_adapter)."""

    def __init__(self, bridge: Bridge):
        from engine_bridge.attach.engine_adapter import StepLock
        self.bridge = bridge
        self.lock = StepLock()
        self.loaded: list = []

    def sequences(self):
        return []

    def pin(self, blocks):
        self.bridge.allocator.incref(blocks)

    def unpin(self, blocks):
        self.bridge.allocator.free(blocks)

    def page_in(self, source):
        res = self.bridge.page_in(source)
        self.loaded.append(res)
        return [s.id for s in res.seqs]


def test_pages_copied_into_an_engine_are_decoded_ahead_of_their_load(mnt):
    """As cp copies each page file into engines/E/, the daemon tells the
    engine its blob, which the agent decodes ahead; the load that follows
    takes those pages (here all of them: the manifest is copied last, once
    they are decoded) and the session goes in bit for bit."""
    from engine_bridge import MemorySession
    from engine_bridge.attach.agent import Agent
    pool = pool_of(12, seed=21)
    br = bridge_of(pool)
    m = br.page_out([one_seq(pool)], mnt / "snap")
    loader = _Loader(bridge_of(pool_of(12, seed=22)))
    with Agent(loader, mnt.path, "loader") as agent:
        dest = mnt / "engines" / "loader" / "s"
        (dest / "pages").mkdir(parents=True)
        names = sorted(os.listdir(mnt / "snap" / "pages"))
        subprocess.run(["cp", *[str(mnt / "snap" / "pages" / p) for p in names], str(dest / "pages")],
                       check=True)
        wait_for(lambda: agent.warm.counts["decoded"] == 12, what="the pages decoded ahead")
        assert agent.warm.counts["asked"] == 12 and agent.warm.held() == 12 * pool.page_bytes
        subprocess.run(["cp", str(mnt / "snap" / "manifest.json"), str(dest)], check=True)
        assert len(loader.loaded) == 1
        assert agent.warm.counts["taken"] == 12 and agent.warm.held() == 0
        res = loader.loaded[0]
        assert loader.bridge.page_out(res.seqs, MemorySession()).pages == m.pages
        loader.bridge.allocator.free(res.blocks)
        # A plain cp -r: every page is told of; what was not decoded in time is read by the load.
        subprocess.run(["cp", "-r", str(mnt / "snap"), str(mnt / "engines" / "loader" / "t")], check=True)
        assert agent.warm.counts["asked"] == 24 and len(loader.loaded) == 2
        assert loader.bridge.page_out(loader.loaded[1].seqs, MemorySession()).pages == m.pages


def test_pages_decoded_ahead_are_bounded_named_and_dropped(mnt):
    """WarmPages holds at most its limit, decodes only frames that name the
    blob asked for, and drops everything at clear() and after its idle time."""
    from engine_bridge.attach.warm import WarmPages
    pool = pool_of(6, seed=23)
    m = bridge_of(pool).page_out([one_seq(pool)], mnt / "s")
    pb = pool.page_bytes
    blobs = StoreDir(mnt.store).blobs
    blobs.path(m.pages[5]).write_bytes(blobs.path(m.pages[4]).read_bytes())   # (4's frame at 5's name)
    w = WarmPages(limit=3 * pb, page_bytes=pb, idle=0.5)
    try:
        w.want(str(mnt.path), [m.pages[5], *m.pages[:5], "sha256:" + "0" * 64])
        wait_for(lambda: w.counts["decoded"] + w.counts["skipped"] == 7, what="every page tried")
        assert w.counts["decoded"] == 3 and w.held() == 3 * pb
        got = bytearray(pb)
        assert w.take_into(m.pages[0], memoryview(got)) == pb
        assert "sha256:" + hashlib.sha256(got).hexdigest() == m.pages[0]
        assert w.take_into(m.pages[5], memoryview(got)) is None
        assert w.take_into(m.pages[1], memoryview(got)[:pb - 1]) is None
        w.clear()
        assert w.held() == 0 and w.take_into(m.pages[2], memoryview(got)) is None
        # The buffers of pages taken or dropped are used again.
        made = w.counts["buffers"]
        w.want(str(mnt.path), [m.pages[0], m.pages[2]])
        wait_for(lambda: w.counts["decoded"] == 5, what="pages decoded again")
        assert w.counts["buffers"] == made <= 4
        wait_for(lambda: w.held() == 0, what="the idle time dropping them")
    finally:
        w.stop()
    mnt.skip_check = True  # (page 5's blob is damaged on purpose)


def test_fp8_pages_paged_out_directly_are_stored_with_zstd_not_byte_planes(mnt):
    """The direct page-out chooses the codec by the pool's values (SinkBase.expect_values):
    1-byte fp8 values have no byte planes (benchmarks/codec.py --fp8: the same ratio as
    planes-zstd, faster), 2-byte bf16 pages keep the store's planes-zstd."""
    from pffs.manifest import parse
    blobs = StoreDir(mnt.store).blobs
    for dtype, want in ((torch.float8_e4m3fn, codec.CODEC_ZSTD), (torch.bfloat16, codec.CODEC_PLANES_ZSTD)):
        pool = KVPool.allocate(num_blocks=4, dtype=dtype, **GEOM)
        gen = torch.Generator().manual_seed(5)
        for layer in pool.layers:
            layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
        name = f"s-{want}"
        m = bridge_of(pool).page_out([one_seq(pool)], mnt / name)
        assert {blobs.header(d).codec.id for d in m.pages} == {want}, dtype
        assert parse((mnt / name / "manifest.json").read_bytes()).pages == m.pages
        assert page_sums(mnt / name) == m.pages
