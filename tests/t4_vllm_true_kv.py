"""Level t4, engines: vLLM sessions hold the model's K and V (SPEC §1), whatever
kernel packed them, and move between vLLM's CPU kernels and other engines.

vLLM's CPU attention keeps a head's block as a K region then a V region,
packed for its kernel (AMX tiles, or column-major K for the vector
kernels).  Pages are checked against the K and V Hugging Face transformers
computes for the same weights and tokens; loads across kernels and engines
are judged by the continuation against recomputing.  A kernel other than
the host's is vLLM's own, chosen in the engine by tests/vllm_engine.py
(``isa``) as its attention builder would on another host.  This host has
no AMX: an AMX engine's blocks are written by vLLM's own AMX cache-writing
kernel (``cpu_attn_reshape_and_cache``), the one an AMX engine writes with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mountutil import pffs
from vllm_real import VllmEngine, needs_avx512

pytestmark = pytest.mark.timeout(1200)

P = [(i * 37 + 11) % 997 for i in range(100)]        # 3 full pages of 32, and 4 tokens
BLOCK, L, H, D = 32, 2, 4, 64                         # (tests/vllm_engine.py's random Llama)


def model_folder(tmp_path: Path) -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_engine import model_dir
    return model_dir(str(tmp_path.parent / "random-llama-h4"), 4)


def hf_kv(folder: str, tokens: list[int], dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[L, T, H, D]`` of *tokens* as transformers' own Llama computes them."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    k = torch.stack([layer.keys[0] for layer in cache.layers]).transpose(1, 2)
    v = torch.stack([layer.values[0] for layer in cache.layers]).transpose(1, 2)
    return k, v


def session_kv(sess: Path) -> tuple[dict, list[torch.Tensor]]:
    """A session's manifest and each page as ``[2, L, N, H, D]`` bf16."""
    m = json.loads((sess / "manifest.json").read_bytes())
    pages = []
    for i in range(len(m["pages"])):
        raw = np.frombuffer((sess / "pages" / f"{i:06d}").read_bytes(), dtype=np.uint16).copy()
        pages.append(torch.from_numpy(raw).view(torch.bfloat16).view(2, L, BLOCK, H, D))
    return m, pages


def assert_pages_are(sess: Path, k: torch.Tensor, v: torch.Tensor, *, exact: bool = False) -> float:
    """Every page of *sess* against K and V ``[L, T, H, D]``; returns the least cosine."""
    m, pages = session_kv(sess)
    n = len(m["logical_seqs"][0]["token_ids"])
    least = 1.0
    for i, page in enumerate(pages):
        used = min(BLOCK, n - i * BLOCK)
        for kv, ref in ((0, k), (1, v)):
            want = ref[:, i * BLOCK:i * BLOCK + used]
            got = page[kv, :, :used]
            assert not page[kv, :, used:].any(), f"page {i}: slots past the sequence are not zeros"
            if exact:
                assert torch.equal(got, want.to(torch.bfloat16)), f"page {i} {'KV'[kv]}"
                continue
            for layer in range(L):
                cos = torch.nn.functional.cosine_similarity(
                    got[layer].float().flatten(), want[layer].float().flatten(), dim=0).item()
                least = min(least, cos)
                assert cos >= 0.999, f"page {i} {'KV'[kv]} layer {layer}: cosine {cos:.4f}"
    return least


def wait_saved(path: Path) -> None:
    r = pffs("wait", path, "--timeout", "120", check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("isa", [None, "vec16"])
def test_pages_are_the_models_kv_on_each_cpu_kernel(tmp_path, mount_factory, isa):
    """A saved request's pages are transformers' K and V of its tokens (cosine
    at least 0.999 every layer; slots past the end zeros), on the host's
    kernel and on another; the manifest names the kernel it was packed by."""
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, isa=isa) as e:
        s = e.one(P, {"pffs_save": "a"}, max_tokens=8)
        assert s["kv"]["pffs_save_scheduled"] == 107
        wait_saved(mnt / "a")
    m = json.loads((mnt / "a" / "manifest.json").read_bytes())
    assert m["engine"]["kv_layout"] == f"vllm LBHNC cpu {isa or 'vec'}"
    k, v = hf_kv(model_folder(tmp_path), m["logical_seqs"][0]["token_ids"])
    assert_pages_are(mnt / "a", k, v)


@needs_avx512
def test_sessions_move_between_cpu_kernels_and_from_an_amx_engine(tmp_path, mount_factory):
    """A session saved by vLLM on the vec16 kernel, and one held by an AMX
    engine (its blocks written by vLLM's own AMX kernel, page-out through the
    connector's pool), each start a request on the host's vector kernel with
    the tokens of recomputing it there."""
    from engine_bridge.core.bridge import Bridge, SeqBlocks
    from engine_bridge.core.pool import VllmKVPool
    from engine_bridge.vllm.packing import cpu_packing
    from vllm import _custom_ops as ops
    mnt = mount_factory()
    with VllmEngine(tmp_path, mnt.path, isa="vec16") as e16:
        s = e16.one(P, {"pffs_save": "k16"}, max_tokens=8)
        wait_saved(mnt / "k16")
    m = json.loads((mnt / "k16" / "manifest.json").read_bytes())
    tokens = m["logical_seqs"][0]["token_ids"]          # (107: P and 7 of its tokens)
    assert tokens == P + s["tokens"][:7]

    # The same tokens' KV as an AMX engine holds it: written by vLLM's AMX
    # kernel into a pool of its layout, paged out as the connector pages out.
    k, v = hf_kv(model_folder(tmp_path), tokens, torch.bfloat16)
    pool = VllmKVPool.allocate_vllm(num_blocks=8, block_size=BLOCK, n_layers=L, n_heads=H, head_dim=D,
                                    dtype=torch.bfloat16, order="LBHNC",
                                    packing=cpu_packing("amx", torch.bfloat16, BLOCK, D))
    for layer, t in enumerate(pool.layers):
        kc, vc = t.view(8, H, 2 * BLOCK, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k[layer], v[layer], kc, vc, torch.arange(len(tokens)), "amx",
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    raw = pool.layers[0][0, 0, 0, :4].clone()
    assert not torch.equal(raw, k[0, 0, 0, :4]), "the AMX kernel kept K in token order"
    bridge = Bridge(pool, None, engine_name="vllm", model=m["model"])
    bridge.page_out([SeqBlocks("amx", [0, 1, 2, 3], len(tokens), tokens)], mnt / "amx")
    assert_pages_are(mnt / "amx", k, v, exact=True)

    q = tokens + [5, 6] + P[:20]
    with VllmEngine(tmp_path, mnt.path) as e:
        ref = e.one(q, max_tokens=8)
        for name in ("k16", "amx"):
            e.reset()
            got = e.one(q, {"pffs_load": name}, max_tokens=8)
            assert got["kv"] == {"pffs_loaded": 96}, got
            assert got["tokens"] == ref["tokens"], name
            # (transformers' K/V differ from vLLM's own in bf16 rounding: 0.09
            # at most seen here; packed bytes read as K/V differ by 1.2-2.0)
            assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])) < 0.25, name
