"""Example manifests, good and bad, shared by the model tests and the mount tests."""

from __future__ import annotations

import copy
import json

D = ["sha256:" + f"{i:02x}" * 32 for i in range(4)]


def good() -> dict:
    return {
        "layout": "paged-batchinvariant-v1",
        "page_size_tokens": 16, "n_layers": 2, "n_heads": 2, "head_dim": 8,
        "dtype": "bf16",
        "pages": list(D[:3]),
        "logical_seqs": [
            {"id": "req-17", "page_ixs": [0, 1, 2], "fill_in_last_page": 7,
             "token_ids": list(range(100, 100 + 39))},
        ],
        "model": {"name": "tiny", "revision": "r1", "config_sha256": "ab" * 32},
        "kv": {"k_has_rope": True, "scales": None},
        "engine": {"name": "reference", "kv_layout": "flash_attn NHD", "block_size": 16},
    }


def _with(**changes) -> bytes:
    d = good()
    for k, v in changes.items():
        if v is _DEL:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps(d).encode()


def _seq(**changes) -> bytes:
    d = good()
    s = d["logical_seqs"][0]
    for k, v in changes.items():
        if v is _DEL:
            s.pop(k)
        else:
            s[k] = v
    return json.dumps(d).encode()


_DEL = object()

# (name, bytes, field the error must name)
BAD = [
    ("bad-json", b'{"layout": "paged-batchinvariant-v1", ', "manifest"),
    ("not-object", b"[1, 2, 3]", "manifest"),
    ("unknown-dtype", _with(dtype="bf17"), "dtype"),
    ("missing-dtype", _with(dtype=_DEL), "dtype"),
    ("negative-layers", _with(n_layers=-1), "n_layers"),
    ("zero-heads", _with(n_heads=0), "n_heads"),
    ("missing-head-dim", _with(head_dim=_DEL), "head_dim"),
    ("missing-page-size", _with(page_size_tokens=_DEL), "page_size_tokens"),
    ("string-geometry", _with(n_layers="32"), "n_layers"),
    ("bool-geometry", _with(n_layers=True), "n_layers"),
    ("float-geometry", _with(head_dim=128.0), "head_dim"),
    ("huge-geometry", _with(n_layers=1 << 19, n_heads=1 << 19), "geometry"),
    ("dim-over-cap", _with(n_layers=1 << 21), "n_layers"),
    ("unknown-layout", _with(layout="paged-v0"), "layout"),
    ("missing-pages", _with(pages=_DEL), "pages"),
    ("pages-not-list", _with(pages="sha256:00"), "pages"),
    ("bad-digest", _with(pages=["sha256:xyz"]), "pages[0]"),
    ("upper-digest", _with(pages=["sha256:" + "AB" * 32]), "pages[0]"),
    ("page-ix-out-of-range", _seq(page_ixs=[0, 1, 3]), "page_ixs[2]"),
    ("page-ix-negative", _seq(page_ixs=[-1, 0, 1]), "page_ixs[0]"),
    ("fill-out-of-range", _seq(fill_in_last_page=16), "fill_in_last_page"),
    ("fill-negative", _seq(fill_in_last_page=-1), "fill_in_last_page"),
    ("token-count-mismatch", _seq(token_ids=[1, 2, 3]), "token_ids"),
    ("negative-token", _seq(token_ids=[-5] * 39), "token_ids[0]"),
    ("seq-id-path", _seq(id="../../etc"), "id"),
    ("seq-id-missing", _seq(id=_DEL), "id"),
    ("seqs-not-list", _with(logical_seqs={"a": 1}), "logical_seqs"),
    ("model-not-object", _with(model="llama"), "model"),
    ("kv-rope-not-bool", _with(kv={"k_has_rope": "yes"}), "kv.k_has_rope"),
    ("page-table-bad-key", _with(pages={"x": D[0]}), "pages"),
]


def oversize() -> bytes:
    d = good()
    d["padding"] = "x" * (64 << 20)
    return json.dumps(d).encode()


def seed_form() -> bytes:
    d = good()
    d["pages"] = {"2": D[2], "0": D[0], "1": D[1]}
    return json.dumps(d).encode()


def good_bytes() -> bytes:
    return json.dumps(good()).encode()


def clone(d: dict) -> dict:
    return copy.deepcopy(d)
