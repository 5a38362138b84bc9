"""Level t5, whole workflows: a real mount, real tools and a real engine, end to end.
The reference engine through a real mount: page out, fork with cp -r and
pffs fork, page in, continue bit for bit; forks sharing their prefix pages in
the store; every page-in refusal leaving the engine as it was; and the demo
command end to end."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time

import pytest
import torch

from engine_bridge import (DigestMismatch, IncompleteSession, MismatchError, ModelMismatch,
                           NoFreeBlocks, WrongSizePage)
from engine_bridge import store_access
from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine
from mountutil import is_mounted, lazy_unmount, pffs
from pffs.manifest import page_name

SEED = 7
PROMPTS = {
    "x": [(37 * i + 11) % 512 for i in range(53)],
    "y": [(101 * i + 3) % 512 for i in range(29)],
}
IDS = list(PROMPTS)


def stats(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def engine(dtype="f32", **kw) -> ReferenceEngine:
    return ReferenceEngine(dtype=dtype, seed=SEED, **kw)


def decoded(dtype="f32", prompts=PROMPTS, steps=40, **kw):
    """An engine that read *prompts* as one batch and decoded *steps* tokens; its last step's outputs."""
    e = engine(dtype, **kw)
    for sid, p in prompts.items():
        e.add_request(sid, p)
    last = None
    for _ in range(steps):
        last = e.step(list(prompts))
    return e, last


def assert_continues_like(restored, last, want_t, want_l, ids=IDS):
    """The restored engine replays the last step bit for bit, then decodes as the original did."""
    replay = restored.step(ids)
    for sid in ids:
        assert replay[sid].token == last[sid].token, sid
        assert torch.equal(replay[sid].logits, last[sid].logits), sid
    got_t, got_l = restored.generate(ids, len(want_t[ids[0]]))
    assert got_t == want_t
    for sid in ids:
        assert all(torch.equal(x, y) for x, y in zip(got_l[sid], want_l[sid])), sid


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


# ------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("path", ["direct", "mount"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_page_out_fork_page_in_continues_bit_exact(mnt, dtype, path, monkeypatch):
    # Page bytes straight to and from the store (engine_bridge.transport.direct), or every byte through FUSE.
    if path == "mount":
        monkeypatch.setenv("PFFS_DIRECT", "0")
    assert (store_access(mnt.path) is not None) == (path == "direct")
    a, last = decoded(dtype)
    m = a.page_out(mnt / "a")
    assert sorted(os.listdir(mnt / "a" / "pages")) == [page_name(i) for i in range(len(m.pages))]
    before = stats(mnt)
    run("cp", "-r", mnt / "a", mnt / "b")
    pffs("fork", mnt / "a", mnt / "c")
    after = stats(mnt)
    assert after["sessions"] == 3 and after["stored_bytes"] == before["stored_bytes"]
    for fork in ("b", "c"):
        assert (mnt / fork / "manifest.json").read_bytes() == (mnt / "a" / "manifest.json").read_bytes()
        sums = run("sha256sum", *sorted(os.listdir(mnt / fork / "pages")), cwd=mnt / fork / "pages")
        assert ["sha256:" + line.split()[0] for line in sums.stdout.splitlines()] == m.pages

    # A continues uninterrupted; fresh engines continue from each fork in the same batch shape.
    want_t, want_l = a.generate(IDS, 40)
    for fork in ("b", "c"):
        e = engine(dtype)
        assert e.page_in(mnt / fork) == IDS
        assert_continues_like(e, last, want_t, want_l)


# -------------------------------------------------------- shared prefixes


