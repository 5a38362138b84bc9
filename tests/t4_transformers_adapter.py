"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
Hugging Face transformers continuous batching attached to the bridge: bit-exact
restores through a real mount, sessions moving into the reference engine,
page-in refusals leaving the engine as it was, and the demo."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from engine_bridge import (IncompleteSession, MismatchError, ModelMismatch, NoFreeBlocks,  # noqa: E402
                           Refused, Unfingerprinted)
from engine_bridge import demo  # noqa: E402
from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine  # noqa: E402
from engine_bridge.transformers.transformers_adapter import (REQUIRED_VERSION, TransformersEngine,  # noqa: E402
                                                llama_model)
from mountutil import pffs  # noqa: E402
from pffs.errors import PffsError  # noqa: E402
from pffs.manifest import page_name  # noqa: E402

SEED = 11
PROMPT = [(37 * i + 11) % 512 for i in range(53)]
N, M = 20, 20  # tokens decoded before the page-out, and after


def engine(dtype="f32", config=None, *, num_blocks=48, page_size=16, **kw) -> TransformersEngine:
    """A small greedy transformers engine with the reference engine's seeded weights."""
    return TransformersEngine(llama_model(config, dtype=dtype, seed=SEED), num_blocks=num_blocks,
                              page_size=page_size, max_batch_tokens=128, **kw)


def decoded(dtype="f32", steps=N, **kw):
    e = engine(dtype, **kw)
    e.add_request("r", PROMPT)
    toks, lps = e.generate(["r"], steps)
    return e, toks["r"], lps["r"]


def hexes(xs) -> list[str]:
    return [x.hex() for x in xs]


def run(*cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr}"
    return r


