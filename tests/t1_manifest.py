"""Level t1, units: no mount and no engine.
Manifest model: every contract §2/§3.3 rule, with a bad example each."""

from __future__ import annotations

import json

import pytest

import manifests as ex
from pffs import manifest as mf


def test_good_manifest_parses():
    m = mf.parse(ex.good_bytes())
    assert m.pages == ex.D[:3]
    assert m.page_bytes == 2 * 2 * 16 * 2 * 8 * 2
    assert m.logical_seqs[0].n_tokens(16) == 39
    assert m.model["name"] == "tiny" and m.kv["k_has_rope"] is True
    assert m.engine["kv_layout"] == "flash_attn NHD"


@pytest.mark.parametrize("name,data,field", ex.BAD, ids=[b[0] for b in ex.BAD])
def test_bad_manifest_refused(name, data, field):
    with pytest.raises(mf.ManifestError) as ei:
        mf.parse(data)
    assert field in ei.value.field, (ei.value.field, ei.value.reason)
    assert ei.value.reason


def test_oversize_refused():
    with pytest.raises(mf.ManifestError, match="cap"):
        mf.parse(ex.oversize())


def test_seed_page_table_form_read_in_id_order():
    m = mf.parse(ex.seed_form())
    assert m.pages == ex.D[:3]
    d = ex.good()
    d["page_table"] = d.pop("pages")
    assert mf.parse(json.dumps(d)).pages == ex.D[:3]


def test_unknown_keys_and_identity_kept():
    d = ex.good()
    d["note"] = {"who": "me"}
    m = mf.parse(json.dumps(d))
    assert m.extra == {"note": {"who": "me"}}
    again = mf.parse(m.to_json())
    assert again.to_dict() == m.to_dict()


def test_canonical_writer_roundtrip():
    m = mf.parse(ex.good_bytes())
    out = m.to_json()
    assert out.endswith(b"\n")
    assert json.loads(out)["pages"] == ex.D[:3]
    assert mf.parse(out).to_json() == out
    # One page digest per line, so diff and grep work on manifests.
    assert sum(1 for line in out.splitlines() if b"sha256:" in line and b"config" not in line) == 3


def test_geometry_page_bytes():
    for dtype, size in mf.DTYPE_SIZES.items():
        assert mf.page_bytes(32, 16, 8, 128, dtype) == 2 * 32 * 16 * 8 * 128 * size


def test_page_names():
    assert mf.page_name(3) == "000003"
    assert mf.page_name(1234567) == "1234567"
    assert mf.parse_page_name("000003") == 3
    assert mf.parse_page_name(b"1234567") == 1234567
    for bad in ["3", "00003", "0000003", "00000a", "000003.tmp", ".000003", b"\xff"]:
        assert mf.parse_page_name(bad) is None


def test_empty_sequence_and_no_token_ids():
    d = ex.good()
    d["logical_seqs"].append({"id": "empty", "page_ixs": [], "fill_in_last_page": 0})
    del d["logical_seqs"][0]["token_ids"]
    m = mf.parse(json.dumps(d))
    assert m.logical_seqs[0].token_ids is None
    assert m.logical_seqs[1].n_tokens(16) == 0