def test_continued_forks_share_their_prefix_pages_in_the_store(mnt):
    # A long conversation (many pages) so that a fork's new pages are a small part of it.
    long = {"chat": [(7919 * i + 5) % 512 for i in range(1000)]}
    a, _ = decoded("f32", long, steps=8)
    s0 = stats(mnt)["stored_bytes"]
    ma = a.page_out(mnt / "a")
    one_session = stats(mnt)["stored_bytes"] - s0
    assert one_session > 0
    run("cp", "-r", mnt / "a", mnt / "b")
    pffs("fork", mnt / "a", mnt / "c")

    outs = {}
    for fork, turn in (("b", [17, 4, 99]), ("c", [250, 251, 252, 253, 254, 255, 1])):
        e = engine("f32")
        e.page_in(mnt / fork)
        e.step(["chat"])            # the replayed step
        e.append_tokens("chat", turn)
        e.step(["chat"])            # the new turn
        e.generate(["chat"], 5)
        outs[fork] = e.page_out(mnt / f"{fork}2")

    old = set(ma.pages)
    new = {d for m in outs.values() for d in m.pages} - old
    for m in outs.values():
        # Every full page of the original is still there, byte for byte.
        n_full = len(ma.logical_seqs[0].page_ixs) - 1
        assert m.pages[:n_full] == ma.pages[:n_full]
    growth = stats(mnt)["stored_bytes"] - s0
    page_bytes = ma.page_bytes
    print(f"one session: {one_session} stored bytes ({len(ma.pages)} pages of {page_bytes}); "
          f"after two continued forks: {growth} ({len(new)} new pages)")
    assert 2 <= len(new) <= 4
    # One session plus the new pages (each at most its raw size, plus manifests).
    assert growth <= one_session + len(new) * page_bytes + 64 * 1024
    assert growth < 1.1 * one_session


# ------------------------------------------------------------- refusals


def _edit_manifest(path, fn) -> None:
    m = json.loads((path / "manifest.json").read_bytes())
    fn(m)
    # An ordinary in-place write through the mount (truncate, write, close).
    with open(path / "manifest.json", "w") as f:
        json.dump(m, f)


