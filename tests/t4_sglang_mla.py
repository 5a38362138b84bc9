"""Level t4, engines: SGLang 0.5.23's real HiCache code with a multi-head latent
attention cache (its ``MLATokenToKVPool`` and ``MLATokenToKVPoolHost``) and
PffsHiCacheStorage as the L3 tier, in a real pffs mount.

The workarounds a machine without an accelerator needs live in tests/sglang_cpu.py
(test code only).  In each host layout (page_first_direct, page_first, layer_first)
pages SGLang writes through are SPEC §1.1 pages, exactly the bytes built by hand from
the compressed KV and its rotary part, under their token chain keys in MLA's own key
namespace; a fresh cache prefetches them back bit for bit; a named session of them
has pages of the §1.1 size.  MHA keys of the same tokens never meet MLA pages, nor the
other way round.  At tensor parallel 2 rank 1 reads the whole latent and stores
nothing, answering success; rank 0 stores.
"""

from __future__ import annotations

import json
import os

import pytest
import sglang_cpu  # (its install(), on the first cache built, imports SGLang: setup.sh installs it)
import torch
from mountutil import pffs

from pffs import manifest as mf
from pffs.client import chainkeys as ck
from pffs.client.prefix_lookup import longest_prefix
from pffs.types import digest_of

pytestmark = pytest.mark.timeout(600)

CFG = "c1" * 32       # the model identity's config_sha256 (no model folder: SGLang's "dummy")
WEIGHTS = "5f" * 32   # and its weights_sha256
L, T, RANK, ROPE = 2, 16, 128, 32        # layers, tokens a page, kv_lora_rank, qk_rope_head_dim
LATENT = RANK + ROPE
PAGE = L * T * LATENT * 2                # SPEC §1.1 page bytes (bf16)
LAYOUTS = ["page_first_direct", "page_first", "layer_first"]


def backend(mnt, **more) -> dict:
    return {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
            "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mnt.path),
            "config_sha256": CFG, "weights_sha256": WEIGHTS, **more}


