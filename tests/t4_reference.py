"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
The reference engine: determinism, correctness against a one-shot forward,
the block allocator, copy-on-write, and Llama state-dict loading."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from engine_bridge import NoFreeBlocks, RefCountingAllocator
from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine, weight_shapes

PROMPT_A = [(7 * i + 3) % 512 for i in range(37)]
PROMPT_B = [(11 * i + 5) % 512 for i in range(21)]


def run(engine: ReferenceEngine, n: int = 12):
    engine.add_request("a", PROMPT_A)
    engine.add_request("b", PROMPT_B)
    first = engine.step(["a", "b"])
    toks, logs = engine.generate(["a", "b"], n)
    return first, toks, logs


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_same_seed_same_bits(dtype):
    f1, t1, l1 = run(ReferenceEngine(dtype=dtype, seed=3))
    f2, t2, l2 = run(ReferenceEngine(dtype=dtype, seed=3))
    assert t1 == t2
    for sid in "ab":
        assert torch.equal(f1[sid].logits, f2[sid].logits)
        assert all(torch.equal(x, y) for x, y in zip(l1[sid], l2[sid]))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_steps_run_on_the_engines_thread_count_whatever_the_callers(dtype):
    before = torch.get_num_threads()
    seen = []
    e = ReferenceEngine(dtype=dtype, seed=3)
    real_forward = e._forward
    e._forward = lambda *a: (seen.append(torch.get_num_threads()), real_forward(*a))[1]
    try:
        torch.set_num_threads(2)
        f1, t1, l1 = run(e, 3)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        f2, t2, l2 = run(ReferenceEngine(dtype=dtype, seed=3), 3)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {e.threads} == {1}
    assert t1 == t2
    for sid in "ab":
        assert torch.equal(f1[sid].logits, f2[sid].logits)
        assert all(torch.equal(x, y) for x, y in zip(l1[sid], l2[sid]))
    with pytest.raises(ValueError, match="threads"):
        ReferenceEngine(threads=0)


def test_other_seed_other_model():
    e1, e2 = ReferenceEngine(seed=1), ReferenceEngine(seed=2)
    assert e1.model_identity["revision"] != e2.model_identity["revision"]
    assert e1.model_identity["config_sha256"] == e2.model_identity["config_sha256"]
    _, _, l1 = run(e1, 1)
    _, _, l2 = run(e2, 1)
    assert not torch.equal(l1["a"][0], l2["a"][0])


def test_config_sha256_is_sha_of_canonical_config():
    cfg = ModelConfig(n_layers=2)
    e = ReferenceEngine(cfg)
    canon = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert e.model_identity["config_sha256"] == hashlib.sha256(canon).hexdigest()
    assert e.model_identity["name"] == "pffs-reference"


@pytest.mark.parametrize("dtype,atol", [("f32", 1e-4), ("bf16", 0.15)])
def test_paged_decode_matches_one_shot_forward(dtype, atol):
    e = ReferenceEngine(dtype=dtype, seed=5)
    first, toks, logs = run(e, 10)
    full = e.tokens("a")
    ref = e.recompute_logits(full[:-1])
    n = len(PROMPT_A)
    assert torch.allclose(first["a"].logits, ref[n - 1], atol=atol)
    for i, got in enumerate(logs["a"]):
        assert torch.allclose(got, ref[n + i], atol=atol), f"decode step {i}"
    # Greedy: every token is the argmax of the logits that preceded it.
    assert toks["a"] == [int(x.argmax()) for x in logs["a"]]


def test_chunked_prefill_matches_one_step_prefill():
    e1 = ReferenceEngine(seed=4)
    e1.add_request("s", PROMPT_A[:10])
    g = e1.step(["s"])["s"].token
    e1.append_tokens("s", PROMPT_A[10:])  # computed as a second chunk
    chunked = e1.step(["s"])["s"].logits
    e2 = ReferenceEngine(seed=4)
    e2.add_request("s", PROMPT_A[:10] + [g] + PROMPT_A[10:])
    one = e2.step(["s"])["s"].logits
    assert torch.allclose(one, chunked, atol=1e-4)
    assert e1.tokens("s")[:-1] == e2.tokens("s")[:-1]
    assert e1.seq_blocks(["s"])[0].n_tokens == e2.seq_blocks(["s"])[0].n_tokens == len(PROMPT_A) + 1


