"""Level t4, engines: SGLang 0.5.23's real HiCache code (radix cache, host KV pool, the
cache controller's write-through to L3 and prefetch back, its storage backend factory)
with PffsHiCacheStorage as the L3 tier, in a real pffs mount.

The workarounds a machine without an accelerator needs live in tests/sglang_cpu.py
(test code only).  Pages SGLang writes through land as SPEC §1 page bytes under their
token chain keys; a fresh cache prefetches them back byte for byte; a session vLLM's
real engine saved is hit by SGLang for a prompt starting with its tokens; a named
session is made of SGLang's pages (pffs from-tokens), forks and checks clean; three
threads call at once; a flipped blob is a miss; the key-only cache stays under its
limit and never drops a session's pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest
import sglang_cpu  # (its install(), on the first cache built, imports SGLang: setup.sh installs it)
import torch
from mountutil import pffs

from pffs import manifest as mf
from pffs.client import chainkeys as ck
from pffs.client.prefix_lookup import longest_prefix
from pffs.store.storedir import StoreDir
from pffs.types import digest_of

pytestmark = pytest.mark.timeout(600)

CFG = "c0" * 32       # the model identity's config_sha256 (no model folder: SGLang's "dummy")
WEIGHTS = "5e" * 32   # and its weights_sha256


def backend(mnt, **more) -> dict:
    return {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
            "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mnt.path),
            "config_sha256": CFG, "weights_sha256": WEIGHTS, **more}


def hicache(mnt, page_size=16, **kw):
    return sglang_cpu.make_hicache(page_size=page_size, n_layers=2, n_heads=4, head_dim=64,
                                   dtype=kw.pop("dtype", torch.bfloat16), storage_backend="dynamic",
                                   backend_extra_config=backend(mnt, **kw.pop("extra", {})), **kw)


def digest(b: bytes) -> str:
    return str(digest_of(b))


def test_pages_written_through_are_contract_pages_under_chain_keys_and_come_back(mount_factory, tmp_path):
    mnt = mount_factory()
    tokens = list(range(1000, 1064))                       # 4 pages of 16
    with hicache(mnt) as hc:
        assert type(hc.storage).__name__ == "PffsHiCacheStorage"
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=3)
        hc.insert(tokens, k, v)
        writes = hc.wait_storage_writes()
        assert writes and all(w.complete for w in writes)
        space = hc.storage.space
        pages = sglang_cpu.contract_page_bytes(k, v, 16)
        keys = ck.chain_keys(tokens, 16)
        assert hc.page_keys(tokens) == keys                 # SGLang's own keys are pffs's
        assert longest_prefix(mnt.path, space, keys) == [digest(p) for p in pages]
        blobs = hc.storage.blobs
        assert [blobs.get(digest(p)) for p in pages] == pages
    template = mnt.path / ".hicache" / f"{space}.json"
    assert json.loads(template.read_bytes())["model"] == {"config_sha256": CFG, "weights_sha256": WEIGHTS}

    with hicache(mnt) as fresh:                             # a new cache, the same store
        idx = fresh.prefetch(tokens)
        assert fresh.host_page_bytes(idx) == pages
        slots = fresh.load_back(tokens)
        dk, dv = fresh.device_kv(slots)
        assert torch.equal(dk, k) and torch.equal(dv, v)

    # A named session of SGLang's pages: found by tokens, forked, checked.
    (tmp_path / "t.json").write_text(json.dumps(tokens + [5, 6, 7]))
    r = pffs("from-tokens", mnt.path / "chat", "--tokens", tmp_path / "t.json", "--like", template)
    assert "4 pages (64 tokens)" in r.stdout
    subprocess.run(["cp", "-r", str(mnt.path / "chat"), str(mnt.path / "chat-fork")], check=True)
    got = [(mnt.path / "chat-fork" / "pages" / n).read_bytes()
           for n in sorted(os.listdir(mnt.path / "chat-fork" / "pages"))]
    assert got == pages
    assert json.loads(pffs("tokens", mnt.path / "chat-fork").stdout) == tokens
    mnt.stop()
    r = pffs("check", "--store", mnt.store, "--read-data", check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_prefetch_decodes_straight_into_the_host_pool_with_no_staging_copy(mount_factory):
    """page_first_direct at tensor parallel 1: each page's K and V are decoded
    straight into the host pool (the staging buffer is never asked for); a
    layer_first pool, a page in many short runs, goes through it."""
    mnt = mount_factory()
    tokens = list(range(5000, 5048))
    with hicache(mnt) as hc:
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=9)
        hc.insert(tokens, k, v)
        hc.wait_storage_writes()
        pages = sglang_cpu.contract_page_bytes(k, v, 16)
    for layout, staged in (("page_first_direct", False), ("layer_first", True)):
        with hicache(mnt, layout=layout) as fresh:
            st, asked = fresh.storage, []
            inner = st._staging
            st._staging = lambda: asked.append(1) or inner()
            idx = fresh.prefetch(tokens)
            assert len(idx) == len(tokens) and bool(asked) == staged, layout
            slots = fresh.load_back(tokens)
            dk, dv = fresh.device_kv(slots)
            assert torch.equal(dk, k) and torch.equal(dv, v)
            if layout == "page_first_direct":
                assert fresh.host_page_bytes(idx) == pages


def test_a_session_saved_by_vllm_is_a_hit_for_sglang_by_its_tokens(mount_factory, tmp_path):
    """vLLM's real engine saves a request (random Llama, bf16, pages of 32); SGLang, told
    the same model (its folder: the config's sha256 and the weights' fingerprint, as
    vLLM's connector computes them),
    prefetches the session's full pages for a prompt starting with its tokens: the host
    pool holds the session's page bytes."""
    from transformers import AutoConfig
    from vllm_real import VllmEngine

    from engine_bridge.core.identity import hf_config_sha256, weights_sha256_of_folder
    from engine_bridge.sglang.hicache import model_identity

    mnt = mount_factory()
    prompt = [(i * 37 + 11) % 997 for i in range(100)]
    with VllmEngine(tmp_path, mnt.path) as e:
        s = e.one(prompt, {"pffs_save": "from-vllm"}, max_tokens=8)
        r = pffs("wait", mnt.path / "from-vllm", "--timeout", "120", check=False)
        assert r.returncode == 0, r.stderr
    model = tmp_path.parent / "random-llama-h4"            # (tests/vllm_real.py's model folder)
    identity = model_identity(str(model), {})
    assert identity == {"config_sha256": hf_config_sha256(AutoConfig.from_pretrained(model)),
                        "weights_sha256": weights_sha256_of_folder(model)}
    session = json.loads((mnt.path / "from-vllm" / "manifest.json").read_bytes())
    q = prompt + s["tokens"][:7] + [5, 6]                  # 3 full pages the session holds
    with hicache(mnt, page_size=32, extra=identity) as hc:
        assert hc.storage.space == ck.manifest_namespace(session)
        idx = hc.prefetch(q)
        got = hc.host_page_bytes(idx)
        assert [digest(b) for b in got] == session["pages"][:3]
        assert got == [(mnt.path / "from-vllm" / "pages" / mf.page_name(i)).read_bytes() for i in range(3)]


def test_the_namespace_includes_the_weights_fingerprint(tmp_path):
    """Two model folders with one config and other weights: two identities, two key
    namespaces.  No weight file and no weights_sha256: refused, in one line."""
    sglang_cpu.install()
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine_bridge.sglang.hicache import model_identity
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    for seed in (0, 1):
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / f"m{seed}")
    a, b = (model_identity(str(tmp_path / f"m{seed}"), {}) for seed in (0, 1))
    assert a["config_sha256"] == b["config_sha256"] and a["weights_sha256"] != b["weights_sha256"]
    geom = dict(dtype="bf16", n_layers=2, n_heads=2, head_dim=8, page_size_tokens=16,
                kv={"k_has_rope": True, "scales": None})
    assert ck.key_namespace(a, **geom) != ck.key_namespace(b, **geom)
    # Extra config overrides the folder's.
    assert model_identity(str(tmp_path / "m0"), {"weights_sha256": WEIGHTS})["weights_sha256"] == WEIGHTS
    cfg.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="no weight files found .*weights_sha256"):
        model_identity(str(tmp_path / "bare"), {})