# --------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fork_through_the_mount_and_continue_bit_exact(mnt, dtype):
    a, toks, lps = decoded(dtype)
    [live] = a.requests()
    assert (live.id, live.status, live.prompt_ids, live.generated_tokens) == ("r", "DECODING", PROMPT, toks)
    n = len(PROMPT) + N - 1  # KV covers every token but the newest
    assert live.kv_length == n and len(live.block_ids) == -(-n // 16)
    m = a.page_out(mnt / "a")
    assert m.dtype == dtype and m.page_size_tokens == 16 and m.n_layers == 4
    assert (m.n_heads, m.head_dim) == (2, 16)
    assert m.engine == {"name": "transformers", "kv_layout": "transformers paged", "block_size": 16,
                        "version": REQUIRED_VERSION}
    assert m.kv == {"k_has_rope": True, "scales": None}
    assert set(m.model) == {"name", "revision", "config_sha256", "weights_sha256"}
    assert m.model == a.model_identity
    [seq] = m.logical_seqs
    assert seq.token_ids == PROMPT + toks[:-1] and seq.fill_in_last_page == n % 16

    run("cp", "-r", mnt / "a", mnt / "b")
    run("mkdir", "-p", mnt / "c" / "pages")
    run("cp", mnt / "a" / "manifest.json", mnt / "c")
    assert sorted(os.listdir(mnt / "c" / "pages")) == [page_name(i) for i in range(len(m.pages))]

    want_t, want_l = a.generate(["r"], M)
    for fork in ("b", "c"):
        e = engine(dtype)
        assert e.page_in(mnt / fork) == ["r"]
        replay = e.step(["r"])["r"]  # recomputes A's last step from the restored KV
        assert replay.token == toks[-1] and replay.logprob.hex() == lps[-1].hex()
        got_t, got_l = e.generate(["r"], M)
        assert got_t == want_t
        assert hexes(got_l["r"]) == hexes(want_l["r"])


def test_page_bytes_are_the_spec_layout(tmp_path):
    """Pages hold K then V, each [layers, slots, heads, dim], as a plain forward computes them."""
    from transformers import DynamicCache
    a, _, _ = decoded("f32", steps=3)
    m = a.page_out(tmp_path / "s")
    tokens = m.logical_seqs[0].token_ids
    with torch.no_grad():
        out = a.model(torch.tensor([tokens]), cache=DynamicCache(), use_cache=True)
        cache = out.cache
    k = torch.stack([layer.keys[0] for layer in cache.layers]).transpose(1, 2)    # [L, T, H, D]
    v = torch.stack([layer.values[0] for layer in cache.layers]).transpose(1, 2)
    P, n = 16, len(tokens)
    for ix in range(len(m.pages)):
        page = np.frombuffer((tmp_path / "s" / "pages" / page_name(ix)).read_bytes(), dtype=np.float32)
        page = torch.from_numpy(page.copy()).view(2, 4, P, 2, 16)
        used = min(P, n - ix * P)
        for kv, ref in ((0, k), (1, v)):
            torch.testing.assert_close(page[kv, :, :used], ref[:, ix * P:ix * P + used], rtol=1e-4, atol=1e-5)
            assert not page[kv, :, used:].any()


# ------------------------------------------------------------ cross-engine


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_session_continues_in_the_reference_engine(tmp_path, dtype):
    a, toks, lps = decoded(dtype)
    m = a.page_out(tmp_path / "s")
    want_t, want_l = a.generate(["r"], M)
    cont_lps = lps + want_l["r"]  # A's logprobs of its own tokens, steps 1..N+M
    seq = PROMPT + toks + want_t["r"]

    ref = ReferenceEngine(ModelConfig(), dtype=dtype, state_dict=a.model.state_dict(),
                          model_name=m.model["name"])
    # Same weights (same name, revision and weights fingerprint); the configs are
    # written in two forms.
    assert {k: ref.model_identity[k] for k in ("name", "revision", "weights_sha256")} == \
        {k: m.model[k] for k in ("name", "revision", "weights_sha256")}
    with pytest.raises(ModelMismatch, match="config_sha256"):
        ref.page_in(tmp_path / "s")
    assert ref.page_in(tmp_path / "s", force=True) == ["r"]

    # Logits of the transformers model over A's whole sequence at once (teacher-forced).
    with torch.no_grad():
        hf = a.model(torch.tensor([seq])).logits[0].float()
    hf_lp = torch.log_softmax(hf, dim=-1)
    top2 = hf.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).tolist()
    first = len(PROMPT)
    # How far A's paged steps are from that forward (its logprobs of its own tokens) ...
    tol_a = max(abs(cont_lps[j] - hf_lp[first + j - 1, seq[first + j]].item()) for j in range(N + M))

    # ... and the reference engine's paged steps (its logits), while it sees A's context.
    steps = [ref.step(["r"])["r"]]
    steps += [ref.step(["r"])["r"] for _ in range(M)]
    expected = seq[first + N - 1:]  # the replayed last token, then A's continuation
    assert len(steps) == len(expected) == M + 1
    tol_r, diverged = 0.0, None
    for j, (o, w) in enumerate(zip(steps, expected)):
        q = first + N - 1 + j  # index in seq of the predicted token
        tol_r = max(tol_r, (o.logits - hf[q - 1]).abs().max().item())
        if o.token != w:
            diverged = (j, q)
            break  # the contexts differ from here on
    tol = tol_a + tol_r
    checked = M + 1 if diverged is None else diverged[0]
    print(f"{dtype}: tolerance {tol:.3g} ({tol_a:.3g} + {tol_r:.3g}), {checked} of {M + 1} tokens identical")
    # The same tokens wherever the top-two margin exceeds the tolerance between the engines.
    if diverged is not None:
        j, q = diverged
        assert margin[q - 1] <= 2 * tol, (j, margin[q - 1], tol)
    assert checked >= 1
    if dtype == "f32":
        assert tol < 1e-3 and checked == M + 1


