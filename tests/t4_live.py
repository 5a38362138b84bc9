"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
Live engines through a real mount (contract §3 engines/, §5): snapshots of running
requests equal the bridge's own page-out, sessions copied into an engine continue
bit for bit, snapshots stay consistent while the engine decodes, an engine killed
mid-copy fails the copy with EIO and leaves the daemon serving, and every refusal
(other uid, taken name, no free blocks, another model) changes nothing."""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from engine_bridge.attach.agent import Agent
from engine_bridge.reference.reference_engine import ReferenceEngine
from engine_bridge.reference.reference_live import ReferenceAdapter
from mountutil import pffs as pffs_cli
from mountutil import wait_for
from pffs import manifest as mf
from pffs.live import protocol
from sessions import digest, tree_digest

SEED = 11
COPY_RANGE = hasattr(__import__("pyfuse3").Operations, "copy_file_range")
PROMPT = [(29 * i + 7) % 512 for i in range(53)]
DEADLINE = 60.0


def stats(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def requests(mnt) -> dict[str, int]:
    """FUSE requests the daemon has served, by operation (.pffs/stats.json)."""
    return json.loads((mnt / ".pffs" / "stats.json").read_text())["requests"]


class EngineProc:
    """A reference engine in its own process, attached to a mount, driven over its stdin/stdout."""

    def __init__(self, mnt, name: str, *, blocks: int = 256, staging: str = "1M", seed: int = SEED,
                 env: dict[str, str] | None = None):
        self.name = name
        self.stderr_path = mnt.path.parent / f"engine-{name}-{time.monotonic_ns()}.txt"
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_bridge.attach", str(mnt.path), "--name", name, "--control",
             "--blocks", str(blocks), "--staging", staging, "--seed", str(seed)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
            env={**os.environ, **(env or {})})
        self._buf = b""
        self.hello = None

    def wait_attached(self) -> "EngineProc":
        self.hello = self._reply()
        assert self.hello.get("ok"), f"engine {self.name} did not attach: {self.hello} {self.stderr()}"
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def _reply(self, timeout: float = DEADLINE) -> dict:
        end = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"engine {self.name} did not answer within {timeout:.0f} s\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise AssertionError(f"engine {self.name} exited {self.proc.wait()}\n{self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def __call__(self, cmd: str, **args) -> dict:
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()
        r = self._reply()
        assert r.pop("ok"), f"engine {self.name}: {cmd}: {r}"
        return r

    def close(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)     # in case a test stopped it
            try:
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._err.close()
        return self.proc.returncode


@pytest.fixture
def engines():
    """Start engine processes (several at once: each imports torch); all are stopped at the end."""
    started: list[EngineProc] = []

    def start(mnt, *names, **kw):
        new = [EngineProc(mnt, name, **kw) for name in names]
        started.extend(new)
        for e in new:
            e.wait_attached()
        return new[0] if len(new) == 1 else new
    yield start
    for e in started:
        e.close()


def run(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=DEADLINE, **kw)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {r.returncode}: {r.stderr}")
    return r


def listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def by_position(prompt_len: int, *step_logs) -> dict[int, str]:
    """Logits digests of a sequence by the position of the token they chose."""
    out, pos = {}, prompt_len
    for logs in step_logs:
        for d in logs:
            out[pos] = d
            pos += 1
    return out


def assert_self_consistent(session: Path) -> mf.Manifest:
    """Every page file's sha256 is the digest manifest.json lists for it."""
    m = mf.parse((session / "manifest.json").read_bytes())
    assert sorted(os.listdir(session / "pages")) == [mf.page_name(i) for i in range(len(m.pages))]
    for i, d in enumerate(m.pages):
        assert digest((session / "pages" / mf.page_name(i)).read_bytes()) == d, i
    return m


# ---------------------------------------------------------------------------------- snapshots