def cached_rows(mnt) -> tuple[int, int]:
    import sqlite3
    c = sqlite3.connect(f"file:{mnt.store / 'namespace.db'}?mode=ro", uri=True)
    try:
        return c.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM cached_keys").fetchone()
    finally:
        c.close()


SEQS = [list(range(10_000 * (i + 1), 10_000 * (i + 1) + 48)) for i in range(4)]   # 3 pages each
PAGE = 2 * 2 * 16 * 4 * 64 * 2                              # a page's bytes here


def test_three_threads_at_once_and_a_flipped_blob_is_a_miss(mount_factory):
    mnt = mount_factory()
    with hicache(mnt) as hc:
        kvs = {i: sglang_cpu.random_kv(hc, 48, seed=10 + i) for i in (1, 2, 3)}
        for i in (1, 2, 3):
            hc.insert(SEQS[i], *kvs[i])
        hc.wait_storage_writes()
    with hicache(mnt) as hc:
        st = hc.storage
        host = {i: hc.prefetch(SEQS[i]) for i in (1, 2, 3)}
        want = {i: sglang_cpu.contract_page_bytes(*kvs[i], 16) for i in (1, 2, 3)}
        assert all(hc.host_page_bytes(host[i]) == want[i] for i in (1, 2, 3))
        errors: list[str] = []

        def work(i: int) -> None:
            keys = ck.chain_keys(SEQS[i], 16)
            for _ in range(15):
                if st.batch_set_v1(keys, host[i]) != [True] * 3:
                    errors.append(f"set {i}")
                if st.batch_exists(keys) != 3:
                    errors.append(f"exists {i}")
                if st.batch_get_v1(keys, host[i]) != [True] * 3:
                    errors.append(f"get {i}")
        threads = [threading.Thread(target=work, args=(i,)) for i in (1, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and not any(t.is_alive() for t in threads)
        assert all(hc.host_page_bytes(host[i]) == want[i] for i in (1, 2, 3))

        # A flipped byte in a stored blob: a miss, and the host page is left as it was.
        keys = ck.chain_keys(SEQS[2], 16)
        first = longest_prefix(mnt.path, st.space, keys, touch=False)[0]
        path = StoreDir(mnt.store).blobs.path(first)
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
        assert st.batch_get_v1(keys, host[2]) == [False] * 3
        assert hc.host_page_bytes(host[2]) == want[2]
        assert st.batch_get_v1(ck.chain_keys(SEQS[1], 16), host[1]) == [True] * 3


def test_key_only_pages_stay_under_the_limit_and_a_sessions_pages_stay(mount_factory, tmp_path):
    mnt = mount_factory(opts=[f"prefix_cache_size={5 * PAGE}"])
    with hicache(mnt) as hc:
        st = hc.storage
        kv0 = sglang_cpu.random_kv(hc, 48, seed=10)
        hc.insert(SEQS[0], *kv0)
        hc.wait_storage_writes()
        (tmp_path / "s0.json").write_text(json.dumps(SEQS[0]))
        pffs("from-tokens", mnt.path / "kept", "--tokens", tmp_path / "s0.json", "--like",
             mnt.path / ".hicache" / f"{st.space}.json")
        for i in (1, 2, 3):
            hc.insert(SEQS[i], *sglang_cpu.random_kv(hc, 48, seed=10 + i))
            hc.wait_storage_writes()
        n, total = cached_rows(mnt)
        assert total <= 5 * PAGE and n == 5
        assert st.batch_exists(ck.chain_keys(SEQS[0], 16)) == 3
        assert st.batch_exists(ck.chain_keys(SEQS[3], 16)) == 3       # the newest stay
        assert st.batch_exists(ck.chain_keys(SEQS[1], 16)) == 0       # the oldest went
    # A fresh cache computes the session's tokens again and writes them through: the
    # store holds them (the session), so no key-only row is added and none evicted.
    with hicache(mnt) as hc:
        hc.insert(SEQS[0], *kv0)
        hc.wait_storage_writes()
        assert cached_rows(mnt)[0] == 5
        assert hc.storage.batch_exists(ck.chain_keys(SEQS[3], 16)) == 3
    pffs("gc", "--store", mnt.store, "--grace", "0")
    got = [(mnt.path / "kept" / "pages" / n).read_bytes() for n in sorted(os.listdir(mnt.path / "kept" / "pages"))]
    assert got == sglang_cpu.contract_page_bytes(*kv0, 16)


@pytest.mark.parametrize("layout", ["layer_first"])
def test_other_host_layouts_store_and_load_the_same_page_bytes(mount_factory, layout):
    """SGLang's layer_first host pool: the stored blobs are the same SPEC §1 pages
    (converted on the way), and a fresh page_first_direct cache loads them.  (page_first
    needs SGLang's kernel io backend, which has no CPU build: its conversion runs on a
    GPU host only.)"""
    mnt = mount_factory()
    tokens = list(range(3000, 3048))
    with hicache(mnt, layout=layout) as hc:
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=5)
        hc.insert(tokens, k, v)
        hc.wait_storage_writes()
        pages = sglang_cpu.contract_page_bytes(k, v, 16)
        assert longest_prefix(mnt.path, hc.storage.space, ck.chain_keys(tokens, 16)) == \
            [digest(p) for p in pages]
    with hicache(mnt) as fresh:
        assert fresh.host_page_bytes(fresh.prefetch(tokens)) == pages
    with hicache(mnt, layout=layout) as fresh:
        slots = fresh.load_back(tokens) if len(fresh.prefetch(tokens)) else None
        assert slots is not None
        dk, dv = fresh.device_kv(slots)
        assert torch.equal(dk, k) and torch.equal(dv, v)


def test_a_tensor_parallel_rank_reads_its_heads_of_whole_pages_and_stores_nothing(mount_factory):
    """At tensor parallel 2, rank 1's host pool (2 of 4 heads) gets heads 2 and 3 of the
    whole-head pages a 4-head SGLang stored; its own writes (a slice) are refused."""
    sglang_cpu.install()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from engine_bridge.sglang import PffsHiCacheStorage

    mnt = mount_factory()
    tokens = list(range(5000, 5032))
    with hicache(mnt) as hc:
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=9)
        hc.insert(tokens, k, v)
        hc.wait_storage_writes()
        space = hc.storage.space
    with sglang_cpu.make_hicache(page_size=16, n_layers=2, n_heads=2, head_dim=64, dtype=torch.bfloat16,
                                 storage_backend=None) as rank1:
        cfg = HiCacheStorageConfig(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                   is_page_first_layout=False, model_name=None,
                                   extra_config=backend(mnt))
        st = PffsHiCacheStorage(cfg, {})
        st.register_mem_pool_host(rank1.host_pool)
        assert st.space == space                            # whole-head pages: the same namespace
        idx = torch.arange(32, dtype=torch.int64)
        keys = ck.chain_keys(tokens, 16)
        assert st.batch_get_v1(keys, idx) == [True, True]
        half = sglang_cpu.contract_page_bytes(k[:, :, 2:].contiguous(), v[:, :, 2:].contiguous(), 16)
        assert rank1.host_page_bytes(idx) == half
        assert st.batch_set_v1(ck.chain_keys(list(range(7, 39)), 16), idx) == [False, False]
        st.close()


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_the_legacy_interface_stores_and_loads_the_same_pages(mount_factory, layout):
    """Without interface_v1 SGLang hands the backend flat page copies (batch_set) and
    dummy pages to fill (batch_get): the same SPEC §1 blobs under the same keys, which a
    zero-copy cache loads too."""
    mnt = mount_factory()
    tokens = list(range(4000, 4048))
    with hicache(mnt, layout=layout, extra={"interface_v1": 0}) as hc:
        assert hc.controller.page_set_func.__name__ == "_generic_page_set"
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=6)
        hc.insert(tokens, k, v)
        hc.wait_storage_writes()
        pages = sglang_cpu.contract_page_bytes(k, v, 16)
        assert longest_prefix(mnt.path, hc.storage.space, ck.chain_keys(tokens, 16)) == \
            [digest(p) for p in pages]
    with hicache(mnt, layout=layout, extra={"interface_v1": 0}) as fresh:
        assert fresh.controller.page_get_func.__name__ == "_generic_page_get"
        slots = fresh.load_back(tokens) if len(fresh.prefetch(tokens)) else None
        assert slots is not None
        dk, dv = fresh.device_kv(slots)
        assert torch.equal(dk, k) and torch.equal(dv, v)
    with hicache(mnt) as v1:
        assert v1.host_page_bytes(v1.prefetch(tokens)) == pages


