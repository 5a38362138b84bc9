"""Level t4, engines: every engine's saved pages are the model's own K and V (SPEC §1).

A tiny random Llama, made with transformers' config class and saved with
``save_pretrained``, runs in each engine; the pages of a prompt of two or three pages
and a partial one are checked against the K/V that Hugging Face transformers computes
for the same weights and tokens (eager attention, ``use_cache=True``): the reference
engine (the checkpoint's state dict) and the transformers adapter (continuous batching)
to a cosine of 0.999 per layer, K and V apart; SGLang's host pool in each of its
layouts, written through to pffs from a device pool holding transformers' K/V, bit for
bit.  A partial page's slots past the prompt are zeros.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine  # noqa: E402
from pffs.manifest import page_name  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SEED = 23
# Grouped-query attention (6 query heads, 2 KV heads), 3 layers.
CONFIG = ModelConfig(vocab_size=256, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16,
                     ffn_dim=160, max_position=512)
TORCH = {"f32": torch.float32, "bf16": torch.bfloat16}
MIN_COSINE = 0.999


def prompt(n: int) -> list[int]:
    return [(41 * i + 7) % CONFIG.vocab_size for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A seeded random ``LlamaForCausalLM`` of :data:`CONFIG`'s geometry, saved as a
    Hugging Face folder (config.json, model.safetensors)."""
    c = CONFIG
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_dim,
                     num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                     num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
                     max_position_embeddings=c.max_position,
                     rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
                     rms_norm_eps=c.rms_eps, tie_word_embeddings=False, initializer_range=0.05,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(SEED)
    folder = tmp_path_factory.mktemp("random-llama")
    LlamaForCausalLM(hf).save_pretrained(folder)
    return folder


def hf_model(folder, dtype: str, attn: str = "eager") -> LlamaForCausalLM:
    """The saved model, loaded by transformers in *dtype* with attention *attn*."""
    return LlamaForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=TORCH[dtype]).eval()