def mla_cache(mnt, layout="page_first_direct", extra=None, storage=True):
    hc = sglang_cpu.make_hicache(page_size=T, n_layers=L, dtype=torch.bfloat16, layout=layout,
                                 storage_backend="dynamic" if storage else None,
                                 backend_extra_config=backend(mnt, **(extra or {})) if storage else None,
                                 mla=True, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    assert type(hc.host_pool).__name__ == "MLATokenToKVPoolHost"
    if storage:
        assert hc.controller.storage_config.is_mla_model
        assert type(hc.storage).__name__ == "PffsHiCacheStorage"
    return hc


def insert_latent(hc, tokens, seed):
    """Random compressed KV and rotary rows for *tokens*, put in SGLang's device pool as
    its attention does (one row a token: its get_value_buffer is the compressed part)
    and inserted into the radix cache; returns (nope, rope, the latent rows)."""
    nope, rope = sglang_cpu.random_latent(hc, len(tokens), seed=seed)
    latent = torch.cat([nope, rope], dim=-1)
    slots = hc.insert(tokens, latent)
    for layer in range(L):      # (SGLang's own reading of the row: compressed KV first)
        assert torch.equal(hc.kv_pool.get_value_buffer(layer)[slots, 0], nope[layer])
    return nope, rope, latent


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def digest(b: bytes) -> str:
    return str(digest_of(b))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_are_spec_pages_and_a_fresh_cache_prefetches_them_bit_for_bit(mount_factory, tmp_path,
                                                                                 layout):
    mnt = mount_factory()
    tokens = list(range(2000, 2048))                       # 3 pages of 16
    keys = ck.chain_keys(tokens, T)
    with mla_cache(mnt, layout) as hc:
        st = hc.storage
        t = st.template
        assert (t.attention, t.n_heads, t.head_dim, t.n_layers, t.page_size_tokens, t.dtype) == \
            ("mla", 1, LATENT, L, T, "bf16")
        assert (t.kv["kv_lora_rank"], t.kv["qk_rope_head_dim"]) == (RANK, ROPE)
        assert st.page_bytes == t.page_bytes == PAGE
        nope, rope, latent = insert_latent(hc, tokens, seed=1)
        writes = hc.wait_storage_writes()
        assert writes and all(w.complete for w in writes)
        pages = sglang_cpu.mla_page_bytes(nope, rope, T)   # SPEC §1.1, built by hand
        assert [len(p) for p in pages] == [PAGE] * 3
        assert hc.page_keys(tokens) == keys
        space = st.space
        assert longest_prefix(mnt.path, space, keys) == [digest(p) for p in pages]
        assert [st.blobs.get(digest(p)) for p in pages] == pages
    template = mnt.path / ".hicache" / f"{space}.json"
    m = mf.parse(template.read_bytes())
    assert m.attention == "mla" and ck.manifest_namespace(json.loads(template.read_bytes())) == space

    with mla_cache(mnt, layout) as fresh:                 # a new cache, the same store
        idx = fresh.prefetch(tokens)
        assert len(idx) == len(tokens)
        assert torch.equal(bits(fresh.host_latent(idx)), bits(latent))
        if layout != "page_first":      # (get_data_page of page_first is token-major)
            assert fresh.host_page_bytes(idx) == pages
        slots = fresh.load_back(tokens)
        assert torch.equal(bits(fresh.device_latent(slots)), bits(latent))

    # A named session of SGLang's MLA pages: page files of the §1.1 size and bytes.
    (tmp_path / "t.json").write_text(json.dumps(tokens + [7]))
    r = pffs("from-tokens", mnt.path / "chat", "--tokens", tmp_path / "t.json", "--like", template)
    assert "3 pages (48 tokens)" in r.stdout
    folder = mnt.path / "chat" / "pages"
    names = sorted(os.listdir(folder))
    assert [os.stat(folder / n).st_size for n in names] == [PAGE] * 3
    assert [(folder / n).read_bytes() for n in names] == pages
    assert json.loads((mnt.path / "chat" / "manifest.json").read_bytes())["attention"] == "mla"


def test_mla_and_mha_keys_of_the_same_tokens_never_meet(mount_factory):
    """MLA pages are in MLA's own key namespace: the same model, geometry and tokens keyed
    as MHA (attention "mha") miss them, and an MHA cache whose pages have the same byte
    size neither hits SGLang's MLA pages nor has its own pages hit by the MLA cache."""
    mnt = mount_factory()
    tokens = list(range(6000, 6032))
    other = list(range(7000, 7032))
    with mla_cache(mnt) as hc:
        nope, rope, _ = insert_latent(hc, tokens, seed=2)
        hc.wait_storage_writes()
        space, t = hc.storage.space, hc.storage.template
    keys = ck.chain_keys(tokens, T)
    assert len(longest_prefix(mnt.path, space, keys, touch=False)) == 2
    as_mha = ck.key_namespace(t.model, dtype=t.dtype, n_layers=t.n_layers, n_heads=t.n_heads,
                              head_dim=t.head_dim, page_size_tokens=t.page_size_tokens, kv=t.kv,
                              layout=t.layout, attention="mha")
    assert as_mha != space
    assert longest_prefix(mnt.path, as_mha, keys, touch=False) == []
    # SGLang MHA with pages of the very same size (2 x 1 head x LATENT/2 values).
    mha = dict(page_size=T, n_layers=L, n_heads=1, head_dim=LATENT // 2, dtype=torch.bfloat16,
               storage_backend="dynamic", backend_extra_config=backend(mnt))
    with sglang_cpu.make_hicache(**mha) as m:
        assert m.storage.page_bytes == PAGE and m.storage.space != space
        assert len(m.prefetch(tokens)) == 0
        m.insert(other, *sglang_cpu.random_kv(m, len(other), seed=3))
        m.wait_storage_writes()
        assert m.storage.batch_exists(ck.chain_keys(other, T)) == 2
    with mla_cache(mnt) as hc:
        assert len(hc.prefetch(other)) == 0
        assert hc.storage.batch_exists(ck.chain_keys(other, T)) == 0
        assert hc.host_page_bytes(hc.prefetch(tokens)) == sglang_cpu.mla_page_bytes(nope, rope, T)


def storage_config(mnt, tp_rank, tp_size, **more):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    fields = dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                  model_name=None, extra_config=backend(mnt))
    return HiCacheStorageConfig(**{**fields, **more})


