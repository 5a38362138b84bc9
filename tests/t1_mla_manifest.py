"""Level t1: latent-attention (MLA) manifests (SPEC §1.1): the attention field, its page
size, and its own key namespaces in the prefix index."""

from __future__ import annotations

import json

import pytest

from pffs import manifest as mf
from pffs.client import chainkeys as ck

DIGEST = "sha256:" + "ab" * 32


def mla(**more) -> dict:
    return {"attention": "mla", "page_size_tokens": 16, "n_layers": 2, "n_heads": 1, "head_dim": 576,
            "dtype": "bf16", "pages": [DIGEST], "logical_seqs": [],
            "kv": {"k_has_rope": True, "scales": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
            **more}


def test_an_mla_page_is_one_latent_array():
    m = mf.parse(json.dumps(mla()))
    assert (m.attention, m.page_bytes) == ("mla", 2 * 16 * 576 * 2)
    assert json.loads(m.to_json())["attention"] == "mla"
    kv = mf.parse(json.dumps({k: v for k, v in mla().items() if k != "attention"}))
    assert (kv.attention, kv.page_bytes) == ("mha", 2 * 2 * 16 * 576 * 2)
    assert "attention" not in json.loads(kv.to_json())     # (absent means mha: bytes kept)


@pytest.mark.parametrize("bad, field", [({"attention": "gqa"}, "attention"),
                                        ({"n_heads": 2}, "n_heads")])
def test_bad_mla_manifests_are_refused_naming_the_field(bad, field):
    with pytest.raises(mf.ManifestError) as e:
        mf.parse(json.dumps(mla(**bad)))
    assert e.value.field == field


def test_mla_pages_are_keyed_in_their_own_namespace():
    m = mla()
    plain = {k: v for k, v in m.items() if k != "attention"}
    assert ck.manifest_namespace(m) != ck.manifest_namespace(plain)
    assert ck.manifest_namespace({**plain, "attention": "mha"}) == ck.manifest_namespace(plain)
    assert ck.manifest_namespace(plain) == ck.key_namespace(None, "bf16", 2, 1, 576, 16, plain["kv"])


def test_page_in_refuses_the_other_attention_by_name():
    from engine_bridge.core.bridge import check_manifest
    from engine_bridge.errors import MismatchError
    geo = {"page_size_tokens": 16, "n_layers": 2, "n_heads": 1, "head_dim": 576, "dtype": "bf16"}
    with pytest.raises(MismatchError, match="attention mismatch: session has 'mla', engine has 'mha'"):
        check_manifest(mf.parse(json.dumps(mla())), geo, mla()["kv"], None)
    check_manifest(mf.parse(json.dumps(mla())), {**geo, "attention": "mla"}, mla()["kv"], None)