def hf_kv(folder, tokens: list[int], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' K (after RoPE) and V of *tokens*: [layers, tokens, kv heads, head_dim] each."""
    with torch.no_grad():
        cache = hf_model(folder, dtype)(torch.tensor([tokens]), use_cache=True).cache
    k = torch.stack([layer.keys[0] for layer in cache.layers]).transpose(1, 2)
    v = torch.stack([layer.values[0] for layer in cache.layers]).transpose(1, 2)
    return k.contiguous(), v.contiguous()


def page_kv(pages: list[bytes], m: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages read as SPEC §1 says, one after another: K and V, each [layers, slots, heads, dim]."""
    shape = (len(pages), 2, m["n_layers"], m["page_size_tokens"], m["n_heads"], m["head_dim"])
    t = torch.frombuffer(bytearray(b"".join(pages)), dtype=TORCH[m["dtype"]]).view(shape)
    t = t.permute(1, 2, 0, 3, 4, 5).reshape(2, m["n_layers"], -1, m["n_heads"], m["head_dim"])
    return t[0], t[1]


def session_kv(folder) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A one-sequence session's manifest, and its pages' K and V (padding slots included)."""
    m = json.loads((folder / "manifest.json").read_bytes())
    [seq] = m["logical_seqs"]
    pages = [(folder / "pages" / page_name(ix)).read_bytes() for ix in seq["page_ixs"]]
    for ix, data in zip(seq["page_ixs"], pages):
        assert len(data) == 2 * m["n_layers"] * m["page_size_tokens"] * m["n_heads"] * m["head_dim"] \
            * TORCH[m["dtype"]].itemsize, f"page {ix}"
    return m, *page_kv(pages, m)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def assert_model_kv(k: torch.Tensor, v: torch.Tensor, ref_k: torch.Tensor, ref_v: torch.Tensor) -> None:
    """The pages' K and V cover the reference's tokens with a cosine of at least
    :data:`MIN_COSINE` in every layer (K and V apart); every slot after them is zero."""
    n = ref_k.shape[1]
    assert k.shape[0] == ref_k.shape[0] and k.shape[2:] == ref_k.shape[2:]
    for layer in range(ref_k.shape[0]):
        for name, got, want in (("K", k, ref_k), ("V", v, ref_v)):
            c = cosine(got[layer, :n], want[layer])
            assert c >= MIN_COSINE, f"layer {layer} {name}: cosine {c:.6f} with transformers'"
    assert not k[:, n:].any() and not v[:, n:].any(), "a partial page's tail is not zeros"


def assert_same_kv(k: torch.Tensor, v: torch.Tensor, ref_k: torch.Tensor, ref_v: torch.Tensor) -> None:
    """The pages' K and V are the reference's bit for bit, layer by layer."""
    assert k.shape == ref_k.shape and v.shape == ref_v.shape
    for layer in range(ref_k.shape[0]):
        for name, got, want in (("K", k, ref_k), ("V", v, ref_v)):
            assert torch.equal(got[layer], want[layer]), \
                f"layer {layer} {name}: not transformers' (cosine {cosine(got[layer], want[layer]):.6f})"


def assert_geometry(m: dict, dtype: str, page: int) -> None:
    assert (m["n_layers"], m["n_heads"], m["head_dim"]) == (CONFIG.n_layers, CONFIG.n_kv_heads,
                                                           CONFIG.head_dim)
    assert (m["dtype"], m["page_size_tokens"]) == (dtype, page)
    assert m["kv"]["k_has_rope"] is True


# ------------------------------------------------------------ reference engine


@pytest.mark.parametrize("dtype,kv_layout", [("f32", "flash_attn NHD"), ("bf16", "flashinfer HND")])
def test_reference_engine_pages_are_the_models_kv(model_dir, tmp_path, dtype, kv_layout):
    """The reference engine with the checkpoint's weights (Hugging Face names): its pages
    of 2 pages and 9 tokens of 32 are transformers' K and V."""
    page = 32
    tokens = prompt(2 * page + 9)
    e = ReferenceEngine.from_safetensors(model_dir / "model.safetensors", CONFIG, dtype=dtype,
                                         block_size=page, kv_layout=kv_layout)
    e.add_request("r", tokens)
    e.step(["r"])
    e.page_out(tmp_path / "s")
    m, k, v = session_kv(tmp_path / "s")
    assert_geometry(m, dtype, page)
    assert m["logical_seqs"][0]["token_ids"] == tokens and len(m["pages"]) == 3
    assert_model_kv(k, v, *hf_kv(model_dir, tokens, dtype))


# ------------------------------------------------------------ transformers adapter


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_transformers_adapter_pages_are_the_models_kv(model_dir, tmp_path, dtype):
    """transformers' continuous batching (paged attention, its own block order): the
    adapter's pages of 3 pages and 7 tokens of 16 are the K and V of the same model's
    plain forward pass."""
    from engine_bridge.transformers.transformers_adapter import TransformersEngine

    page = 16
    tokens = prompt(3 * page + 7)
    e = TransformersEngine(hf_model(model_dir, dtype, attn="sdpa"), num_blocks=32, page_size=page,
                           max_batch_tokens=128)
    e.add_request("r", tokens)
    e.step(["r"])
    e.page_out(tmp_path / "s")
    m, k, v = session_kv(tmp_path / "s")
    assert_geometry(m, dtype, page)
    assert m["logical_seqs"][0]["token_ids"] == tokens and len(m["pages"]) == 4
    assert_model_kv(k, v, *hf_kv(model_dir, tokens, dtype))


# ------------------------------------------------------------ SGLang's host pool


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first", "layer_first"])
def test_sglang_host_pool_pages_are_the_models_kv(mount_factory, model_dir, tmp_path, layout):
    """SGLang's device pool holds transformers' K/V of the prompt as its attention writes
    them (``k_buffer[layer][slot]`` = the token's K, every head); SGLang backs the full
    pages up to its host pool in *layout* and writes them through to pffs.  The pages
    found by their keys in the index, and a session made of them by ``pffs from-tokens``,
    are transformers' K and V bit for bit.  (SGLang caches whole pages only: the
    partial page of the prompt is not stored.)"""
    import sglang_cpu
    from mountutil import pffs

    from pffs.client import chainkeys as ck
    from pffs.client.prefix_lookup import longest_prefix

    page, dtype = 16, "bf16"
    tokens = prompt(2 * page + 7)
    full = len(tokens) // page * page
    ref_k, ref_v = hf_kv(model_dir, tokens, dtype)
    mnt = mount_factory()
    # (The backend takes the model's identity from its folder, SGLang's model path.)
    extra = {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
             "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mnt.path)}
    with sglang_cpu.make_hicache(page_size=page, n_layers=CONFIG.n_layers, n_heads=CONFIG.n_kv_heads,
                                 head_dim=CONFIG.head_dim, dtype=TORCH[dtype], layout=layout,
                                 storage_backend="dynamic", backend_extra_config=extra,
                                 model_path=str(model_dir)) as hc:
        assert hc.host_pool.layout == layout
        hc.insert(tokens[:full], ref_k[:, :full], ref_v[:, :full])
        writes = hc.wait_storage_writes()
        assert writes and all(w.complete for w in writes)
        space = hc.storage.space
        digests = longest_prefix(mnt.path, space, ck.chain_keys(tokens, page))
        assert len(digests) == full // page
        stored = [hc.storage.blobs.get(d) for d in digests]
    template = mnt.path / ".hicache" / f"{space}.json"
    m = json.loads(template.read_bytes())
    assert_geometry(m, dtype, page)
    assert_same_kv(*page_kv(stored, m), ref_k[:, :full], ref_v[:, :full])

    (tmp_path / "t.json").write_text(json.dumps(tokens))
    r = pffs("from-tokens", mnt.path / "chat", "--tokens", tmp_path / "t.json", "--like", template)
    assert f"{full // page} pages ({full} tokens)" in r.stdout
    m, k, v = session_kv(mnt.path / "chat")
    assert m["logical_seqs"][0]["fill_in_last_page"] == 0
    assert_same_kv(k, v, ref_k[:, :full], ref_v[:, :full])