def test_at_tensor_parallel_2_every_rank_reads_the_whole_latent_and_rank_0_alone_stores(mount_factory):
    sglang_cpu.install()
    from engine_bridge.sglang import PffsHiCacheStorage

    mnt = mount_factory()
    tokens = list(range(5000, 5032))
    with mla_cache(mnt) as hc:
        nope, rope, latent = insert_latent(hc, tokens, seed=4)
        hc.wait_storage_writes()
        space = hc.storage.space
    keys, new = ck.chain_keys(tokens, T), ck.chain_keys(list(range(9, 41)), T)
    idx = torch.arange(2 * T, dtype=torch.int64)
    with mla_cache(mnt, layout="layer_first", storage=False) as r1, \
            mla_cache(mnt, layout="page_first", storage=False) as r0:
        rank1 = PffsHiCacheStorage(storage_config(mnt, 1, 2), {})
        rank1.register_mem_pool_host(r1.host_pool)
        assert rank1.space == space                        # the whole latent: the same namespace
        assert rank1.batch_get_v1(keys, idx) == [True, True]
        assert torch.equal(bits(r1.host_latent(idx)), bits(latent))
        assert rank1.batch_set_v1(new, idx) == [True, True]  # success, as SGLang's backends say...
        assert rank1.batch_exists(new) == 0                  # ...and nothing stored
        rank1.close()
        rank0 = PffsHiCacheStorage(storage_config(mnt, 0, 2), {})
        rank0.register_mem_pool_host(r0.host_pool)
        assert rank0.space == space
        assert rank0.batch_get_v1(keys, idx) == [True, True]
        assert torch.equal(bits(r0.host_latent(idx)), bits(latent))
        assert rank0.batch_set_v1(new, idx) == [True, True]
        assert longest_prefix(mnt.path, space, new, touch=False) == \
            [digest(p) for p in sglang_cpu.mla_page_bytes(nope, rope, T)]
        rank0.close()
    with pytest.raises(ValueError, match="MLA with attention context parallel"):
        PffsHiCacheStorage(storage_config(mnt, 0, 2, attn_cp_size=2), {})


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_the_legacy_interface_stores_and_loads_the_same_mla_pages(mount_factory, layout):
    """Without interface_v1 SGLang hands the backend flat MLA page copies: the same
    SPEC §1.1 blobs under the same keys, which a zero-copy cache loads too."""
    mnt = mount_factory()
    tokens = list(range(4000, 4048))
    with mla_cache(mnt, layout, extra={"interface_v1": 0}) as hc:
        assert hc.controller.page_set_func.__name__ == "_generic_page_set"
        nope, rope, latent = insert_latent(hc, tokens, seed=6)
        hc.wait_storage_writes()
        pages = sglang_cpu.mla_page_bytes(nope, rope, T)
        assert longest_prefix(mnt.path, hc.storage.space, ck.chain_keys(tokens, T)) == \
            [digest(p) for p in pages]
    with mla_cache(mnt, layout, extra={"interface_v1": 0}) as fresh:
        assert fresh.controller.page_get_func.__name__ == "_generic_page_get"
        idx = fresh.prefetch(tokens)
        assert torch.equal(bits(fresh.host_latent(idx)), bits(latent))
    with mla_cache(mnt) as v1:
        assert v1.host_page_bytes(v1.prefetch(tokens)) == pages