def test_live_snapshot_equals_page_out_and_continues_in_another_engine(mnt, engines, tmp_path):
    assert "engines" not in listing(mnt.path)
    e1, e2 = engines(mnt, "e1", "e2")
    assert "engines" in listing(mnt.path)
    assert listing(mnt / "engines") == ["e1", "e2"]
    assert listing(mnt / "engines/e1") == []
    e1("add", id="req-1", prompt=PROMPT)
    first = e1("step", ids=["req-1"], n=30)
    assert listing(mnt / "engines/e1") == ["req-1"]
    live = mnt / "engines/e1/req-1"
    assert listing(live) == ["manifest.json", "pages"]

    # cp -r of the live request is byte for byte the bridge's own page-out; with
    # copy_file_range (pyfuse3 built with third_party/pyfuse3's patch) its pages'
    # bytes go from engines/ to the store in the daemon, never through FUSE.
    figures = stats(mnt)
    copies, work, before = figures["copies"], figures["live"], figures["requests"]
    run("cp", "-r", live, mnt / "snap")
    figures = stats(mnt)
    moved = {k: v - before.get(k, 0) for k, v in figures["requests"].items()}
    n_pages = len(listing(mnt / "snap/pages"))
    work = {k: v - work[k] for k, v in figures["live"].items()}
    print("cp -r out of engines/:", n_pages, "pages,", moved)
    if COPY_RANGE:
        assert moved.get("copy_file_range", 0) >= n_pages + 1
        assert moved.get("write", 0) == 0
        # engines/, engines/e1, the request's folder and its pages/ were kept
        # by the kernel, and the pages' names and attributes (the session's
        # only snapshot: keep_page_attrs), and a reader's close costs no
        # FLUSH: one or two LOOKUPs a file (the copy's name) and one or two
        # GETATTRs (the copy's folder, changed by each create; four a file
        # with the pages' attributes uncached, 11 and 12 with the folders'),
        # and the copies' FLUSHes only. (Room for LOOKUPs and GETATTRs asked
        # again where a timeout ran out while a loaded host ran the copy
        # slowly: the request's folders are kept 0.5 s, LIST_TTL.)
        files = n_pages + 1
        assert moved.get("lookup", 0) <= 2 * files + 8 and moved.get("getattr", 0) <= 2 * files + 8, moved
        assert moved.get("flush", 0) <= files, moved
        # Each page was stored as a blob (ahead of its copy) and the copy named it.
        copied = {k: v - copies[k] for k, v in figures["copies"].items()}
        assert copied == {"shared_bytes": sum(os.path.getsize(p) for p in (mnt / "snap/pages").iterdir()),
                          "copied_bytes": os.path.getsize(mnt / "snap/manifest.json")}
        # One snapshot, each page stored by the engine itself (none gathered
        # into staging for the daemon) and hashed once, as it was stored: cp
        # copies pages/ before manifest.json, which then lists the stored
        # pages' digests without hashing them again.
        assert work == {"snapshots": 1, "pages_gathered": 0, "pages_hashed": 0, "pages_stored": n_pages,
                        "pages_stored_by_engine": n_pages, "store_requests": -(-n_pages // 8)}, work
    e1("page_out", ids=["req-1"], dest=str(tmp_path / "direct"))
    assert tree_digest(mnt / "snap") == tree_digest(tmp_path / "direct")
    # One page read on its own (no manifest.json read first) is the same page.
    assert (live / "pages/000003").read_bytes() == (tmp_path / "direct/pages/000003").read_bytes()
    m = assert_self_consistent(mnt / "snap")
    tokens = e1("state")["seqs"]["req-1"]["tokens"]
    assert m.logical_seqs[0].token_ids == tokens[:-1]       # KV covers all but the newest token

    # Copied into a second engine, it becomes one of that engine's live sessions ...
    assert listing(mnt / "engines/e2") == []
    copies = stats(mnt)["copies"]
    before = requests(mnt)
    run("cp", "-r", mnt / "snap", mnt / "engines/e2/")
    moved = {k: v - before.get(k, 0) for k, v in requests(mnt).items()}
    print("cp -r into engines/:", moved)
    if COPY_RANGE:
        assert moved.get("copy_file_range", 0) >= n_pages + 1
        assert moved.get("write", 0) == 0 and moved.get("read", 0) <= 2   # (stats.json's own)
        # The folders and files being copied in were kept by the kernel until
        # the engine took them: a LOOKUP (the name cp creates) and a GETATTR
        # (pages/, changed by that create) a file, and five more; uncached, a
        # path through snap/ and snap/pages asked both of both again for each
        # file. (Room for a few asked again where a timeout ran out while a
        # loaded host ran the copy slowly.)
        files = n_pages + 1
        assert moved.get("lookup", 0) <= files + 12 and moved.get("getattr", 0) <= files + 12, moved
        # Each page went as its blob's name; e2 read them from the store itself.
        copied = {k: v - copies[k] for k, v in stats(mnt)["copies"].items()}
        assert copied == {"shared_bytes": sum(os.path.getsize(p) for p in (mnt / "snap/pages").iterdir()),
                          "copied_bytes": os.path.getsize(mnt / "snap/manifest.json")}
        assert "engines/e2/snap: paged in from the store" in mnt.log_text()
    assert listing(mnt / "engines/e2") == ["snap"]
    assert e2("state")["groups"] == {"snap": ["req-1"]}
    back = mf.parse((mnt / "engines/e2/snap/manifest.json").read_bytes())
    assert back.pages == m.pages and back.logical_seqs[0].token_ids == tokens[:-1]

    # ... and continues bit for bit like e1 uninterrupted: the first step replays
    # e1's last one from the restored KV, then the same tokens and logits follow.
    want = e1("step", ids=["req-1"], n=20)
    replay = e2("step", ids=["req-1"], n=1)
    assert replay["tokens"]["req-1"] == first["tokens"]["req-1"][-1:]
    assert replay["logits"]["req-1"] == first["logits"]["req-1"][-1:]
    got = e2("step", ids=["req-1"], n=20)
    assert got == want

    # Readers see a fresh snapshot once the sequence grew.
    grown = assert_self_consistent(mnt / "engines/e2/snap")
    assert len(grown.logical_seqs[0].token_ids) == len(tokens) - 1 + 20
    # Straight from one engine's live folder into another's: refused while the
    # sequence id is live there, accepted once it is not.
    mnt.allow(r"engine e2 refused the session, folder removed: sequence 'req-1' is already live")
    r = run("cp", "-r", live, mnt / "engines/e2/", check=False)
    assert r.returncode != 0 and "Invalid argument" in r.stderr, r.stderr
    assert listing(mnt / "engines/e2") == ["snap"]
    e2("remove", id="req-1")
    run("cp", "-r", live, mnt / "engines/e2/")
    assert listing(mnt / "engines/e2") == ["req-1"]
    assert e2("state")["seqs"]["req-1"]["tokens"] == e1("state")["seqs"]["req-1"]["tokens"][:-1]

    # Nothing pins blocks once readers are done: a request that ends frees them all.
    e1("remove", id="req-1")
    wait_for(lambda: e1("state")["free"] == 256, what="e1's blocks released")
    assert listing(mnt / "engines/e1") == []


@pytest.mark.skipif(not COPY_RANGE, reason="pyfuse3 without third_party/pyfuse3's patch")
def test_pages_copied_in_by_name_are_read_changed_or_sent_in_memory_as_needed(mnt, engines):
    """A page copied whole into engines/E/ is held as its blob's name: a read
    gives its bytes, a write first gives the file its bytes; an engine that
    cannot read the store (PFFS_DIRECT=0) gets the pages in memory. Either
    way the session goes in whole and continues as its source would."""
    e1 = engines(mnt, "e1")
    e2 = engines(mnt, "e2", env={"PFFS_DIRECT": "0"})
    e1("add", id="req-1", prompt=PROMPT)
    e1("step", ids=["req-1"], n=30)
    pffs_cli("fork", mnt / "engines/e1/req-1", mnt / "snap")
    tokens = e1("state")["seqs"]["req-1"]["tokens"][:-1]
    pages = sorted(os.listdir(mnt / "snap/pages"))

    # e2 cannot read the store: the daemon sends it the bytes.
    run("cp", "-r", mnt / "snap", mnt / "engines/e2/")
    assert "engine e2 cannot read the store" in mnt.log_text()
    assert e2("state")["seqs"]["req-1"]["tokens"] == tokens

    # e3 can; page 000000 is read back, then rewritten in place, before the rest arrives.
    e3 = engines(mnt, "e3")
    dest = mnt / "engines/e3/x"
    (dest / "pages").mkdir(parents=True)
    run("cp", mnt / "snap/pages" / pages[0], dest / "pages")
    assert (dest / "pages" / pages[0]).read_bytes() == (mnt / "snap/pages" / pages[0]).read_bytes()
    with open(dest / "pages" / pages[0], "r+b") as f:
        f.write((mnt / "snap/pages" / pages[0]).read_bytes()[:100])
    for p in pages[1:]:
        run("cp", mnt / "snap/pages" / p, dest / "pages")
    run("cp", mnt / "snap/manifest.json", dest)
    assert "engines/e3/x: paged in (sequences req-1)" in mnt.log_text()
    assert e3("state")["seqs"]["req-1"]["tokens"] == tokens
    assert e3("step", ids=["req-1"], n=5) == e2("step", ids=["req-1"], n=5)


@pytest.mark.skipif(not COPY_RANGE, reason="pyfuse3 without third_party/pyfuse3's patch")
def test_a_session_copied_in_is_the_live_one_as_soon_as_cp_returns(mnt, engines):
    """The close that completes a copy into engines/E/ returns once the kernel
    has forgotten the copied-in files: a stat or read right after cp finds the
    live session's manifest.json and pages (their own inode numbers), never
    the files just copied, which are gone (ENOENT through a name the kernel
    kept)."""
    from pffs.live.numbering import MANIFEST_J, PAGE_OFFSET, PAGES_J

    e1, e2 = engines(mnt, "e1", "e2")
    e1("add", id="r", prompt=PROMPT)
    e1("step", ids=["r"], n=10)
    pffs_cli("fork", mnt / "engines/e1/r", mnt / "snap")
    for i in range(8):
        dest = mnt / f"engines/e2/s{i}"
        run("cp", "-r", mnt / "snap", dest)
        base = os.stat(dest).st_ino
        assert os.stat(dest / "manifest.json").st_ino == base + MANIFEST_J
        assert os.stat(dest / "pages").st_ino == base + PAGES_J
        assert os.stat(dest / "pages/000000").st_ino == base + PAGE_OFFSET
        assert mf.parse((dest / "manifest.json").read_bytes()).pages
        e2("remove", id="r")            # (the next round loads the same sequence again)


def test_a_session_renamed_into_place_is_the_live_one_as_soon_as_the_rename_returns(mnt, engines):
    """A rename that completes a copy into engines/E/ (rsync's temporary names)
    cannot wait for the kernel to forget the copied-in files (it holds the
    folder's lock an entry invalidation takes): until it does, a name the
    kernel kept leads to the live session's own file, never to ENOENT."""
    e1, e2 = engines(mnt, "e1", "e2")
    e1("add", id="r", prompt=PROMPT)
    e1("step", ids=["r"], n=10)
    pffs_cli("fork", mnt / "engines/e1/r", mnt / "snap")
    first = (mnt / "snap/pages/000000").read_bytes()
    names = listing(mnt / "snap/pages")
    for i in range(8):
        dest = mnt / f"engines/e2/s{i}"
        if i % 2:
            # rsync: manifest.json first, then each page under a temporary name
            # renamed into place; the folders' times set last, through names the
            # kernel kept (rsync exits 23 where one of them is ENOENT).
            run("rsync", "-a", f"{mnt / 'snap'}/", dest)
        else:
            dest.mkdir()
            run("cp", "-r", mnt / "snap/pages", dest)
            (dest / ".manifest.json.tmp").write_bytes((mnt / "snap/manifest.json").read_bytes())
            os.rename(dest / ".manifest.json.tmp", dest / "manifest.json")
        assert mf.parse((dest / "manifest.json").read_bytes()).pages
        assert (dest / "pages/000000").read_bytes() == first
        assert listing(dest / "pages") == names
        os.utime(dest / "pages")
        e2("remove", id="r")            # (the next round loads the same sequence again)


def test_pages_copied_out_are_stored_by_the_daemon_where_the_engine_cannot_reach_the_store(
        mnt, engines, tmp_path):
    """An engine that cannot use the mount's store itself (PFFS_DIRECT=0 here;
    an engine of another user, or an S3 store, likewise) refuses to store a
    snapshot's pages: the daemon gathers them into staging and stores them,
    and the copy is the same, its manifest still hashing no page again."""
    e1 = engines(mnt, "e1", env={"PFFS_DIRECT": "0"})
    e1("add", id="req-1", prompt=PROMPT)
    e1("step", ids=["req-1"], n=30)
    work = stats(mnt)["live"]
    run("cp", "-r", mnt / "engines/e1/req-1", mnt / "snap")
    work = {k: v - work[k] for k, v in stats(mnt)["live"].items()}
    n_pages = len(listing(mnt / "snap/pages"))
    assert n_pages <= 8     # (one store asked for, and refused)
    assert work == {"snapshots": 1, "pages_gathered": n_pages, "pages_hashed": 0, "pages_stored": n_pages,
                    "pages_stored_by_engine": 0, "store_requests": 1}, work
    assert "stores no pages itself" in mnt.log_text()
    e1("page_out", ids=["req-1"], dest=str(tmp_path / "direct"))
    assert tree_digest(mnt / "snap") == tree_digest(tmp_path / "direct")


@pytest.mark.skipif(not COPY_RANGE, reason="pyfuse3 without third_party/pyfuse3's patch")
def test_an_engine_answering_a_store_with_rows_it_cannot_have_is_not_believed(mnt, tmp_path):
    """Rows an engine answers a ``store`` with that cannot be its pages' (here
    a digest that is no sha256) are refused with one log line: those pages'
    copies move their bytes, the daemon stores the pages itself from then
    on, and the copy is still the engine's own page-out."""
    class Lying(Agent):
        def _store(self, msg, fds):
            reply = super()._store(msg, fds)
            reply["rows"][0][1] = "sha256:" + "z" * 64
            return reply

    engine = ReferenceEngine(seed=SEED, num_blocks=64)
    adapter = ReferenceAdapter(engine)
    mnt.allow(r"answered a store with rows it cannot have")
    with Lying(adapter, mnt.path, "e1", staging_bytes=1 << 20):
        engine.add_request("r", [(3 * i + 2) % 512 for i in range(200)])    # 13 pages: two stores
        adapter.step()
        figures = stats(mnt)
        run("cp", "-r", mnt / "engines/e1/r", mnt / "snap")
        after = stats(mnt)
        work = {k: v - figures["live"][k] for k, v in after["live"].items()}
        copied = {k: v - figures["copies"][k] for k, v in after["copies"].items()}
        n_pages = len(listing(mnt / "snap/pages"))
        assert n_pages == 13
        assert "answered a store with rows it cannot have" in mnt.log_text()
        # No row of the engine's was taken: the pages of the stores it answered
        # were copied byte by byte, any after that stored by the daemon (both
        # stores may be answered before either reply is read).
        pb = adapter.bridge.pool.page_bytes
        assert work["pages_stored_by_engine"] == 0 and work["pages_stored"] in (0, n_pages - 8), work
        by_bytes = copied["copied_bytes"] - os.path.getsize(mnt / "snap/manifest.json")
        assert by_bytes + work["pages_stored"] * pb == n_pages * pb, (copied, work)
        adapter.bridge.page_out(adapter.sequences(), tmp_path / "direct")
        assert tree_digest(mnt / "snap") == tree_digest(tmp_path / "direct")
        engine.remove("r")


@pytest.mark.skipif(not COPY_RANGE, reason="pyfuse3 without third_party/pyfuse3's patch")
def test_a_copy_out_of_engines_asks_the_engine_for_whole_batches_of_pages(mnt, tmp_path):
    """As cp moves from page to page, the pages ahead are asked of the engine
    8 at a time, not one more page a request (each then ran on one of the
    engine's threads): a copy of n pages makes ceil(n / 8) store requests,
    overlapping on the engine's threads, names them on the event loop and is
    still its page-out."""
    engine = ReferenceEngine(seed=SEED, num_blocks=64)
    adapter = ReferenceAdapter(engine)
    with Agent(adapter, mnt.path, "e1", staging_bytes=1 << 20):
        engine.add_request("r", [(7 * i + 3) % 512 for i in range(600)])   # 38 pages
        adapter.step()
        before = stats(mnt)
        run("cp", "-r", mnt / "engines/e1/r", mnt / "snap")
        after = stats(mnt)
        work = {k: v - before["live"][k] for k, v in after["live"].items()}
        named = {k: v - before["blobs_named"][k] for k, v in after["blobs_named"].items()}
        n_pages = len(listing(mnt / "snap/pages"))
        print("named:", named, "work:", work)
        assert n_pages == 38
        assert work["pages_stored_by_engine"] == n_pages and work["store_requests"] == 5, work
        # Each copy names its stored page on the event loop, not through a
        # commit thread (a hand-off there and back a file), except where a
        # commit thread was adopting a batch of pages just then.
        assert sum(named.values()) == n_pages and named["on_loop"] >= n_pages - 2 * 5, named
        adapter.bridge.page_out(adapter.sequences(), tmp_path / "direct")
        assert tree_digest(mnt / "snap") == tree_digest(tmp_path / "direct")
        engine.remove("r")


def test_pffs_fork_out_of_and_into_an_engine_has_the_engine_move_the_bytes(mnt, engines):
    """``pffs fork engines/E/REQ SNAP`` has E page REQ out itself (beside the FUSE
    loop: no page is read through the mount), giving the session ``cp -r`` gives;
    ``pffs fork SNAP engines/F/`` has F page it in, and it continues bit for bit."""
    e1, e2 = engines(mnt, "e1", "e2")
    e1("add", id="req-1", prompt=PROMPT)
    first = e1("step", ids=["req-1"], n=30)
    live = mnt / "engines/e1/req-1"
    run("cp", "-r", live, mnt / "copied")
    reads = _requests(mnt).get("read", 0)
    r = pffs_cli("fork", live, mnt / "snap")
    assert "forked" in r.stdout
    assert _requests(mnt).get("read", 0) - reads < 8      # (stats.json's own reads)
    assert tree_digest(mnt / "snap") == tree_digest(mnt / "copied")
    m = assert_self_consistent(mnt / "snap")

    reads = _requests(mnt).get("read", 0)
    pffs_cli("fork", mnt / "snap", mnt / "engines/e2/")
    assert _requests(mnt).get("read", 0) - reads < 8
    assert listing(mnt / "engines/e2") == ["snap"]
    assert e2("state")["groups"] == {"snap": ["req-1"]}
    assert mf.parse((mnt / "engines/e2/snap/manifest.json").read_bytes()).pages == m.pages
    want = e1("step", ids=["req-1"], n=20)
    replay = e2("step", ids=["req-1"], n=1)
    assert replay["tokens"]["req-1"] == first["tokens"]["req-1"][-1:]
    assert replay["logits"]["req-1"] == first["logits"]["req-1"][-1:]
    assert e2("step", ids=["req-1"], n=20) == want

    # Refusals name the reason and change nothing.
    mnt.allow(r"load /snap into engines/e2/snap: the engine refused")
    mnt.allow(r"load /snap into engines/e1/again: the engine refused")
    r = pffs_cli("fork", mnt / "snap", mnt / "engines/e2/", check=False)
    assert r.returncode != 0 and "File exists" in r.stderr, r.stderr
    r = pffs_cli("fork", mnt / "snap", mnt / "engines/e1/again", check=False)  # req-1 is live there
    assert r.returncode != 0 and "Invalid argument" in r.stderr, r.stderr
    assert listing(mnt / "engines/e1") == ["req-1"]
    r = pffs_cli("fork", live, mnt / "snap", check=False)
    assert r.returncode != 0 and "exists" in r.stderr
    free = e2("state")["free"]
    r = pffs_cli("fork", mnt / "engines/e1/nope", mnt / "snap2", check=False)
    assert r.returncode != 0 and not (mnt / "snap2").exists()
    assert e2("state")["free"] == free


def _requests(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())["requests"]


def test_snapshots_stay_consistent_while_the_engine_decodes(mnt, engines):
    e1, e2 = engines(mnt, "e1", "e2")
    e1("add", id="r", prompt=PROMPT)
    first = e1("step", ids=["r"], n=3)
    e1("run", ids=["r"])
    copies = []
    for k in range(3):
        dest = mnt / f"copy{k}"
        run("cp", "-r", mnt / "engines/e1/r", dest)
        copies.append(dest)
    # A page-in straight from the live folder (manifest read by one thread, pages
    # by the bridge's worker threads) while the engine keeps decoding.
    restored = e2("page_in", src=str(mnt / "engines/e1/r"))
    assert restored["seqs"] == ["r"]
    n = restored["n_tokens"]["r"]
    wait_for(lambda: len(mf.parse((mnt / "engines/e1/r/manifest.json").read_bytes())
                         .logical_seqs[0].token_ids) > n + 8, what="decoding past the page-in")
    history = e1("pause")
    tokens = e1("state")["seqs"]["r"]["tokens"]
    logits = by_position(len(PROMPT), first["logits"]["r"], history["logits"]["r"])

    lengths = []
    for dest in copies:
        m = assert_self_consistent(dest)
        toks = m.logical_seqs[0].token_ids
        assert toks == tokens[:len(toks)]
        lengths.append(len(toks))
    assert lengths == sorted(lengths) and lengths[0] > len(PROMPT)
    assert n >= lengths[-1]

    # The restored sequence continues in e2 exactly as e1 went on from that point.
    got = e2("step", ids=["r"], n=8)
    assert got["tokens"]["r"] == tokens[n:n + 8]
    assert got["logits"]["r"] == [logits[p] for p in range(n, n + 8)]


def test_a_reader_keeps_one_snapshot_from_its_listing_to_its_manifest(mnt):
    """A process that lists pages/ gets a snapshot of its own, taken then (not
    the one another reader is using); its pages and its manifest.json stay
    that snapshot's for as long as it keeps reading, past SNAPSHOT_REUSE
    (cp -r copies pages/ before manifest.json); opening manifest.json again
    gives the session as it is now."""
    from pffs.live.engines import SNAPSHOT_REUSE

    engine = ReferenceEngine(seed=SEED, num_blocks=64)
    adapter = ReferenceAdapter(engine)
    with Agent(adapter, mnt.path, "e1", staging_bytes=1 << 20):
        prompt = [(3 * i + 2) % 512 for i in range(40)]
        engine.add_request("r", prompt)
        adapter.step()      # (the prompt's KV, then two more tokens' below)
        live = mnt / "engines/e1/r"

        def tokens(m: mf.Manifest) -> int:
            return len(m.logical_seqs[0].token_ids)
        n_pages = len(os.listdir(live / "pages"))      # this process's snapshot
        page0 = (live / "pages" / mf.page_name(0)).read_bytes()
        adapter.step()
        adapter.step()
        # Reading on for longer than SNAPSHOT_REUSE keeps the same snapshot.
        end = time.monotonic() + SNAPSHOT_REUSE * 1.5
        while time.monotonic() < end:
            assert (live / "pages" / mf.page_name(0)).read_bytes() == page0
        mine = mf.parse((live / "manifest.json").read_bytes())
        assert tokens(mine) == len(prompt), tokens(mine)
        assert len(mine.pages) == n_pages and digest(page0) == mine.pages[0]
        # Another process listing pages/ and then reading manifest.json (as cp -r
        # does) gets the session as it is now, though this one's is in use.
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import os, sys
            os.listdir({str(live / "pages")!r})
            sys.stdout.buffer.write(open({str(live / "manifest.json")!r}, "rb").read())""")],
                           capture_output=True, check=True, timeout=60)
        theirs = mf.parse(r.stdout)
        assert tokens(theirs) == len(prompt) + 2, tokens(theirs)
        # ... and so does this process's next manifest.json.
        assert tokens(mf.parse((live / "manifest.json").read_bytes())) == tokens(theirs)
        engine.remove("r")


def test_the_kernel_keeps_a_page_s_attributes_only_while_every_reader_sees_them(mnt):
    """While a live session has one snapshot, the kernel keeps its pages'
    attributes (a stat, cp's three of each page, costs no GETATTR); a new
    snapshot (here this process opening manifest.json again, while a page
    of the first is open) has the kernel forget them before the open
    returns, so a stat then shows the new snapshot's time."""
    engine = ReferenceEngine(seed=SEED, num_blocks=64)
    adapter = ReferenceAdapter(engine)
    with Agent(adapter, mnt.path, "e1", staging_bytes=1 << 20):
        engine.add_request("r", [(3 * i + 2) % 512 for i in range(40)])
        adapter.step()
        live = mnt / "engines/e1/r"
        page0 = live / "pages" / mf.page_name(0)
        (live / "manifest.json").read_bytes()     # (this process's snapshot, the session's only one)
        mine = os.stat(page0).st_mtime_ns
        # Three stats ask no GETATTR beyond reading stats.json's own, in one of
        # a few tries: a try may also meet the kernel asking again of an
        # attribute whose time ran out meanwhile (the mount root's, 10 s), where
        # a page's attributes not kept cost three GETATTRs in every try.
        asked = []
        for _ in range(5):
            quiet = requests(mnt).get("getattr", 0)
            quiet = requests(mnt).get("getattr", 0) - quiet     # (what reading stats.json asks)
            before = requests(mnt).get("getattr", 0)
            for _ in range(3):
                assert os.stat(page0).st_mtime_ns == mine
            asked.append(requests(mnt).get("getattr", 0) - before - quiet)
            if asked[-1] == 0:
                break
        assert asked[-1] == 0, asked
        with open(page0, "rb"):     # (the first snapshot stays, being read)
            (live / "manifest.json").read_bytes()     # a new snapshot
            assert os.stat(page0).st_mtime_ns > mine
        engine.remove("r")


def test_a_copy_right_after_another_is_the_session_s_only_snapshot(mnt):
    """A cp -r of a live request right after another: the first copy's
    snapshot, which no reader can use any more (its process ended, nothing
    open), goes when the second takes its own, instead of a few seconds
    later; so the second's is the session's only one, and the kernel keeps
    its pages' attributes as it did the first's (the same GETATTRs)."""
    engine = ReferenceEngine(seed=SEED, num_blocks=64)
    adapter = ReferenceAdapter(engine)
    with Agent(adapter, mnt.path, "e1", staging_bytes=1 << 20):
        engine.add_request("r", [(3 * i + 2) % 512 for i in range(200)])    # 13 pages
        adapter.step()
        asked = []
        for name in ("snap1", "snap2"):
            before = requests(mnt).get("getattr", 0)
            run("cp", "-r", mnt / "engines/e1/r", mnt / name)
            asked.append(requests(mnt).get("getattr", 0) - before)
        files = len(listing(mnt / "snap2/pages")) + 1
        print("GETATTRs of the two copies of", files, "files:", asked)
        # (The first copy's snapshot left in place, the second's pages'
        # attributes are not kept: three GETATTRs more a page. Room for
        # a few attributes whose timeouts ran out while a loaded host ran one
        # copy more slowly than the other.)
        assert asked[1] <= 2 * files + 3 and asked[1] <= asked[0] + files // 2, asked
        assert tree_digest(mnt / "snap1") == tree_digest(mnt / "snap2")
        engine.remove("r")


def test_a_snapshot_being_read_outlives_its_request(mnt):
    engine = ReferenceEngine(seed=SEED, num_blocks=16)
    adapter = ReferenceAdapter(engine)
    with Agent(adapter, mnt.path, "e1", staging_bytes=64 << 10):     # four slots: pages are re-gathered
        engine.add_request("r", [(3 * i + 2) % 512 for i in range(100)])
        for _ in range(6):
            adapter.step()
        live = mnt / "engines/e1/r"
        m = mf.parse((live / "manifest.json").read_bytes())
        assert len(m.pages) == 7
        files = [open(live / "pages" / mf.page_name(i), "rb") for i in range(len(m.pages))]
        try:
            # The request ends and another one takes every free block and writes into them.
            with adapter.lock:
                engine.remove("r")
                free = engine.allocator.num_free()
                engine.add_request("other", [(5 * i + 3) % 512 for i in range(free * 16 - 1)])
                engine.step()
                assert engine.allocator.num_free() == 0
            assert listing(mnt / "engines/e1") == ["other"]
            for i, f in enumerate(files):
                assert digest(f.read()) == m.pages[i], i
        finally:
            for f in files:
                f.close()
        # Once nobody reads it, the snapshot lets its blocks go.
        with adapter.lock:
            engine.remove("other")
        wait_for(lambda: engine.allocator.num_free() == 16, what="the snapshot's blocks released")


# ---------------------------------------------------------------------------------- failures


# read(2) and copy_file_range(2) (cp copies with the latter, the kernel splicing through reads).
_READ_SYSCALLS = {"x86_64": {"0"}, "aarch64": {"63"}}.get(os.uname().machine, {"0"})


def _in_read(tid: int) -> bool:
    """Whether thread *tid* of this process sleeps in read(2)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    return bool(fields) and fields[0] in _READ_SYSCALLS


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_engine_killed_during_copy(mount_factory, engines):
    mnt = mount_factory()
    mnt.allow(r"engine e1 \(pid \d+\) went away")
    # Two staging slots: reads keep asking the engine.
    e1, e2 = engines(mnt, "e1", "e2", staging="32K")
    for k in range(3):
        e1("add", id=f"big{k}", prompt=[(13 * i + k) % 512 for i in range(800)])
    e1("step", n=2)
    e2("add", id="other", prompt=PROMPT)
    e2("step", n=2)
    run("cp", "-r", mnt / "engines/e2/other", mnt / "kept")

    # Pages opened (snapshots taken) while the engine runs; one of a session cp has
    # not reached yet is then in no staging slot: only the engine can serve it.
    fds = {f"big{k}": os.open(mnt / f"engines/e1/big{k}/pages" / mf.page_name(0), os.O_RDONLY)
           for k in range(3)}
    out = mnt / "out"
    cp = subprocess.Popen(["cp", "-r", str(mnt / "engines/e1"), str(out)], stderr=subprocess.PIPE,
                          text=True)
    try:
        wait_for(lambda: cp.poll() is not None or len(list(out.glob("*/pages/*"))) >= 1,
                 interval=0.001, what="cp copying pages")
        assert cp.poll() is None, "cp finished before the engine could be stopped"
        os.kill(e1.pid, signal.SIGSTOP)
        wait_for(lambda: _stopped(e1.pid), what="the engine stopped")
        untouched = sorted(set(fds) - {p.name for p in out.iterdir()})
        assert untouched, "cp reached every session before the engine could be stopped"
        fd = fds[untouched[0]]
        # Asked after the engine stopped, this read can only wait for it.
        got = {}

        def reader():
            try:
                got["data"] = os.read(fd, 4096)
            except OSError as e:
                got["errno"] = e.errno
        t = threading.Thread(target=reader)
        t.start()
        wait_for(lambda: "errno" in got or "data" in got or _in_read(t.native_id),
                 what="the reader waiting in read()")
        assert not got, f"a read was answered by a stopped engine: {got}"
        t0 = time.monotonic()
        os.kill(e1.pid, signal.SIGKILL)
        t.join(DEADLINE)
        took = time.monotonic() - t0
        _, err = cp.communicate(timeout=DEADLINE)
    finally:
        if cp.poll() is None:
            cp.kill()
            cp.wait()
        for fd in fds.values():
            os.close(fd)
    assert got == {"errno": errno.EIO}, got
    assert took < 5.0, f"the waiting read took {took:.1f} s to fail"
    # cp fails too: EIO on the page it was reading, or its next page gone with the engine.
    assert cp.returncode != 0
    assert "Input/output error" in err or "No such file or directory" in err, err
    e1.proc.wait(DEADLINE)

    # The daemon serves the rest: the engine's folder is gone, the others work.
    wait_for(lambda: listing(mnt / "engines") == ["e2"], what="e1 gone from engines/")
    assert_self_consistent(mnt / "kept")
    run("cp", "-r", mnt / "engines/e2/other", mnt / "kept2")
    assert_self_consistent(mnt / "kept2")
    # The engine can attach again under the same name.
    again = engines(mnt, "e1")
    again("add", id="fresh", prompt=PROMPT)
    again("step", n=1)
    assert listing(mnt / "engines/e1") == ["fresh"]
    assert_self_consistent(mnt / "engines/e1/fresh")
    e2.close()
    again.close()
    wait_for(lambda: "engines" not in listing(mnt.path), what="engines/ gone with the last engine")


# ---------------------------------------------------------------------------------- refusals


_OTHER_UID_CLIENT = textwrap.dedent("""
    import errno, json, os, sys
    from pffs.live import protocol
    path = f"/proc/self/fd/{sys.argv[1]}/engine.sock"
    try:
        sock = protocol.connect(path)
    except PermissionError:
        print(json.dumps({"uid": os.getuid(), "refused_by": "mode"}))
        sys.exit(0)
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * 16384)
    import fcntl
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    geo = {"page_size_tokens": 16, "n_layers": 4, "n_heads": 2, "head_dim": 16, "dtype": "f32"}
    try:
        protocol.register(protocol.Channel(sock), {"name": "intruder", "pid": os.getpid(),
                          "geometry": geo, "page_bytes": 16384, "slots": 2}, fd)
    except protocol.Refused as e:
        print(json.dumps({"uid": os.getuid(), "refused_by": "daemon", "errno": e.errno, "error": str(e)}))
        sys.exit(0)
    print(json.dumps({"uid": os.getuid(), "refused_by": None}))
""")


def _attach_as_nobody(store: Path) -> dict:
    """Try to attach from a process running as uid 65534 (nobody) and report how it was refused."""
    dirfd = os.open(store, os.O_PATH)
    try:
        r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                            "/usr/bin/python3", "-c", _OTHER_UID_CLIENT, str(dirfd)],
                           pass_fds=(dirfd,), env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
                           cwd="/", capture_output=True, text=True, timeout=DEADLINE)
    finally:
        os.close(dirfd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _state(a: ReferenceAdapter) -> tuple:
    e = a.engine
    with a.lock:
        return ({s.id: (s.n_tokens, list(s.block_ids)) for s in e.seq_blocks()}, e.allocator.free_list(),
                {b: e.allocator.refcount(b) for b in range(e.allocator.num_blocks)})


def test_attach_refusals(mnt):
    mnt.allow(r"engine socket: refused pid \d+ \(uid 65534\)")
    mnt.allow(r"engine socket: refused pid \d+ \(uid 0\): the name 'e1' is taken")
    sock = mnt.store / "engine.sock"
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert os.readlink(mnt / ".pffs/engine.sock") == str(sock)

    # Another uid: the socket's mode keeps it out ...
    assert _attach_as_nobody(mnt.store) == {"uid": 65534, "refused_by": "mode"}
    # ... and were the mode opened, the daemon refuses it by its credentials.
    os.chmod(sock, 0o666)
    try:
        got = _attach_as_nobody(mnt.store)
    finally:
        os.chmod(sock, 0o600)
    assert got["refused_by"] == "daemon" and got["errno"] == errno.EACCES, got

    # A taken name.
    e1 = ReferenceEngine(seed=SEED, name="e1")
    with Agent(ReferenceAdapter(e1), mnt.path, "e1", staging_bytes=1 << 20) as a1:
        dup = Agent(ReferenceAdapter(ReferenceEngine(seed=SEED)), mnt.path, "e1", staging_bytes=1 << 20)
        with pytest.raises(protocol.Refused) as ei:
            dup.attach()
        assert ei.value.errno == errno.EEXIST
        assert listing(mnt / "engines") == ["e1"]
        assert a1.attached.is_set() and not a1.detached.is_set()
        # Not a name the daemon can host, and engines/ itself is read-only.
        with pytest.raises(OSError) as ei:
            (mnt / "engines/e9").mkdir()
        assert ei.value.errno == errno.EPERM
    wait_for(lambda: "engines" not in listing(mnt.path), what="engines/ gone after detaching")
    with pytest.raises(OSError) as ei:
        (mnt / "engines").mkdir()
    assert ei.value.errno == errno.EEXIST


def test_unmount_with_an_engine_attached(mount_factory):
    mnt = mount_factory()
    engine = ReferenceEngine(seed=SEED)
    adapter = ReferenceAdapter(engine)
    agent = Agent(adapter, mnt.path, "e1", staging_bytes=1 << 20).attach()
    engine.add_request("r", PROMPT)
    adapter.step()
    assert listing(mnt / "engines/e1") == ["r"]
    assert mnt.stop() == 0
    wait_for(agent.detached.is_set, what="the agent noticed the unmount")
    assert not (mnt.store / "engine.sock").exists()
    assert engine.allocator.num_free() == 256 - 4       # no pin left behind
    adapter.step()                                      # the engine runs on


def test_page_in_refusals_leave_the_engine_as_it_was(mnt):
    mnt.allow(r"engine e(small|other) refused the session, folder removed")
    mnt.allow("refused manifest")
    src = ReferenceEngine(seed=SEED, name="src")
    src.add_request("long", [(3 * i + 1) % 512 for i in range(90)])   # 6 pages
    src.step()
    src.page_out(mnt / "snap")

    small = ReferenceEngine(seed=SEED, num_blocks=8, name="small")
    small.add_request("mine", PROMPT)                                   # 4 of 8 blocks
    small.step()
    other = ReferenceEngine(seed=SEED + 1, name="other")               # another model revision
    a_small, a_other = ReferenceAdapter(small), ReferenceAdapter(other)
    with Agent(a_small, mnt.path, "esmall", staging_bytes=1 << 20), \
            Agent(a_other, mnt.path, "eother", staging_bytes=1 << 20):
        for engine, name, err in ((a_small, "esmall", "No space left on device"),
                                  (a_other, "eother", "Invalid argument")):
            before = _state(engine)
            r = run("cp", "-r", mnt / "snap", mnt / "engines" / name / "", check=False)
            assert r.returncode != 0 and err in r.stderr, r.stderr
            assert _state(engine) == before
            assert "snap" not in listing(mnt / "engines" / name)
        assert "refused the session" in mnt.log_text()

        # A manifest that is not one is refused at its close, like anywhere in the mount.
        (mnt / "engines/esmall/bad").mkdir()
        with pytest.raises(OSError) as ei:
            (mnt / "engines/esmall/bad/manifest.json").write_text("{not json")
        assert ei.value.errno == errno.EINVAL
        run("rm", "-rf", mnt / "engines/esmall/bad")
        assert listing(mnt / "engines/esmall") == ["mine"]

        # rsync (temp files renamed into place) pages a session in too, once there is room.
        with a_small.lock:
            small.remove("mine")
        wait_for(lambda: small.allocator.num_free() == 8, what="esmall's blocks released")
        run("rsync", "-a", f"{mnt / 'snap'}/", mnt / "engines/esmall/synced/")
        assert listing(mnt / "engines/esmall") == ["synced"]
        with a_small.lock:
            assert [s.id for s in small.seq_blocks()] == ["long"]
        assert_self_consistent(mnt / "engines/esmall/synced")
        assert tree_digest(mnt / "engines/esmall/synced/pages") == tree_digest(mnt / "snap/pages")


def test_engine_folders_are_kept_by_the_kernel_until_an_engine_detaches(mnt):
    e1 = ReferenceEngine(seed=SEED, name="e1")
    with Agent(ReferenceAdapter(e1), mnt.path, "e1", staging_bytes=1 << 20):
        wait_for(lambda: (mnt / "engines/e1").exists(), what="engines/e1")
        ino = os.stat(mnt / "engines/e1").st_ino
        before = requests(mnt)
        for _ in range(20):
            assert os.stat(mnt / "engines/e1").st_ino == ino
        after = requests(mnt)
        print("20 stats of engines/e1:", {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})
        # engines/ and engines/e1 were cached: 20 path walks asked nothing
        # (uncached, each asked a LOOKUP and a GETATTR of both, 40 of each);
        # what was asked is reading stats.json itself (uncached: two LOOKUPs
        # and four GETATTRs here), with room for the mount root's attributes
        # asked again where their 10 s ran out on a loaded host.
        assert after.get("lookup", 0) - before.get("lookup", 0) <= 10
        assert after.get("getattr", 0) - before.get("getattr", 0) <= 10
    # The detach made the kernel forget them: both gone for a stat, not only a listing.
    wait_for(lambda: not os.path.lexists(mnt / "engines/e1"), timeout=5, what="engines/e1 forgotten")
    wait_for(lambda: not os.path.lexists(mnt / "engines"), timeout=5, what="engines/ forgotten")
    e1b = ReferenceEngine(seed=SEED, name="e1")
    with Agent(ReferenceAdapter(e1b), mnt.path, "e1", staging_bytes=1 << 20):
        wait_for(lambda: (mnt / "engines/e1").exists(), what="engines/e1 again")
        assert os.stat(mnt / "engines/e1").st_ino != ino     # a new engine: new inode numbers
        assert listing(mnt / "engines") == ["e1"]
