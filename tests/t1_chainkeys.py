"""Level t1, units: no mount and no engine.
Token chain keys (SPEC §7) against a hand computation with hashlib: the
chain, the u32 and the wide u64 page, the seed, the short last page, and
namespaces that part when the model, dtype, geometry or KV conventions do."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pffs.client import chainkeys as ck


def by_hand(tokens: list[int], page: int, seed: bytes = b"") -> list[str]:
    out, prior = [], seed
    for start in range(0, len(tokens) // page * page, page):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[start:start + page])
        prior = hashlib.sha256(prior + body).digest()
        out.append(prior.hex())
    return out


def test_keys_chain_sha256_of_the_prior_digest_and_the_pages_u32_tokens():
    toks = list(range(1000, 1048))
    keys = ck.chain_keys(toks, 16)
    assert keys == by_hand(toks, 16)
    assert len(keys) == 3 and all(len(k) == 64 for k in keys)
    # the first page alone: sha256 of its 64 bytes, nothing before them
    assert keys[0] == hashlib.sha256(struct.pack("<16I", *toks[:16])).hexdigest()
    # the prior key goes in as its 32 raw bytes, not its hex text
    assert keys[1] == hashlib.sha256(bytes.fromhex(keys[0]) + struct.pack("<16I", *toks[16:32])).hexdigest()
    assert keys[1] != hashlib.sha256(keys[0].encode() + struct.pack("<16I", *toks[16:32])).hexdigest()


def test_a_short_last_page_has_no_key_and_a_key_names_the_whole_prefix():
    toks = list(range(40))
    assert len(ck.chain_keys(toks, 16)) == 2
    assert ck.chain_keys(toks[:15], 16) == []
    other = [7] + toks[1:]
    # the same second page after another first page is another key
    assert ck.chain_keys(other, 16)[1] != ck.chain_keys(toks, 16)[1]
    assert ck.chain_keys(toks[:32], 16) == ck.chain_keys(toks, 16)


def test_a_page_with_a_token_past_u32_is_hashed_wide_with_a_tag_byte():
    big = 2**32 + 5
    toks = list(range(16)) + [big] + list(range(15))
    keys = ck.chain_keys(toks, 16)
    assert keys[0] == by_hand(toks[:16], 16)[0]           # the first page stays u32
    want = hashlib.sha256(bytes.fromhex(keys[0]) + b"\xff" + struct.pack("<16Q", *toks[16:])).hexdigest()
    assert keys[1] == want
    assert ck.chain_keys([2**32 - 1] * 4, 4) == by_hand([2**32 - 1] * 4, 4)   # the u32 maximum is not wide
    with pytest.raises(ValueError):
        ck.chain_keys([2**63] * 4, 4)
    with pytest.raises(ValueError):
        ck.chain_keys([-1] * 4, 4)


def test_a_seed_starts_the_chain_and_sglangs_seed_is_its_namespace_digest():
    toks = list(range(32))
    assert ck.sglang_seed() == b""
    seed = ck.sglang_seed("lora-a", None)
    h = hashlib.sha256(b"sglang-cache-namespace-v1")
    h.update(b"\x01" + (6).to_bytes(8, "little") + b"lora-a")
    h.update(b"\x00")
    assert seed == h.digest()
    assert ck.chain_keys(toks, 16, seed) == by_hand(toks, 16, seed)
    assert ck.chain_keys(toks, 16, seed) != ck.chain_keys(toks, 16)
    assert ck.sglang_seed("a", "") != ck.sglang_seed("a", None) != ck.sglang_seed(None, "a")


GEOM = dict(dtype="bf16", n_layers=2, n_heads=4, head_dim=8, page_size_tokens=16,
            kv={"k_has_rope": True, "scales": None})
MODEL = {"name": "m/x", "revision": "r1"}


def test_the_namespace_parts_when_model_dtype_geometry_or_kv_conventions_do():
    base = ck.key_namespace(MODEL, **GEOM)
    assert base == ck.key_namespace(dict(MODEL), **dict(GEOM))
    assert len(base) == 64
    changed = [
        ck.key_namespace({"name": "m/y", "revision": "r1"}, **GEOM),
        ck.key_namespace({"name": "m/x", "revision": "r2"}, **GEOM),
        ck.key_namespace(MODEL, **{**GEOM, "dtype": "f16"}),
        ck.key_namespace(MODEL, **{**GEOM, "n_layers": 3}),
        ck.key_namespace(MODEL, **{**GEOM, "n_heads": 8}),
        ck.key_namespace(MODEL, **{**GEOM, "head_dim": 16}),
        ck.key_namespace(MODEL, **{**GEOM, "page_size_tokens": 32}),
        ck.key_namespace(MODEL, **{**GEOM, "kv": {"k_has_rope": False, "scales": None}}),
        ck.key_namespace(None, **GEOM),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_a_config_sha256_names_the_model_whatever_its_name():
    a = ck.key_namespace({"name": "hub/x", "revision": "1", "config_sha256": "ab" * 32}, **GEOM)
    b = ck.key_namespace({"name": "mirror/x", "revision": "2", "config_sha256": "ab" * 32}, **GEOM)
    assert a == b != ck.key_namespace({"name": "hub/x", "revision": "1"}, **GEOM)


def manifest(**extra) -> dict:
    return {"page_size_tokens": 4, "n_layers": 1, "n_heads": 1, "head_dim": 2, "dtype": "f32",
            "pages": [f"sha256:{i:064x}" for i in range(4)], "model": MODEL, "kv": None,
            "logical_seqs": [{"id": "a", "page_ixs": [0, 1, 2], "fill_in_last_page": 2,
                              "token_ids": list(range(10))},
                             {"id": "b", "page_ixs": [0, 3], "token_ids": list(range(4)) + [9, 9, 9, 9]}],
            **extra}


def test_page_keys_give_each_full_page_of_each_sequence_once():
    m = manifest()
    keys = dict(ck.page_keys(m))
    assert sorted(keys) == [0, 1, 3]                  # page 2 is short
    assert [keys[0], keys[1]] == ck.chain_keys(list(range(8)), 4)
    assert keys[3] == ck.chain_keys(list(range(4)) + [9] * 4, 4)[1]
    assert ck.manifest_namespace(m) == ck.key_namespace(MODEL, "f32", 1, 1, 2, 4, None)


def test_a_manifest_with_inputs_or_without_tokens_gives_no_keys():
    assert ck.page_keys(manifest(inputs={"lora": "x"})) == []
    assert ck.page_keys(manifest(inputs={})) != []
    m = manifest()
    for s in m["logical_seqs"]:
        del s["token_ids"]
    assert ck.page_keys(m) == []
