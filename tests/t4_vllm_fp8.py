"""Level t4, engines: vLLM's real engine (the CPU build) with an fp8 KV cache
(``kv_cache_dtype`` fp8_e4m3 and fp8_e5m2, kept by vLLM as uint8, quantized by
its CPU kernels at each layer's scales) saves fp8 pages with their scales, and
a fresh engine loads them to the tokens and logprobs of the saving engine's own
continuation from its prefix cache; a session of other scales is refused."""

from __future__ import annotations

import json
import subprocess

import pytest

from t4_vllm_engine import P, session_pages, wait_saved
from vllm_real import VllmEngine

pytestmark = [pytest.mark.timeout(900), pytest.mark.skipif(
    not any(f in open("/proc/cpuinfo").read().split() for f in ("avx512f", "amx_tile")),
    reason="vLLM's CPU build keeps an fp8 KV cache only on x86 with AVX-512 or AMX; this host has neither")]


@pytest.mark.parametrize("cache_dtype, page", [("fp8_e4m3", "fp8e4m3"), ("fp8_e5m2", "fp8e5m2")])
def test_fp8_pages_save_and_load_with_their_scales(tmp_path, mount_factory, cache_dtype, page):
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, kv_cache_dtype=cache_dtype) as a:
        s = a.one(P, {"pffs_save": "agent-a"}, max_tokens=8)
        assert s["kv"] == {"pffs_save": "agent-a", "pffs_save_scheduled": 107}, s
        wait_saved(mnt / "agent-a")
        m = json.loads((mnt / "agent-a" / "manifest.json").read_bytes())
        # (a random checkpoint has no KV scales: vLLM quantizes at 1.0, written null)
        assert (m["dtype"], m["kv"]["scales"]) == (page, None)
        size = 2 * m["n_layers"] * m["page_size_tokens"] * m["n_heads"] * m["head_dim"]
        assert (mnt / "agent-a" / "pages" / "000000").stat().st_size == size      # (1 byte a value)
        q = P + s["tokens"][:7] + [5, 6]
        ref = a.one(q, max_tokens=8)            # (its prefix cache holds P's pages)
    subprocess.run(["cp", "-r", str(mnt / "agent-a"), str(mnt / "agent-b")], check=True)
    subprocess.run(["cp", "-r", str(mnt / "agent-a"), str(mnt / "scaled")], check=True)
    m["kv"]["scales"] = {"k": [0.5] * m["n_layers"], "v": [1.0] * m["n_layers"]}
    (mnt / "scaled" / "manifest.json").write_text(json.dumps(m))
    with VllmEngine(tmp_path, mnt.path, kv_cache_dtype=cache_dtype) as b:
        got = b.one(q, {"pffs_load": "agent-b"}, max_tokens=8)
        assert got["kv"] == {"pffs_loaded": 96}, got
        assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"])
        assert set(session_pages(mnt / "agent-b")[:3]) <= set(b.digests()[0])
        b.reset()
        out = b.one(q, {"pffs_load": "scaled"}, max_tokens=2)
        err = out["kv"].get("pffs_error", "")
        assert "kv.scales" in err and "0.5" in err, out
