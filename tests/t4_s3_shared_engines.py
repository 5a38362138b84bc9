"""Level t4, engines: one cache for many hosts.  Two mounts of one bucket on a real
SeaweedFS server, each with its own cache folder (as on two hosts): vLLM's real
engine beside mount A saves a request; beside mount B a fresh vLLM engine asking
for the longest prefix it can load (``pffs_load_prefix``) loads it by its tokens
alone, to the tokens and logprobs of A's own continuation, and SGLang's real
host pool (HiCache, PffsHiCacheStorage) finds and prefetches the same pages by
SGLang's own chain keys, bit for bit.  No session was pushed or pulled: the
token-chain index is shared through the bucket (pffs.bucket.shared_index)."""

from __future__ import annotations

import json

import pytest
import torch
from seaweed import s3_mounts, weed  # noqa: F401  (fixtures)
from t4_vllm_true_kv import BLOCK, D, H, L, P, model_folder, wait_saved
from vllm_real import VllmEngine

from pffs.client import chainkeys as ck
from pffs.manifest import page_name

pytestmark = pytest.mark.timeout(900)


def test_engines_beside_another_mount_of_the_bucket_find_pages_by_tokens(tmp_path, weed, s3_mounts):
    import sglang_cpu
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b = s3_mounts("a", url), s3_mounts("b", url)
    with VllmEngine(tmp_path, a.path) as ea:
        s = ea.one(P, {"pffs_save": "chat"}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107, s
        wait_saved(a.path / "chat")
        q = P + s["tokens"][:7] + [5, 6]
        ref = ea.one(q, max_tokens=8)           # (from its prefix cache)
    m = json.loads((a.path / "chat" / "manifest.json").read_bytes())
    assert not (b.path / "chat").exists()
    with VllmEngine(tmp_path, b.path) as eb:
        got = eb.one(q, {"pffs_load_prefix": True}, max_tokens=8)
    assert got["kv"] == {"pffs_loaded": 96}, got
    assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"])

    # SGLang beside mount B, given the model folder: its keys find A's pages.
    tokens = m["logical_seqs"][0]["token_ids"]
    backend = {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
               "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(b.path)}
    with sglang_cpu.make_hicache(page_size=BLOCK, n_layers=L, n_heads=H, head_dim=D,
                                 dtype=torch.bfloat16, storage_backend="dynamic",
                                 backend_extra_config=backend, model_path=model_folder(tmp_path)) as hc:
        assert hc.storage.space == ck.manifest_namespace(m)
        keys = hc.page_keys(tokens + [1, 2])
        assert hc.storage.batch_exists(keys) == 3
        pages = hc.host_page_bytes(hc.prefetch(tokens + [1, 2]))
    assert pages == [(a.path / "chat" / "pages" / page_name(i)).read_bytes() for i in range(3)]
