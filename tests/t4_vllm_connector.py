"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
The vLLM connector through vLLM's real Scheduler, block pool and KV views.

Requests save their KV as sessions in a real pffs mount by name; the
sessions are forked with real ``cp -r`` and ``pffs fork``; fresh engines
(other KV layouts, kernel block splitting) start requests from them.  Every
refusal leaves vLLM's block pool as it was.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from engine_bridge import Bridge, RefCountingAllocator
from engine_bridge.core.pool import KVPool
from mountutil import pffs
from vllm_helpers import BLOCK, D, H, L, Engine, kv_of

PROMPT = [(i * 37 + 11) % 1000 for i in range(40)]


def page_bytes_of(tokens: list[int], page: int, n_tokens: int) -> bytes:
    """Contract §1 bytes of page *page* of a sequence whose KV is :func:`kv_of`."""
    k = torch.zeros((L, BLOCK, H, D), dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for layer in range(L):
        for slot in range(BLOCK):
            pos = page * BLOCK + slot
            if pos < n_tokens:
                kv = kv_of(layer, pos, tokens[pos])
                k[layer, slot], v[layer, slot] = kv[:, :D], kv[:, D:]
    return k.view(torch.uint8).numpy().tobytes() + v.view(torch.uint8).numpy().tobytes()


def assert_holds_computed_kv(eng: Engine, rid: str, tokens: list[int], n: int) -> None:
    blocks = eng.blocks_of(rid)
    for pos in range(n):
        for layer in range(L):
            assert torch.equal(eng.kv_at(layer, blocks[pos // BLOCK], pos % BLOCK),
                               kv_of(layer, pos, tokens[pos])), (rid, pos, layer)


def save(tmp_path, root, name="agent-a", **kw) -> tuple[Engine, list[int]]:
    eng = Engine(tmp_path, root, **kw)
    free0 = eng.free
    rid = eng.add(PROMPT, {"pffs_save": name}, max_tokens=3)
    # Step until the request finishes: its blocks are then held for the save.
    while rid not in eng.outputs:
        eng.step()
    assert eng.outputs[rid] == {"pffs_save": name, "pffs_save_scheduled": 42}
    assert eng.free == free0 - 3, "the finished request's blocks were not held for its save"
    eng.run(rid)
    assert eng.free == free0 and not eng.sched.requests
    return eng, PROMPT + [7, 7]


def test_connector_is_vllms_own_from_its_module_path(tmp_path):
    eng = Engine(tmp_path, tmp_path)
    assert type(eng.sched.connector).__name__ == "PffsConnector"
    assert type(eng.worker).__module__ == "engine_bridge.vllm.connector"


def test_save_fork_and_load_through_a_mount(tmp_path, mount_factory):
    mnt = mount_factory()
    eng, tokens = save(tmp_path, mnt.path)
    sess = mnt / "agent-a"
    m = json.loads((sess / "manifest.json").read_bytes())
    assert m["logical_seqs"][0]["token_ids"] == tokens[:42]
    assert (m["page_size_tokens"], m["n_layers"], m["n_heads"], m["head_dim"], m["dtype"]) \
        == (BLOCK, L, H, D, "bf16")
    assert m["engine"]["name"] == "vllm" and m["engine"]["kv_layout"] == "vllm LBNHC cpu vec16"
    assert m["model"]["name"].endswith("tiny-llama")
    assert len(m["pages"]) == 3 and m["logical_seqs"][0]["fill_in_last_page"] == 42 % BLOCK
    # Byte-exact contract pages, and sha256sum agrees with the manifest.
    for i in range(3):
        data = (sess / "pages" / f"{i:06d}").read_bytes()
        assert data == page_bytes_of(tokens, i, 42), f"page {i}"
    out = subprocess.run(["sha256sum"] + [f"pages/{i:06d}" for i in range(3)], cwd=sess,
                         capture_output=True, text=True, check=True).stdout.split()
    assert ["sha256:" + h for h in out[0::2]] == m["pages"]

    # The reference bridge of the same geometry pages it in.
    pool = KVPool.allocate(num_blocks=8, block_size=BLOCK, n_layers=L, n_heads=H, head_dim=D,
                           dtype=torch.bfloat16)
    got = Bridge(pool, RefCountingAllocator(8)).page_in(sess)
    buf = torch.empty((3, pool.page_bytes), dtype=torch.uint8)
    pool.gather(pool.block_index(got.seqs[0].block_ids), buf)
    assert [bytes(buf[i].numpy()) for i in range(3)] == [page_bytes_of(tokens, i, 42) for i in range(3)]

    # Forks by cp -r and pffs fork; fresh engines of other layouts start from them.
    subprocess.run(["cp", "-r", str(sess), str(mnt / "agent-b")], check=True)
    pffs("fork", sess, mnt / "agent-c")
    for name, layout, kernel in (("agent-b", "BHLNC", None), ("agent-c", "LBNHC", 8)):
        e2 = Engine(tmp_path, mnt.path, layout=layout, kernel=kernel)
        free0 = e2.free
        prompt = tokens[:42] + [5, 6, 7, 8, 9]
        rid = e2.add(prompt, {"pffs_load": name}, max_tokens=2)
        e2.until_scheduled(rid)
        # Two full pages (32 tokens) came from the session; the model computed from 32 on.
        assert [(j.page_ixs, len(j.block_ids)) for j in e2.loads] == [([0, 1], 2)]
        assert e2.computed[rid][0] == 32
        assert_holds_computed_kv(e2, rid, prompt, len(prompt))
        assert e2.run(rid) == {"pffs_loaded": 32}
        assert e2.free == free0

        # The same prompt again: vLLM's prefix cache serves it; nothing is loaded.
        rid2 = e2.add(prompt, {"pffs_load": name}, max_tokens=1)
        e2.step()
        assert len(e2.loads) == 1 and e2.computed[rid2][0] == 32
        assert e2.run(rid2) == {"pffs_loaded": 0}
        assert e2.free == free0
    mnt.stop()
    r = pffs("check", "--store", mnt.store, "--read-data", check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def refused(eng: Engine, prompt, params, why: str) -> None:
    free0 = eng.free
    rid = eng.add(prompt, params, max_tokens=2)
    out = eng.run(rid)
    assert why in out.get("pffs_error", ""), out
    assert eng.free == free0, f"{params}: the block pool lost {free0 - eng.free} blocks"
    assert not eng.loads, eng.loads


def test_refusals_leave_the_block_pool_as_it_was(tmp_path, mount_factory):
    mnt = mount_factory()
    _, tokens = save(tmp_path, mnt.path, "agent-a")
    before = {p.name: p.read_bytes() for p in (mnt / "agent-a" / "pages").iterdir()}
    eng = Engine(tmp_path, mnt.path)
    # Saves: an existing name, a bad name, a missing folder.
    refused(eng, PROMPT, {"pffs_save": "agent-a"}, "exists")
    refused(eng, PROMPT, {"pffs_save": "../x"}, "not a session name")
    refused(eng, PROMPT, {"pffs_save": "no/such/folder"}, "no folder")
    assert {p.name: p.read_bytes() for p in (mnt / "agent-a" / "pages").iterdir()} == before
    # Loads: no such session, other geometry, an incomplete session.
    refused(eng, tokens, {"pffs_load": "nothing"}, "no such file")
    other = json.loads((mnt / "agent-a" / "manifest.json").read_bytes())
    other["n_heads"] = 4
    (mnt / "wide").mkdir()
    (mnt / "wide" / "manifest.json").write_text(json.dumps(other))
    pages = mnt / "wide" / "pages"
    refused(eng, tokens, {"pffs_load": "wide"}, "n_heads mismatch")
    other = json.loads((mnt / "agent-a" / "manifest.json").read_bytes())
    other["model"]["name"] = "someone/else"
    pffs("fork", mnt / "agent-a", mnt / "elsewhere")
    (mnt / "elsewhere" / "manifest.json").write_text(json.dumps(other))
    refused(eng, tokens, {"pffs_load": "elsewhere"}, "model.name mismatch")
    assert not pages.exists() or not any(pages.iterdir())


def test_a_missing_page_is_computed_instead(tmp_path, mount_factory):
    """The scheduler reads a session's manifest, not its pages: a page that is
    not there fails the load on the worker's lane, and vLLM computes the
    blocks it was to fill; the response says so."""
    mnt = mount_factory()
    _, tokens = save(tmp_path, mnt.path, "agent-a")
    pffs("fork", mnt / "agent-a", mnt / "holey")
    (mnt / "holey" / "pages" / "000001").unlink()
    eng = Engine(tmp_path, mnt.path)
    free0 = eng.free
    prompt = tokens[:42] + [1, 2]
    rid = eng.add(prompt, {"pffs_load": "holey"}, max_tokens=2)
    out = eng.run(rid)
    assert [j.page_ixs for j in eng.loads] == [[0, 1]]
    assert out == {"pffs_loaded": 0, "pffs_error": "pffs_load 'holey': 2 page(s) failed to load "
                   "and were computed instead"}, out
    assert sorted(eng.computed[rid])[:32] == list(range(32))
    assert eng.free == free0


def test_a_page_that_fails_its_digest_is_computed_instead(tmp_path, mount_factory):
    """A page whose bytes no longer match manifest.json is never used: vLLM
    is told its blocks failed to load and recomputes them."""
    mnt = mount_factory()
    _, tokens = save(tmp_path, mnt.path, "agent-a")
    bad = tmp_path / "plain"
    subprocess.run(["cp", "-r", str(mnt / "agent-a"), str(bad)], check=True)
    p = bad / "pages" / "000001"
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    p.write_bytes(bytes(data))
    eng = Engine(tmp_path, tmp_path)
    free0 = eng.free
    prompt = tokens[:42] + [1, 2]
    rid = eng.add(prompt, {"pffs_load": "plain"}, max_tokens=3)
    eng.until_scheduled(rid)
    assert [j.page_ixs for j in eng.loads] == [[0, 1]]
    # vLLM recomputed the blocks the load was to fill: the KV is the model's own.
    assert eng.computed[rid][0] == 0
    assert_holds_computed_kv(eng, rid, prompt, len(prompt))
    assert "2 page(s) failed to load" in eng.run(rid)["pffs_error"]
    assert eng.free == free0


def test_two_requests_saving_one_name_one_wins(tmp_path):
    """Two requests that finish in the same step with the same pffs_save: the
    first saves, the second is refused (the name is taken while the first's
    page-out runs), and the pool gets every block back."""
    eng = Engine(tmp_path, tmp_path)
    free0 = eng.free
    a = eng.add(PROMPT, {"pffs_save": "twin"}, max_tokens=2)
    b = eng.add(PROMPT[::-1], {"pffs_save": "twin"}, max_tokens=2)
    eng.run(a)
    eng.run(b)
    said = [eng.outputs[a], eng.outputs[b]]
    assert said[0] == {"pffs_save": "twin", "pffs_save_scheduled": 41}
    assert "exists" in said[1]["pffs_error"]
    assert eng.free == free0
    m = json.loads((tmp_path / "twin" / "manifest.json").read_bytes())
    assert m["logical_seqs"][0]["token_ids"] == PROMPT + [7]


def test_a_save_runs_to_its_end_without_further_steps(tmp_path):
    """Once the step after the request's last carried its save to the worker,
    the page-out ends on the save lane with no more steps: the session
    appears, and vLLM learns it at its next step."""
    from pffs.client.wait import SAVED, wait
    eng = Engine(tmp_path, tmp_path)
    rid = eng.add(PROMPT, {"pffs_save": "alone"}, max_tokens=2)
    while rid not in eng.outputs:
        eng.step()
    assert not (tmp_path / "alone").exists()
    eng.step()              # (carries the save job)
    assert wait(tmp_path / "alone", timeout=60) == (SAVED, "")
    eng.run(rid)
    assert not eng.sched.requests


def test_a_lora_session_serves_only_its_adapter(tmp_path):
    """A request's LoRA adapter is recorded in the manifest; a load by a
    request of another adapter, or of none, is refused in one line."""
    from vllm.lora.request import LoRARequest
    eng = Engine(tmp_path, tmp_path)
    ada = LoRARequest("ada", 1, "/adapters/ada")
    rid = eng.add(PROMPT, {"pffs_save": "tuned"}, max_tokens=2, lora_request=ada)
    assert eng.run(rid)["pffs_save_scheduled"] == 41
    m = json.loads((tmp_path / "tuned" / "manifest.json").read_bytes())
    assert m["inputs"] == {"lora": {"name": "ada", "path": "/adapters/ada"}}
    prompt = PROMPT + [7, 1]
    refused(eng, prompt, {"pffs_load": "tuned"}, "saved with another LoRA adapter")
    other = LoRARequest("bob", 2, "/adapters/bob")
    free0 = eng.free
    rid = eng.add(prompt, {"pffs_load": "tuned"}, max_tokens=2, lora_request=other)
    assert "another LoRA adapter" in eng.run(rid)["pffs_error"]
    assert eng.free == free0 and not eng.loads
    fresh = Engine(tmp_path, tmp_path)     # (eng's prefix cache holds ada's blocks of the prompt)
    rid = fresh.add(prompt, {"pffs_load": "tuned"}, max_tokens=2, lora_request=ada)
    assert fresh.run(rid) == {"pffs_loaded": 32}


def test_other_weights_are_refused_and_an_unfingerprinted_session_loads_when_trusted(tmp_path):
    """Every session the connector saves carries its weights fingerprint: an engine of
    other weights refuses it, naming both.  A session whose manifest does not say which
    weights wrote it loads only for a request that trusts it (``"pffs_trust": true``),
    on the scheduler's check and the worker's."""
    from vllm_helpers import WEIGHTS
    _, tokens = save(tmp_path, tmp_path, "agent-a")
    m = json.loads((tmp_path / "agent-a" / "manifest.json").read_bytes())
    assert m["model"]["weights_sha256"] == WEIGHTS
    prompt = tokens[:42] + [5, 6]
    other = "4f" * 32
    refused(Engine(tmp_path, tmp_path, extra={"weights_sha256": other}), prompt,
            {"pffs_load": "agent-a"},
            f"model.weights_sha256 mismatch: session has {WEIGHTS!r}, engine has {other!r}")

    subprocess.run(["cp", "-r", str(tmp_path / "agent-a"), str(tmp_path / "bare")], check=True)
    del m["model"]["weights_sha256"]
    (tmp_path / "bare" / "manifest.json").write_text(json.dumps(m))
    refused(Engine(tmp_path, tmp_path), prompt, {"pffs_load": "bare"}, '"pffs_trust": true')
    eng = Engine(tmp_path, tmp_path)
    rid = eng.add(prompt, {"pffs_load": "bare", "pffs_trust": True}, max_tokens=2)
    eng.until_scheduled(rid)
    assert [j.page_ixs for j in eng.loads] == [[0, 1]]
    assert eng.computed[rid][0] == 32
    assert_holds_computed_kv(eng, rid, prompt, len(prompt))
    assert eng.run(rid) == {"pffs_loaded": 32}


def test_a_model_without_a_weights_fingerprint_is_refused_at_start(tmp_path):
    """The model folder holds no weight file and no fingerprint is given: one line."""
    with pytest.raises(ValueError, match="no weight files found for model .*tiny-llama.*weights_sha256"):
        Engine(tmp_path, tmp_path, extra={"weights_sha256": ""})