def _flip_byte(path, ix: int, at: int = 777) -> None:
    with open(path / "pages" / page_name(ix), "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))


REFUSALS = {
    # case: (target engine kwargs, edit of the session in the mount, exception, field or page)
    "block size": (dict(block_size=8), None, MismatchError, "page_size_tokens"),
    "n_layers": (dict(config=ModelConfig(n_layers=3)), None, MismatchError, "n_layers"),
    "head_dim": (dict(config=ModelConfig(head_dim=32)), None, MismatchError, "head_dim"),
    "dtype": (dict(dtype="bf16"), None, MismatchError, "dtype"),
    "model": (dict(seed=SEED + 1), None, ModelMismatch, "model.weights_sha256"),
    "kv": ({}, lambda s: _edit_manifest(s, lambda m: m["kv"].update(k_has_rope=False)),
           MismatchError, "kv.k_has_rope"),
    "missing page": ({}, lambda s: os.unlink(s / "pages" / page_name(2)), IncompleteSession, None),
    "short page": ({}, lambda s: os.truncate(s / "pages" / page_name(1), 1000), WrongSizePage, 1),
    "long page": ({}, lambda s: open(s / "pages" / page_name(3), "ab").write(b"\0" * 8),
                  WrongSizePage, 3),
    "disagreeing page": ({}, lambda s: _flip_byte(s, 4), DigestMismatch, 4),
    "too many pages": (dict(num_blocks=6), None, NoFreeBlocks, None),
}


@pytest.fixture
def live_session(mnt):
    """A session of two sequences, written through the mount."""
    a, _ = decoded("f32", steps=3)
    a.page_out(mnt / "a")
    return mnt


def _busy(e: ReferenceEngine) -> ReferenceEngine:
    """Give a target engine a live sequence and garbage in its free blocks."""
    g = torch.Generator().manual_seed(5)
    for t in e.pool.layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    e.add_request("live", [3] * 21)
    e.step(["live"])
    return e


@pytest.mark.parametrize("staging", ["held", "streamed"])
def test_page_in_refusals_through_the_mount_change_nothing(live_session, staging):
    mnt = live_session
    for case, (kw, edit, exc, field) in REFUSALS.items():
        sess = mnt / f"s-{case.replace(' ', '-')}"
        pffs("fork", mnt / "a", sess)
        if edit is not None:
            edit(sess)
        kw = {"seed": SEED, **kw}
        if staging == "streamed":
            probe = ReferenceEngine(**{k: v for k, v in kw.items() if k != "num_blocks"}, num_blocks=2)
            kw["staging_bytes"] = 2 * probe.pool.page_bytes  # smaller than the session: verify, then stream
        target = _busy(ReferenceEngine(**kw))
        layers = target.pool.clone_layers()
        free = target.allocator.free_list()
        refs = {b: target.allocator.refcount(b) for b in range(target.pool.num_blocks)}
        live = target.seq_blocks()
        with pytest.raises(exc) as ei:
            target.page_in(sess)
        msg = str(ei.value)
        if isinstance(field, str):
            assert ei.value.field == field and field in msg, case
        elif isinstance(field, int):
            assert ei.value.page_ix == field and page_name(field) in msg, case
        if exc is IncompleteSession:
            assert ei.value.missing == [2] and "000002" in msg
        if exc is NoFreeBlocks:
            assert ei.value.errno == errno.ENOSPC and "need 6" in msg
        assert all(torch.equal(x, y) for x, y in zip(layers, target.pool.layers)), case
        assert target.allocator.free_list() == free, case
        assert {b: target.allocator.refcount(b) for b in range(target.pool.num_blocks)} == refs, case
        assert target.seq_blocks() == live, case
    # The untouched original still pages in.
    assert ReferenceEngine(seed=SEED).page_in(mnt / "a") == IDS


def test_the_mount_refuses_a_manifest_of_another_page_layout(live_session):
    # The page layout is checked by the filesystem already: the edit fails and
    # the previous manifest.json stays, so the session still pages in.
    mnt = live_session
    mnt.allow("refused manifest")
    pffs("fork", mnt / "a", mnt / "s")
    good = (mnt / "s" / "manifest.json").read_bytes()
    with pytest.raises(OSError) as ei:
        _edit_manifest(mnt / "s", lambda m: m.update(layout="paged-other-v9"))
    assert ei.value.errno == errno.EINVAL
    assert (mnt / "s" / "manifest.json").read_bytes() == good
    assert "layout" in mnt.log_text()
    assert ReferenceEngine(seed=SEED).page_in(mnt / "s") == IDS


def test_page_out_onto_an_existing_session_is_refused(live_session):
    mnt = live_session
    e, _ = decoded("f32", steps=2)
    before = (mnt / "a" / "manifest.json").read_bytes()
    names = sorted(os.listdir(mnt.path))
    with pytest.raises(FileExistsError):
        e.page_out(mnt / "a")
    (mnt / "empty").mkdir()
    with pytest.raises(FileExistsError):
        e.page_out(mnt / "empty")
    assert (mnt / "a" / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(mnt.path)) == sorted(names + ["empty"])  # no temp folder left
    assert os.listdir(mnt / "empty") == []
    assert stats(mnt)["sessions"] == 1


# ------------------------------------------------------------------ demo


def test_pffs_demo_command(tmp_path):
    store, mp = tmp_path / "store", tmp_path / "kv"
    try:
        r = pffs("demo", "--store", store, "--mountpoint", mp, "--tokens", 8, timeout=300)
        assert "matched bit for bit" in r.stdout, r.stdout
        assert is_mounted(mp)  # the demo leaves its mount up
        pid = int(dict(line.split(" ", 1) for line in (mp / ".pffs" / "version").read_text().splitlines())["pid"])
        assert (mp / "demo" / "a" / "manifest.json").exists()
        pffs("umount", mp)
        assert not is_mounted(mp)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"daemon {pid} still running after pffs umount")
    finally:
        if is_mounted(mp):
            lazy_unmount(mp)
    log = (store / "pffs.log").read_text(errors="replace") if (store / "pffs.log").exists() else ""
    assert not [l for l in log.splitlines() if " WARNING " in l or " ERROR " in l or "Traceback" in l]
    check = pffs("check", "--store", store)
    assert "0 damaged" in check.stdout and "3 sessions" in check.stdout