def test_attention_reads_kv_from_the_pool():
    e = ReferenceEngine(seed=6)
    e.add_request("a", PROMPT_A)
    e.step(["a"])
    clean = ReferenceEngine(seed=6)
    clean.add_request("a", PROMPT_A)
    clean.step(["a"])
    blk = e.seq_blocks(["a"])[0].block_ids[0]
    e.pool.layers[1][:, blk] += 1.0  # FlashAttention layout: [2, blocks, ...]
    assert not torch.equal(e.step(["a"])["a"].logits, clean.step(["a"])["a"].logits)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_pool_layout_does_not_change_the_bits(dtype):
    _, t1, l1 = run(ReferenceEngine(dtype=dtype, seed=2, kv_layout="flash_attn NHD"), 6)
    _, t2, l2 = run(ReferenceEngine(dtype=dtype, seed=2, kv_layout="flashinfer NHD"), 6)
    _, t3, l3 = run(ReferenceEngine(dtype=dtype, seed=2, kv_layout="flashinfer HND"), 6)
    assert t1 == t2 == t3
    assert all(torch.equal(x, y) and torch.equal(x, z)
               for x, y, z in zip(l1["b"], l2["b"], l3["b"]))


def test_allocator_all_or_nothing_and_exact_undo():
    a = RefCountingAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    before = a.free_list()
    with pytest.raises(NoFreeBlocks) as ei:
        a.allocate(6)
    assert (ei.value.needed, ei.value.free) == (6, 5)
    assert a.free_list() == before
    got = a.allocate(4)
    a.free(got)
    assert a.free_list() == before
    a.incref([1])
    a.free([1])
    assert a.refcount(1) == 1 and a.num_free() == 5
    with pytest.raises(ValueError):
        a.free([1, 1])  # held once
    assert a.refcount(1) == 1
    with pytest.raises(ValueError):
        a.free([7])  # never allocated
    a.free([0, 1, 2])
    assert a.num_free() == 8
    assert a.allocate(8) == list(range(8))


def test_step_without_free_blocks_changes_nothing():
    e = ReferenceEngine(seed=1, num_blocks=4)
    e.add_request("a", list(range(40)))  # 3 blocks
    e.add_request("b", list(range(30)))  # 2 blocks
    e.step(["a"])
    free_before = e.allocator.free_list()
    toks_before = e.tokens("b")
    with pytest.raises(NoFreeBlocks):
        e.step(["a", "b"])
    assert e.allocator.free_list() == free_before
    assert e.tokens("b") == toks_before and e.seqs["b"].blocks == []


def test_fork_shares_blocks_and_copies_on_write():
    e = ReferenceEngine(seed=7)
    e.add_request("a", PROMPT_A)  # 37 tokens: last block partly full
    e.step(["a"])
    e.fork("a", "b")
    shared = e.seq_blocks(["a"])[0].block_ids
    assert e.seq_blocks(["b"])[0].block_ids == shared
    assert all(e.allocator.refcount(b) == 2 for b in shared)
    last = shared[-1]
    before = e.pool.layers[0][:, last].clone()
    e.append_tokens("b", [9, 9, 9])
    e.step(["b"])
    # b wrote into a private copy of the shared partial block; a's block is intact.
    assert e.seq_blocks(["b"])[0].block_ids[-1] != last
    assert torch.equal(e.pool.layers[0][:, last], before)
    assert e.allocator.refcount(last) == 1
    # Both continue exactly like unforked sequences with the same tokens.
    ref = ReferenceEngine(seed=7)
    ref.add_request("b", e.tokens("b")[:-1])
    assert torch.allclose(ref.step(["b"])["b"].logits,
                          e.recompute_logits(e.tokens("b")[:-1])[-1], atol=1e-4)
    e.remove("a")
    e.remove("b")
    assert e.allocator.num_free() == 256


def test_state_dict_round_trip(tmp_path):
    from safetensors.torch import save_file
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    e1 = ReferenceEngine(cfg, seed=11)
    sd = e1.state_dict()
    assert set(sd) == set(weight_shapes(cfg))
    assert "model.layers.1.self_attn.k_proj.weight" in sd and "lm_head.weight" in sd
    e2 = ReferenceEngine(cfg, state_dict=sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    e3 = ReferenceEngine.from_safetensors(tmp_path / "model.safetensors", cfg)
    assert e1.model_identity == e2.model_identity == e3.model_identity
    outs = [run(e, 4) for e in (e1, e2, e3)]
    assert outs[0][1] == outs[1][1] == outs[2][1]
    assert all(torch.equal(x, y) and torch.equal(x, z)
               for x, y, z in zip(outs[0][2]["a"], outs[1][2]["a"], outs[2][2]["a"]))
    # Changed weights are another model revision.
    sd["model.norm.weight"] = sd["model.norm.weight"] * 2
    assert ReferenceEngine(cfg, state_dict=sd).model_identity["revision"] != e1.model_identity["revision"]


def test_state_dict_that_does_not_fit_is_refused():
    cfg = ModelConfig(n_layers=2)
    sd = ReferenceEngine(cfg).state_dict()
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        ReferenceEngine(cfg, state_dict=bad)
    bad = dict(sd)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="lm_head"):
        ReferenceEngine(cfg, state_dict=bad)