def test_shared_pages_from_the_reference_engine(tmp_path):
    """Forks sharing every page (the last one too): the last gets a private copy at page-in."""
    r = ReferenceEngine(dtype="f32", seed=SEED)
    r.add_request("a", PROMPT[:40])
    r.step(["a"])
    r.step(["a"])
    r.fork("a", "b")
    m = r.page_out(tmp_path / "s")
    assert [s.page_ixs for s in m.logical_seqs] == [[0, 1, 2], [0, 1, 2]]

    e = engine("f32")
    free = e.allocator.num_free()
    assert e.page_in(tmp_path / "s", force=True) == ["a", "b"]
    assert e.allocator.num_free() == free - 4
    ta, tb = (x.block_ids for x in e.seq_blocks(["a", "b"]))
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    group = e.adapter.pool_group()
    assert all(group.ledger.shared_ref_counts[b] == 2 for b in ta[:2])
    shared = [e.pool._raw[b].clone() for b in ta[:2]]
    last_b = e.pool._raw[tb[2]].clone()
    assert torch.equal(e.pool._raw[ta[2]], last_b)
    out = e.step(["a", "b"])
    e.step(["a", "b"])
    assert out["a"].token == out["b"].token
    assert all(torch.equal(e.pool._raw[b], x) for b, x in zip(ta[:2], shared))
    e.remove("a")
    e.remove("b")
    assert e.allocator.num_free() == free


# ---------------------------------------------------------------- refusals


def test_page_in_refusals_leave_the_engine_as_it_was(tmp_path):
    a, _, _ = decoded("f32", steps=4)
    a.page_out(tmp_path / "s")
    a.page_out(tmp_path / "anon", include_token_ids=False)
    pages = json.loads((tmp_path / "s" / "manifest.json").read_text())["pages"]
    assert len(pages) == 4
    (tmp_path / "t").mkdir()
    run("cp", "-r", tmp_path / "s" / "manifest.json", tmp_path / "s" / "pages", tmp_path / "t")
    os.unlink(tmp_path / "t" / "pages" / page_name(3))

    cases = [
        # (what, target engine, session, exception, field)
        ("too few free blocks", lambda: engine("f32", num_blocks=5), "s", NoFreeBlocks, None),
        ("page size", lambda: engine("f32", page_size=8), "s", MismatchError, "page_size_tokens"),
        ("dtype", lambda: engine("bf16"), "s", MismatchError, "dtype"),
        ("layers", lambda: engine("f32", ModelConfig(n_layers=3)), "s", MismatchError, "n_layers"),
        ("live id", lambda: engine("f32"), "s", Refused, None),
        ("no token ids", lambda: engine("f32"), "anon", Refused, None),
        ("missing page", lambda: engine("f32"), "t", IncompleteSession, None),
    ]
    for what, make, sess, exc, field in cases:
        target = make()
        # A live request of its own, so the allocator and scheduler hold something.
        target.add_request("r" if what == "live id" else "own", PROMPT[:20])
        target.step()
        state = target.allocator.state()
        cache = target.adapter.cache.cache_tensor.clone()
        live = target.requests()
        with pytest.raises(exc) as ei:
            target.page_in(tmp_path / sess)
        if field is not None:
            assert ei.value.field == field and field in str(ei.value), what
        if exc is NoFreeBlocks:
            assert ei.value.errno == errno.ENOSPC and "need 4, 3 free" in str(ei.value)
        if what == "no token ids":
            assert "token_ids" in str(ei.value)
        assert target.allocator.state() == state, what
        assert torch.equal(target.adapter.cache.cache_tensor, cache), what
        assert target.requests() == live, what
        target.step()  # and it goes on running


def test_other_weights_under_the_same_config_and_name_are_refused(tmp_path):
    """Two models with one config and one name and other weights: a session of one
    is refused by the other, naming both fingerprints (the weights of a model made
    in memory are fingerprinted from its tensors)."""
    a, _, _ = decoded("f32", steps=3)
    a.page_out(tmp_path / "s")
    other = TransformersEngine(llama_model(dtype="f32", seed=SEED + 1), num_blocks=48,
                               page_size=16, max_batch_tokens=128)
    mine, theirs = a.model_identity, other.model_identity
    assert (mine["name"], mine["config_sha256"]) == (theirs["name"], theirs["config_sha256"])
    assert mine["weights_sha256"] != theirs["weights_sha256"]
    with pytest.raises(ModelMismatch) as ei:
        other.page_in(tmp_path / "s")
    assert ei.value.field == "model.weights_sha256"
    assert mine["weights_sha256"] in str(ei.value) and theirs["weights_sha256"] in str(ei.value)
    assert other.requests() == []

    # The same session without its fingerprint: into its own model only when trusted.
    run("cp", "-r", tmp_path / "s", tmp_path / "bare")
    m = json.loads((tmp_path / "bare" / "manifest.json").read_text())
    del m["model"]["weights_sha256"]
    (tmp_path / "bare" / "manifest.json").write_text(json.dumps(m))
    same = engine("f32")
    with pytest.raises(Unfingerprinted, match="trust_unfingerprinted=True"):
        same.page_in(tmp_path / "bare")
    assert same.requests() == []
    assert same.page_in(tmp_path / "bare", trust_unfingerprinted=True) == ["r"]


