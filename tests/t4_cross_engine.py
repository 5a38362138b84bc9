"""Level t4, engines: sessions move between real engines on one checkpoint.

vLLM (the CPU build, with the PffsConnector), Hugging Face transformers
continuous batching and SGLang's HiCache (its radix cache, host pool and
cache controller, with PffsHiCacheStorage as L3) run tests/vllm_engine.py's
random Llama folder in bf16 with pages of 32, through a real pffs mount.
Each engine names the model the same way (the folder's config and weights
fingerprint), so a session saved by one is loaded by another without
``force``.  A load is judged by the tokens that follow it against the target
engine computing the same tokens itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from t4_vllm_true_kv import BLOCK, D, H, L, P, hf_kv, model_folder, wait_saved
from vllm_real import VllmEngine

from pffs.client import chainkeys as ck
from pffs.manifest import page_name

pytestmark = pytest.mark.timeout(1200)

N = 16          # tokens generated after a load, and by the recomputing engine
# The continuations are greedy runs of two bf16 computations of one model, whose
# logprobs differ by bf16 rounding: on these tokens transformers' eager and sdpa
# attention (the same weights, both bf16) differ by 0.27 at most, and bf16 and f32
# by 0.32.  Where the model's two best tokens are closer than that, either run may
# take either (the runs here part after 14 tokens each, at f32 margins of 0.050
# and 0.008).  So the tokens must be the same up to the first step where they
# part, which must be a near tie (f32 margin below TIE), and at least SAME of the
# N.  Logprobs of the same tokens within LOGPROBS (seen: 0.21 vLLM -> transformers,
# 0.07 transformers -> vLLM).
TIE, SAME = 0.1, 8
LOGPROBS = 0.35


def transformers_engine(folder: str):
    """transformers' continuous batching on the folder's weights (bf16, pages of 32)."""
    from transformers import LlamaForCausalLM

    from engine_bridge.transformers.transformers_adapter import TransformersEngine
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    return TransformersEngine(model, num_blocks=16, page_size=BLOCK, max_batch_tokens=256)


def f32_margins(folder: str, prompt: list[int], continuation: list[int]) -> list[float]:
    """The gap between the two best logprobs that the model (transformers, f32)
    has at each step of *continuation* after *prompt*."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:-1]
    top = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def assert_same_continuation(folder: str, prompt: list[int], got: list[int], want: list[int],
                             got_lp: list, want_lp: list, what: str) -> None:
    """*got* (after a load) is *want* (recomputed) but where bf16 rounding decides a near tie."""
    same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    parted = ""
    if same < len(want):
        margin = f32_margins(folder, prompt, want)[same]
        assert same >= SAME and margin < TIE, (
            f"{what}: the tokens part at step {same}, where the model's two best are "
            f"{margin:.3f} apart: {got} against {want}")
        parted = f" (then a tie: the two best {margin:.3f} apart)"
    diff = max(abs(a - b) for a, b in zip(got_lp[:same], want_lp[:same]))
    print(f"{what}: {same} of {len(want)} tokens the same{parted}, logprobs differ by {diff:.4f} at most")
    assert diff < LOGPROBS, what


def identity(model: dict) -> dict:
    """What two engines must agree on to take each other's sessions (``revision`` is
    vLLM's ``None`` for a local folder, which the check skips)."""
    return {k: model[k] for k in ("name", "config_sha256", "weights_sha256")}