@pytest.mark.parametrize("dtype, name", [(torch.float8_e4m3fn, "fp8e4m3"), (torch.float8_e5m2, "fp8e5m2")])
def test_fp8_pages_round_trip_with_their_scales(mount_factory, dtype, name):
    """SGLang keeps an fp8 cache as uint8 in its host pool: its pages are fp8 pages
    (the dtype --kv-cache-dtype names) whose bytes come back bit for bit, with the
    scales the extra config gives in the key namespace (null when all are 1.0)."""
    mnt = mount_factory()
    tokens = list(range(5000, 5032))
    scales = {"k": [0.5, 2.0], "v": [1.0, 4.0]}
    with hicache(mnt, dtype=dtype, extra={"kv_scales": scales}) as hc:
        assert hc.host_pool.dtype == torch.uint8
        t = hc.storage.template
        assert (t.dtype, t.kv["scales"]) == (name, scales)
        assert hc.storage.codec.name == "zstd-1"        # (1-byte values: no byte planes)
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=8)
        hc.insert(tokens, k, v)
        hc.wait_storage_writes()
        pages = sglang_cpu.contract_page_bytes(k, v, 16)
        assert len(pages[0]) == 2 * 2 * 16 * 4 * 64
        assert longest_prefix(mnt.path, hc.storage.space, ck.chain_keys(tokens, 16)) == \
            [digest(p) for p in pages]
        scaled = hc.storage.space
    with hicache(mnt, dtype=dtype, extra={"kv_scales": scales}) as fresh:
        slots = fresh.load_back(tokens) if len(fresh.prefetch(tokens)) else None
        assert slots is not None
        dk, dv = fresh.device_kv(slots)
        assert dk.view(torch.uint8).equal(k.view(torch.uint8)) and dv.view(torch.uint8).equal(v.view(torch.uint8))
    with hicache(mnt, dtype=dtype, extra={"kv_scales": {"k": [1.0, 1.0], "v": [1.0, 1.0]}}) as ones:
        assert ones.storage.template.kv["scales"] is None
        space_of_ones = ones.storage.space
    with hicache(mnt, dtype=dtype) as plain:
        assert plain.storage.space == space_of_ones != scaled
        assert len(plain.prefetch(tokens)) == 0     # (other scales: other keys, no hit)