def test_a_model_loaded_from_a_folder_is_fingerprinted_by_its_files(tmp_path):
    from transformers import LlamaForCausalLM

    from engine_bridge import weights_sha256_of_folder
    llama_model(dtype="f32", seed=SEED).save_pretrained(tmp_path / "ckpt")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    e = TransformersEngine(model, num_blocks=16, page_size=16, max_batch_tokens=128)
    assert e.model_identity["weights_sha256"] == weights_sha256_of_folder(tmp_path / "ckpt")


def test_another_transformers_release_is_refused():
    code = ("import transformers; transformers.__version__ = '5.0.0'\n"
            "import engine_bridge.transformers.transformers_adapter")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "TransformersVersionError" in r.stderr and REQUIRED_VERSION in r.stderr and "5.0.0" in r.stderr


# -------------------------------------------------------------------- demo


def test_pffs_demo_with_the_transformers_engine(tmp_path):
    from mountutil import is_mounted, lazy_unmount
    store, mp = tmp_path / "store", tmp_path / "kv"
    try:
        r = pffs("demo", "--engine", "transformers", "--dtype", "f32", "--store", store, "--mountpoint", mp,
                 "--tokens", 6, timeout=300)
        assert "transformers 5.24.0 continuous batching" in r.stdout, r.stdout
        assert "logprobs bit-identical" in r.stdout and "every continuation matched bit for bit" in r.stdout
        assert sorted(os.listdir(mp / "demo")) == ["a", "b", "c"]
        pffs("umount", mp)
    finally:
        if is_mounted(mp):
            lazy_unmount(mp)
    assert "0 damaged" in pffs("check", "--store", store).stdout
    demo.check_engine("transformers")
    with pytest.raises(PffsError, match="unknown engine"):
        demo.check_engine("vllm")


# ---------------------------------------------------- a running manager


def _manager(seed_model):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=128, return_logprobs=True,
                                  use_async_batching=False)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1)
    return seed_model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def _result(manager, rid):
    for _ in range(600):
        res = manager.get_result(request_id=rid, timeout=0.1)
        if res is not None and res.is_finished():
            return res
    pytest.fail(f"request {rid} did not finish")


@pytest.mark.parametrize("inference_mode", [False, True])
def test_running_managers_are_paused_around_the_copies(tmp_path, inference_mode):
    from engine_bridge.transformers.transformers_adapter import TransformersAdapter
    total = 40
    a, b = _manager(llama_model(seed=SEED)), _manager(llama_model(seed=SEED))
    with torch.inference_mode(inference_mode):
        a.start()
        b.start()
    try:
        ta, tb = TransformersAdapter(a), TransformersAdapter(b)
        a.add_request(PROMPT, request_id="r", max_new_tokens=total)
        # Page out while its thread decodes: wait for a few tokens first.
        for _ in range(3000):
            live = ta.requests()
            if live and len(live[0].generated_tokens) >= 4:
                break
        m = ta.page_out(tmp_path / "s")
        done = len(m.logical_seqs[0].token_ids) - len(PROMPT)  # generated tokens whose KV is saved
        assert 3 <= done < total
        full = _result(a, "r")
        assert len(full.generated_tokens) == total

        assert tb.page_in(tmp_path / "s", max_new_tokens=total - done) == ["r"]
        cont = _result(b, "r")
        # The restored request replays the last saved token, then decodes as A did.
        assert cont.generated_tokens == full.generated_tokens[done:]
        assert hexes(cont.logprobs) == hexes(full.logprobs[done:])
        assert tb.requests() == [] and tb.allocator.num_free() == tb.allocator.group.num_blocks
    finally:
        a.stop(block=True, timeout=30)
        b.stop(block=True, timeout=30)