def saved_by_vllm(tmp_path: Path, mnt, name: str) -> tuple[dict, list[int]]:
    """vLLM's real engine runs P and saves it as *name*: the manifest and its tokens."""
    with VllmEngine(tmp_path, mnt.path) as e:
        s = e.one(P, {"pffs_save": name}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107
        wait_saved(mnt / name)
    m = json.loads((mnt / name / "manifest.json").read_bytes())
    tokens = m["logical_seqs"][0]["token_ids"]
    assert tokens == P + s["tokens"][:7]
    return m, tokens


def test_a_vllm_session_continues_in_transformers(tmp_path, mount_factory):
    """vLLM saves a request by name; transformers pages it in and generates the
    tokens it generates when it computes the session's tokens itself."""
    mnt = mount_factory()
    m, tokens = saved_by_vllm(tmp_path, mnt, "v")
    folder = model_folder(tmp_path)

    t = transformers_engine(folder)
    assert identity(t.model_identity) == identity(m["model"])
    [rid] = t.page_in(mnt / "v")
    got, got_lp = t.generate([rid], N)

    ref = transformers_engine(folder)
    ref.add_request("r", tokens)
    want, want_lp = ref.generate(["r"], N)
    assert_same_continuation(folder, tokens, got[rid], want["r"], got_lp[rid], want_lp["r"],
                             "vLLM -> transformers")


def test_a_transformers_session_loads_into_vllm(tmp_path, mount_factory):
    """transformers prefills 3 full pages and 5 tokens and pages out; vLLM loads
    the full pages by name for a longer prompt and generates what it generates
    computing that prompt itself."""
    mnt = mount_factory()
    folder = model_folder(tmp_path)
    t = transformers_engine(folder)
    prompt = P[:3 * BLOCK + 5]
    t.add_request("t", prompt)
    t.step(["t"])                                       # the prefill: KV of every prompt token
    m = t.page_out(mnt / "t")
    assert m.logical_seqs[0].token_ids == prompt and len(m.pages) == 4

    q = prompt + [5, 6, 7]
    with VllmEngine(tmp_path, mnt.path) as e:
        ref = e.one(q, max_tokens=N)
        e.reset()
        got = e.one(q, {"pffs_load": "t"}, max_tokens=N)
    assert got["kv"] == {"pffs_loaded": 96}, got
    assert_same_continuation(folder, q, got["tokens"], ref["tokens"], got["logprobs"], ref["logprobs"],
                             "transformers -> vLLM")


def test_a_vllm_session_is_found_by_sglang_by_its_tokens(tmp_path, mount_factory):
    """vLLM saves a request; SGLang, given only the model folder, finds its full
    pages by SGLang's own chain keys of a prompt starting with its tokens and
    prefetches them: its host pool holds the session's page bytes, which are
    transformers' K and V of those tokens up to vLLM's own computation (cosine
    at least 0.999; 0.9998 seen)."""
    import sglang_cpu
    mnt = mount_factory()
    m, tokens = saved_by_vllm(tmp_path, mnt, "v")
    folder = model_folder(tmp_path)

    q = tokens + [5, 6]                                 # 3 full pages the session holds
    backend = {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
               "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mnt.path)}
    with sglang_cpu.make_hicache(page_size=BLOCK, n_layers=L, n_heads=H, head_dim=D,
                                 dtype=torch.bfloat16, storage_backend="dynamic",
                                 backend_extra_config=backend, model_path=folder) as hc:
        st = hc.storage
        assert st.identity == {k: m["model"][k] for k in ("config_sha256", "weights_sha256")}
        assert st.space == ck.manifest_namespace(m)
        keys = hc.page_keys(q)
        assert keys == ck.chain_keys(tokens, BLOCK)[:3]
        assert st.batch_exists(keys) == 3
        got = hc.host_page_bytes(hc.prefetch(q))
    assert got == [(mnt / "v" / "pages" / page_name(i)).read_bytes() for i in range(3)]

    k, v = hf_kv(folder, tokens)
    least = 1.0
    for i, raw in enumerate(got):
        page = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(2, L, BLOCK, H, D)
        span = slice(i * BLOCK, (i + 1) * BLOCK)
        for kv, ref in ((0, k), (1, v)):
            for layer in range(L):
                cos = torch.nn.functional.cosine_similarity(
                    page[kv, layer].float().flatten(), ref[layer, span].flatten(), dim=0).item()
                assert cos >= 0.999, f"page {i} {'KV'[kv]} layer {layer}: cosine {cos:.5f}"
                least = min(least, cos)
    print(f"vLLM -> SGLang: 3 pages bit-equal, least cosine to transformers' K/V {least:.5f}")


def test_a_vllm_mla_session_is_found_by_sglangs_mla_pool_by_its_tokens(tmp_path, mount_factory):
    """Latent attention across engines: vLLM's real CPU engine saves a DeepSeek-V2
    request as SPEC §1.1 pages; SGLang's MLA host pool (``MLATokenToKVPoolHost``),
    given only the model folder, finds its full pages by SGLang's own chain keys in
    MLA's key namespace, prefetches them bit for bit into its host pool and loads
    them back into its device pool (``MLATokenToKVPool``) as SGLang's attention
    reads them: compressed KV first, then the rotary part."""
    import sglang_cpu
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, kind="deepseek", native_rope=True) as e:
        s = e.one(P, {"pffs_save": "ds"}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107
        wait_saved(mnt / "ds")
        folder = str(e.model)
    m = json.loads((mnt / "ds" / "manifest.json").read_bytes())
    assert m["attention"] == "mla"
    tokens = m["logical_seqs"][0]["token_ids"]
    block, rank, rope = m["page_size_tokens"], m["kv"]["kv_lora_rank"], m["kv"]["qk_rope_head_dim"]
    full = len(tokens) // block
    q = tokens + [5, 6]
    backend = {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
               "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mnt.path)}
    with sglang_cpu.make_hicache(page_size=block, n_layers=m["n_layers"], dtype=torch.bfloat16,
                                 storage_backend="dynamic", backend_extra_config=backend,
                                 model_path=folder, mla=True, kv_lora_rank=rank,
                                 qk_rope_head_dim=rope) as hc:
        st = hc.storage
        assert st.space == ck.manifest_namespace(m)
        keys = hc.page_keys(q)
        assert keys[:full] == ck.chain_keys(tokens, block)[:full]
        assert st.batch_exists(keys) == full
        got = hc.host_page_bytes(hc.prefetch(q))
        slots = hc.load_back(q)
        latent = hc.device_latent(slots[:full * block])
    want = [(mnt / "ds" / "pages" / page_name(i)).read_bytes() for i in range(full)]
    assert got == want
    pages = torch.frombuffer(bytearray(b"".join(want)), dtype=torch.bfloat16).view(
        full, m["n_layers"], block, rank + rope)
    assert torch.equal(latent.view(torch.int16),
                       pages.permute(1, 0, 2, 3).reshape(m["n_layers"], full * block, -1).view(torch.int16))