def test_a_damaged_page_is_stored_again_by_its_next_write_through(mount_factory):
    """A page whose blob is damaged is a miss; the read sets the blob aside, so
    SGLang's write-through of the page computed again stores it afresh, and a
    later prefetch hits every page, byte for byte."""
    mnt = mount_factory()
    tokens = SEQS[0]
    with hicache(mnt) as hc:
        k, v = sglang_cpu.random_kv(hc, len(tokens), seed=31)
        hc.insert(tokens, k, v)
        hc.wait_storage_writes()
        space = hc.storage.space
    want = sglang_cpu.contract_page_bytes(k, v, 16)
    keys = ck.chain_keys(tokens, 16)
    second = longest_prefix(mnt.path, space, keys, touch=False)[1]
    path = StoreDir(mnt.store).blobs.path(second)
    frame = bytearray(path.read_bytes())
    frame[len(frame) // 2] ^= 0x40
    path.write_bytes(bytes(frame))
    with hicache(mnt) as hc:
        assert hc.host_page_bytes(hc.prefetch(tokens)) == want[:1]     # cut at the damaged page
    with hicache(mnt) as hc:                                           # computed again, written through
        hc.insert(tokens, k, v)
        assert all(w.complete for w in hc.wait_storage_writes())
    with hicache(mnt) as hc:
        assert hc.host_page_bytes(hc.prefetch(tokens)) == want
    assert StoreDir(mnt.store).blobs.get(second, rehash=True) == want[1]
