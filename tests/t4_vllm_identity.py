"""Level t4, engines: vLLM's real engine (the CPU build) with the PffsConnector, on
two model folders of one config and one name and other weights (save_pretrained
from two seeds), in a real pffs mount.

A session saved by one is refused by the other, by name, naming both weights
fingerprints: the request computes its prompt, and its tokens are the engine's
own.  A prefix lookup by tokens in the other engine finds nothing, though the
index holds the session's pages under the first one's namespace.
"""

from __future__ import annotations

import json

import pytest

from engine_bridge.core.identity import weights_sha256_of_folder
from mountutil import pffs
from pffs.client import chainkeys as ck
from pffs.client.prefix_lookup import longest_prefix
from vllm_real import VllmEngine

pytestmark = pytest.mark.timeout(900)

P = [(i * 37 + 11) % 997 for i in range(100)]        # 3 full pages of 32, and 4 tokens
SAME_NAME = {"model_name": "org/llama"}


def test_a_session_of_other_weights_is_refused_and_never_a_prefix_hit(tmp_path, mount_factory):
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, extra=SAME_NAME) as a:
        s = a.one(P, {"pffs_save": "base"}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107
        r = pffs("wait", mnt.path / "base", "--timeout", "120", check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        base_model = a.model
    m = json.loads((mnt.path / "base" / "manifest.json").read_bytes())
    mine = weights_sha256_of_folder(base_model)
    assert m["model"]["name"] == "org/llama" and m["model"]["weights_sha256"] == mine
    q = P + s["tokens"][:7] + [5, 6]
    keys = ck.chain_keys(q[:-1], 32)
    assert len(longest_prefix(mnt.path, ck.manifest_namespace(m), keys)) == 3

    with VllmEngine(tmp_path, mnt.path, extra=SAME_NAME, seed=1) as b:
        assert (b.model / "config.json").read_bytes() == (base_model / "config.json").read_bytes()
        theirs = weights_sha256_of_folder(b.model)
        assert theirs != mine
        ref = b.one(q, max_tokens=8)                      # its own computation
        b.reset()
        got = b.one(q, {"pffs_load": "base"}, max_tokens=8)
        assert got["kv"].get("pffs_loaded", 0) == 0, got
        assert got["kv"]["pffs_error"] == (f"pffs_load 'base': model.weights_sha256 mismatch: "
                                           f"session has {mine!r}, engine has {theirs!r}")
        assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"])
        b.reset()
        byp = b.one(q, {"pffs_load_prefix": True}, max_tokens=8)
        assert byp["kv"] == {"pffs_loaded": 0}, byp
        assert (byp["tokens"], byp["logprobs"]) == (ref["tokens"], ref["logprobs"])
