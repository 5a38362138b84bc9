"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
The engine bridge: page bytes as contract §1 lays them out, bit-exact restores,
shared pages, every page-in refusal leaving the engine untouched, atomic
page-out, and bounded staging."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_bridge import (Bridge, DigestMismatch, DirSink, DirSource, IncompleteSession,
                           InvalidSession, KVPool, MemorySession, MismatchError, ModelMismatch,
                           NoFreeBlocks, PageOutError, RefCountingAllocator, Refused, SeqBlocks,
                           SourceChanged, Staging, Unfingerprinted, WrongSizePage)
from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine
from pffs.names import DIGEST_XATTR
from pffs.manifest import page_name, parse

PROMPTS = {
    "a": [(7 * i + 3) % 512 for i in range(37)],
    "b": [(11 * i + 5) % 512 for i in range(21)],
    "c": [(13 * i + 1) % 512 for i in range(16)],
}
IDS = list(PROMPTS)
LAYOUTS = ["flash_attn NHD", "flashinfer NHD", "flashinfer HND"]
TORCH_DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
            "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def live_engine(dtype="f32", layout="flash_attn NHD", decode_steps=5, **kw):
    """An engine that prefilled three prompts as one batch and decoded a few steps."""
    e = ReferenceEngine(dtype=dtype, seed=1, kv_layout=layout, **kw)
    for sid, prompt in PROMPTS.items():
        e.add_request(sid, prompt)
    last = None
    for _ in range(decode_steps + 1):
        last = e.step(IDS)
    return e, last


def dirty(e: ReferenceEngine) -> ReferenceEngine:
    """Fill an engine's pool with garbage and give it a live sequence, like a busy engine."""
    g = torch.Generator().manual_seed(99)
    for t in e.pool.layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    e.add_request("live", [5] * 20)
    e.step(["live"])
    return e


def assert_restore_is_bit_exact(e1, last, e2, ids=IDS, steps=40):
    """e2 (restored) replays the last token, then decodes like the uninterrupted e1."""
    want_t, want_l = e1.generate(ids, steps)
    replay = e2.step(ids)
    for sid in ids:
        assert replay[sid].token == last[sid].token
        assert torch.equal(replay[sid].logits, last[sid].logits)
    got_t, got_l = e2.generate(ids, steps)
    assert got_t == want_t
    for sid in ids:
        assert all(torch.equal(x, y) for x, y in zip(got_l[sid], want_l[sid])), sid


# ----------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_page_out_page_in_continues_bit_exact(tmp_path, dtype, layout):
    e1, last = live_engine(dtype, layout)
    m = e1.page_out(tmp_path / "sess")
    assert m.dtype == dtype and m.engine["kv_layout"] == layout
    e2 = dirty(ReferenceEngine(dtype=dtype, seed=1, kv_layout=layout))
    assert e2.page_in(tmp_path / "sess") == IDS
    # Same tokens and fill, other physical blocks.
    for a, b in zip(e1.seq_blocks(IDS), e2.seq_blocks(IDS)):
        assert (a.n_tokens, a.token_ids) == (b.n_tokens, b.token_ids)
        assert a.block_ids != b.block_ids
    assert_restore_is_bit_exact(e1, last, e2)


def test_restore_across_pool_layouts_is_bit_exact(tmp_path):
    e1, last = live_engine("bf16", "flashinfer HND")
    e1.page_out(tmp_path / "s")
    e2 = ReferenceEngine(dtype="bf16", seed=1, kv_layout="flash_attn NHD")
    e2.page_in(tmp_path / "s")
    assert_restore_is_bit_exact(e1, last, e2, steps=10)


def test_token_ids_can_be_left_out(tmp_path):
    e1, _ = live_engine()
    m = e1.page_out(tmp_path / "s", include_token_ids=False)
    assert all(s.token_ids is None for s in m.logical_seqs)
    assert b"token_ids" not in (tmp_path / "s" / "manifest.json").read_bytes()
    e2 = ReferenceEngine(seed=1)
    e2.page_in(tmp_path / "s")
    with pytest.raises(ValueError, match="without token ids"):
        e2.step(IDS)
    # Feeding each sequence its pending token continues exactly.
    for sid in IDS:
        e2.append_tokens(sid, [e1.tokens(sid)[-1]])
    want_t, want_l = e1.generate(IDS, 10)
    got_t, got_l = e2.generate(IDS, 10)
    assert got_t == want_t
    assert all(torch.equal(x, y) for sid in IDS for x, y in zip(got_l[sid], want_l[sid]))


def test_memory_session_round_trip():
    e1, last = live_engine()
    sess = MemorySession()
    e1.page_out(sess)
    e2 = ReferenceEngine(seed=1)
    e2.page_in(sess)
    assert_restore_is_bit_exact(e1, last, e2, steps=5)


# ---------------------------------------------------------------- page bytes


def _block_half(t: torch.Tensor, layout: str, kv: int, b: int) -> torch.Tensor:
    """[block_size, heads, dim] of one block's K or V, read by hand per layout."""
    if layout == "flash_attn NHD":
        return t[kv, b]
    if layout == "flashinfer NHD":
        return t[b, kv]
    return t[b, kv].transpose(0, 1)


def _expected_page(pool_layers, layout, b, used) -> bytes:
    halves = []
    for kv in (0, 1):
        x = torch.stack([_block_half(t, layout, kv, b) for t in pool_layers]).contiguous()
        raw = x.view(torch.uint8).clone()  # [L, P, H, D*itemsize]
        raw[:, used:] = 0
        halves.append(raw.numpy().tobytes())
    return halves[0] + halves[1]


def random_pool(dtype: str, layout: str, num_blocks=10, seed=0, **geom) -> KVPool:
    g = dict(block_size=4, n_layers=3, n_heads=2, head_dim=8)
    g.update(geom)
    pool = KVPool.allocate(num_blocks=num_blocks, dtype=TORCH_DT[dtype], layout=layout, **g)
    gen = torch.Generator().manual_seed(seed)
    for t in pool.layers:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return pool


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(TORCH_DT))
def test_page_bytes_are_spec_layout(tmp_path, dtype, layout):
    pool = random_pool(dtype, layout)
    br = Bridge(pool, RefCountingAllocator(10), engine_name="synthetic",
                model={"name": "m", "revision": "r", "config_sha256": "c"})
    seqs = [SeqBlocks("x", [7, 2, 5], 10, list(range(10))),
            SeqBlocks("y", [7, 3], 6, None)]
    m = br.page_out(seqs, tmp_path / "s")
    itemsize = TORCH_DT[dtype].itemsize
    size = 2 * 3 * 4 * 2 * 8 * itemsize
    # Pages: block 7 (full, shared), 2, 5 (2 of 4 slots), 3 (2 of 4 slots).
    want = [(7, 4), (2, 4), (5, 2), (3, 2)]
    assert len(m.pages) == 4
    files = sorted(os.listdir(tmp_path / "s" / "pages"))
    assert files == [page_name(i) for i in range(4)]
    for ix, (b, used) in enumerate(want):
        data = (tmp_path / "s" / "pages" / page_name(ix)).read_bytes()
        assert len(data) == size == m.page_bytes
        assert data == _expected_page(pool.layers, layout, b, used)
        assert m.pages[ix] == "sha256:" + hashlib.sha256(data).hexdigest()
        # [K/V, layer, token slot, head * dim bytes]: the engine's garbage in
        # unused slots became zeros, the used slots are not all zero.
        arr = np.frombuffer(data, dtype=np.uint8).reshape(2, 3, 4, 2 * 8 * itemsize)
        assert not arr[:, :, used:].any()
        assert arr[:, :, :used].any()
    d = json.loads((tmp_path / "s" / "manifest.json").read_bytes())
    assert d["layout"] == "paged-batchinvariant-v1"
    assert (d["page_size_tokens"], d["n_layers"], d["n_heads"], d["head_dim"], d["dtype"]) == (4, 3, 2, 8, dtype)
    assert d["engine"] == {"name": "synthetic", "kv_layout": layout, "block_size": 4}
    assert d["kv"] == {"k_has_rope": True, "scales": None}
    assert d["model"] == {"name": "m", "revision": "r", "config_sha256": "c"}
    assert d["logical_seqs"] == [
        {"id": "x", "page_ixs": [0, 1, 2], "fill_in_last_page": 2, "token_ids": list(range(10))},
        {"id": "y", "page_ixs": [0, 3], "fill_in_last_page": 2}]
    # The live view reads the same bytes.
    assert br.read_page(seqs[0], 2) == (tmp_path / "s" / "pages" / page_name(2)).read_bytes()


def test_page_bytes_of_real_kv(tmp_path):
    """Real MiniLM KV (bf16) put into a pool block by block comes out as the reference pages."""
    from conftest import KV_FILE, kv_pages
    from safetensors.torch import load_file
    t = load_file(str(KV_FILE))
    k, v = t["k_bf16"], t["v_bf16"]  # [6, tokens, 12, 32]
    n_blocks = 8
    pool = KVPool.allocate(num_blocks=n_blocks, block_size=16, n_layers=6, n_heads=12, head_dim=32,
                           dtype=torch.bfloat16)
    order = [3, 0, 6, 1, 7, 2, 5, 4]  # page i lives in block order[i]
    for i, b in enumerate(order):
        for layer in range(6):
            pool.layers[layer][0, b] = k[layer, 16 * i:16 * (i + 1)]
            pool.layers[layer][1, b] = v[layer, 16 * i:16 * (i + 1)]
    m = Bridge(pool).page_out([SeqBlocks("minilm", order, 16 * n_blocks)], tmp_path / "s")
    ref = kv_pages("bf16")[:n_blocks]
    for i in range(n_blocks):
        assert (tmp_path / "s" / "pages" / page_name(i)).read_bytes() == ref[i]
        assert m.pages[i] == "sha256:" + hashlib.sha256(ref[i]).hexdigest()


@pytest.mark.parametrize("dtype", ["fp8e4m3", "bf16"])
def test_flashinfer_pool_round_trip_into_flash_attn_pool(tmp_path, dtype):
    src = random_pool(dtype, "flashinfer NHD", seed=1)
    seqs = [SeqBlocks("x", [7, 2, 5], 10), SeqBlocks("y", [7, 3], 6)]
    Bridge(src).page_out(seqs, tmp_path / "s")
    dst = random_pool(dtype, "flash_attn NHD", seed=2)
    alloc = RefCountingAllocator(10)
    alloc.allocate(3)
    res = Bridge(dst, alloc).page_in(tmp_path / "s")
    assert [s.n_tokens for s in res.seqs] == [10, 6]
    assert len(res.blocks) == 4 and res.seqs[0].block_ids[0] == res.seqs[1].block_ids[0]
    for s_old, s_new in zip(seqs, res.seqs):
        for j, (bo, bn) in enumerate(zip(s_old.block_ids, s_new.block_ids)):
            used = min(4, s_old.n_tokens - 4 * j)
            for lo, ln in zip(src.layers, dst.layers):
                for kv in (0, 1):
                    a = lo[bo, kv].view(torch.uint8)[:used]
                    b = ln[kv, bn].view(torch.uint8)
                    assert torch.equal(a, b[:used])
                    assert not b[used:].any()  # the zeroed slots


def test_block_shared_with_different_fills_is_two_pages(tmp_path):
    pool = random_pool("f32", "flash_attn NHD")
    m = Bridge(pool).page_out([SeqBlocks("x", [1], 3), SeqBlocks("y", [1], 4)], tmp_path / "s")
    assert [s.page_ixs for s in m.logical_seqs] == [[0], [1]]
    a = (tmp_path / "s/pages/000000").read_bytes()
    b = (tmp_path / "s/pages/000001").read_bytes()
    assert a != b and len(a) == len(b)


def test_shared_prefix_pages_are_written_once(tmp_path):
    e1 = ReferenceEngine(seed=3)
    e1.add_request("a", list(range(40)))  # 2 full blocks + 8 tokens
    e1.step(["a"])
    e1.fork("a", "b")
    e1.fork("a", "c")
    e1.append_tokens("b", [1, 2, 3])
    e1.append_tokens("c", [4])
    e1.step(["a", "b", "c"])
    last = e1.step(["a", "b", "c"])  # a decode step, the shape the restored replay has
    m = e1.page_out(tmp_path / "s")
    ixs = {s.id: s.page_ixs for s in m.logical_seqs}
    assert ixs["a"][:2] == ixs["b"][:2] == ixs["c"][:2]
    assert len({ixs["a"][2], ixs["b"][2], ixs["c"][2]}) == 3  # each wrote its own last block
    assert len(m.pages) == 5
    assert len(os.listdir(tmp_path / "s" / "pages")) == 5
    e2 = ReferenceEngine(seed=3)
    e2.page_in(tmp_path / "s")
    blocks = {s.id: s.block_ids for s in e2.seq_blocks()}
    assert blocks["a"][:2] == blocks["b"][:2] == blocks["c"][:2]
    assert all(e2.allocator.refcount(b) == 3 for b in blocks["a"][:2])
    assert e2.allocator.num_free() == 256 - 5
    assert_restore_is_bit_exact(e1, last, e2, ["a", "b", "c"], steps=20)
    for sid in "abc":
        e2.remove(sid)
    assert e2.allocator.num_free() == 256


# ------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory):
    """A session of three sequences written by an f32 engine with seed 1."""
    d = tmp_path_factory.mktemp("src") / "sess"
    live_engine(decode_steps=2)[0].page_out(d)
    return d


def _copy_session(src: Path, dst: Path) -> Path:
    (dst / "pages").mkdir(parents=True)
    (dst / "manifest.json").write_bytes((src / "manifest.json").read_bytes())
    for p in (src / "pages").iterdir():
        (dst / "pages" / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_bytes())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _flip_byte(d: Path, ix: int, at: int = 1000) -> None:
    p = d / "pages" / page_name(ix)
    b = bytearray(p.read_bytes())
    b[at] ^= 0x40
    p.write_bytes(bytes(b))


REFUSALS = {
    # name: (target engine kwargs, session edit, expected exception, expected field)
    "block size": (dict(block_size=8), None, MismatchError, "page_size_tokens"),
    "n_layers": (dict(config=ModelConfig(n_layers=3)), None, MismatchError, "n_layers"),
    "n_heads": (dict(config=ModelConfig(n_kv_heads=4)), None, MismatchError, "n_heads"),
    "head_dim": (dict(config=ModelConfig(head_dim=32)), None, MismatchError, "head_dim"),
    "dtype": (dict(dtype="bf16"), None, MismatchError, "dtype"),
    "layout": ({}, lambda d: _edit_manifest(d, lambda m: m.update(layout="paged-other-v9")),
               MismatchError, "layout"),
    "model": (dict(seed=2), None, ModelMismatch, "model.weights_sha256"),
    "no weights fingerprint": ({}, lambda d: _edit_manifest(d, lambda m: m["model"].pop("weights_sha256")),
                               Unfingerprinted, "model.weights_sha256"),
    "kv rope": ({}, lambda d: _edit_manifest(d, lambda m: m["kv"].update(k_has_rope=False)),
                MismatchError, "kv.k_has_rope"),
    "kv scales": ({}, lambda d: _edit_manifest(d, lambda m: m["kv"].update(scales={"k": [0.5]})),
                  MismatchError, "kv.scales"),
    "bad manifest": ({}, lambda d: (d / "manifest.json").write_text('{"layout": '),
                     InvalidSession, None),
    "no manifest": ({}, lambda d: (d / "manifest.json").unlink(), InvalidSession, None),
    "missing page": ({}, lambda d: (d / "pages" / "000002").unlink(), IncompleteSession, None),
    "short page": ({}, lambda d: os.truncate(d / "pages" / "000001", 100), WrongSizePage, 1),
    "long page": ({}, lambda d: open(d / "pages" / "000003", "ab").write(b"\0"), WrongSizePage, 3),
    "changed page": ({}, lambda d: _flip_byte(d, 4), DigestMismatch, 4),
    "no free blocks": (dict(num_blocks=8), None, NoFreeBlocks, None),
    "live id": ({}, "live-a", Refused, None),
}


@pytest.mark.parametrize("staging", ["default", "two pages"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_page_in_refusal_changes_nothing(tmp_path, session_dir, case, staging):
    kw, edit, exc, field = REFUSALS[case]
    sess = _copy_session(session_dir, tmp_path / "sess")
    kw = {"seed": 1, **kw}
    if staging == "two pages":
        cfg = kw.get("config", ModelConfig())
        kw["staging_bytes"] = 2 * 2 * cfg.n_layers * kw.get("block_size", 16) * cfg.n_kv_heads \
            * cfg.head_dim * (2 if kw.get("dtype") == "bf16" else 4)
    target = dirty(ReferenceEngine(**kw))
    if edit == "live-a":
        target.add_request("a", [1, 2, 3])
        target.step(["a"])
    elif edit is not None:
        edit(sess)
    layers = target.pool.clone_layers()
    free = target.allocator.free_list()
    live = target.seq_blocks()
    with pytest.raises(exc) as ei:
        target.page_in(sess)
    if isinstance(field, str):
        assert ei.value.field == field and field in str(ei.value)
    elif isinstance(field, int):
        assert ei.value.page_ix == field and page_name(field) in str(ei.value)
    if exc is IncompleteSession:
        assert ei.value.missing == [2]
    if exc is NoFreeBlocks:
        assert ei.value.errno == 28  # ENOSPC
    assert all(torch.equal(a, b) for a, b in zip(layers, target.pool.layers))
    assert target.allocator.free_list() == free
    assert target.seq_blocks() == live


def test_force_overrides_the_model_check_only(tmp_path, session_dir):
    other = ReferenceEngine(seed=2)
    assert other.page_in(session_dir, force=True) == IDS
    sess = _copy_session(session_dir, tmp_path / "s")
    _edit_manifest(sess, lambda m: m["kv"].update(k_has_rope=False))
    with pytest.raises(MismatchError, match="kv.k_has_rope"):
        ReferenceEngine(seed=2).page_in(sess, force=True)
    with pytest.raises(MismatchError, match="dtype"):
        ReferenceEngine(seed=2, dtype="bf16").page_in(session_dir, force=True)


def test_model_check_needs_both_sides(tmp_path, session_dir):
    """A session that does not say which weights wrote it loads only when
    trusted; then what both sides give is compared."""
    sess = _copy_session(session_dir, tmp_path / "s")
    _edit_manifest(sess, lambda m: m.update(model=None))
    with pytest.raises(Unfingerprinted, match="trust_unfingerprinted=True"):
        ReferenceEngine(seed=2).page_in(sess)
    assert ReferenceEngine(seed=2).page_in(sess, trust_unfingerprinted=True) == IDS
    sess2 = _copy_session(session_dir, tmp_path / "s2")
    _edit_manifest(sess2, lambda m: m.update(model={"name": "pffs-reference"}))
    assert ReferenceEngine(seed=2).page_in(sess2, trust_unfingerprinted=True) == IDS  # the name only
    _edit_manifest(sess2, lambda m: m.update(model={"name": "llama"}))
    with pytest.raises(ModelMismatch, match="model.name"):
        ReferenceEngine(seed=2).page_in(sess2, trust_unfingerprinted=True)


def test_xattr_digests_verify_big_sessions_without_a_first_read(tmp_path, session_dir):
    sess = _copy_session(session_dir, tmp_path / "s")
    m = parse((sess / "manifest.json").read_bytes())
    for ix, d in enumerate(m.pages):
        os.setxattr(sess / "pages" / page_name(ix), DIGEST_XATTR, d.encode())
    assert DirSource(sess).page_digest(3) == m.pages[3]
    assert DirSource(session_dir).page_digest(3) is None
    tiny = 2 * m.page_bytes
    # A file that lies about its digest: caught when the bytes are read; blocks go back.
    _flip_byte(sess, 5)
    e = dirty(ReferenceEngine(seed=1, staging_bytes=tiny))
    free, live = e.allocator.free_list(), e.seq_blocks()
    live_kv = [t[:, live[0].block_ids].clone() for t in e.pool.layers]
    with pytest.raises(SourceChanged) as ei:
        e.page_in(sess)
    assert ei.value.page_ix == 5
    assert e.allocator.free_list() == free and e.seq_blocks() == live
    assert all(torch.equal(t[:, live[0].block_ids], k) for t, k in zip(e.pool.layers, live_kv))
    # An xattr that disagrees with the manifest is refused before anything is touched.
    os.setxattr(sess / "pages" / page_name(5), DIGEST_XATTR, m.pages[0].encode())
    layers = e.pool.clone_layers()
    with pytest.raises(DigestMismatch) as ei:
        e.page_in(sess)
    assert ei.value.page_ix == 5 and not isinstance(ei.value, SourceChanged)
    assert all(torch.equal(a, b) for a, b in zip(layers, e.pool.layers))
    assert e.allocator.free_list() == free


# ------------------------------------------------------------------ page out


def test_page_out_refuses_an_existing_name(tmp_path):
    e, _ = live_engine(decode_steps=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for name in ("empty", "file"):
        with pytest.raises(FileExistsError):
            e.page_out(tmp_path / name)
    e.page_out(tmp_path / "s")
    with pytest.raises(FileExistsError):
        e.page_out(tmp_path / "s")
    # A name taken between the start and the commit is refused too.
    sink = DirSink(tmp_path / "late")
    (tmp_path / "late").mkdir()
    with pytest.raises(FileExistsError):
        e.page_out(sink)
    assert sorted(os.listdir(tmp_path)) == ["empty", "file", "late", "s"]
    assert os.listdir(tmp_path / "late") == [] and os.listdir(tmp_path / "empty") == []


def test_failed_page_out_leaves_nothing(tmp_path):
    e, _ = live_engine(decode_steps=1)

    class Failing(DirSink):
        def write_page(self, ix, data):
            if ix == 2:
                raise OSError(28, "No space left on device")
            return super().write_page(ix, data)

    with pytest.raises(OSError):
        e.page_out(Failing(tmp_path / "s"))
    assert os.listdir(tmp_path) == []


def test_page_out_refuses_inconsistent_sequences(tmp_path):
    br = Bridge(random_pool("f32", "flash_attn NHD"))
    with pytest.raises(PageOutError, match="need 2 blocks"):
        br.page_out([SeqBlocks("x", [1], 5)], tmp_path / "s")
    with pytest.raises(PageOutError, match="block ids"):
        br.page_out([SeqBlocks("x", [10], 4)], tmp_path / "s")
    with pytest.raises(PageOutError, match="token ids"):
        br.page_out([SeqBlocks("x", [1], 4, [1, 2])], tmp_path / "s")
    with pytest.raises(PageOutError, match="file name"):
        br.page_out([SeqBlocks("a/b", [1], 4)], tmp_path / "s")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------- staging


def test_staging_is_bounded_whatever_the_session_size(tmp_path):
    e1 = ReferenceEngine(seed=1)
    page = e1.pool.page_bytes
    e1 = ReferenceEngine(seed=1, staging_bytes=2 * page)
    for sid, n in (("a", 150), ("b", 97), ("c", 64)):
        e1.add_request(sid, [(i * 31 + len(sid)) % 512 for i in range(n)])
    last = None
    for _ in range(3):
        last = e1.step(IDS)
    m = e1.page_out(tmp_path / "s")
    assert len(m.pages) > 20
    assert e1.bridge.staging.allocated_bytes <= 2 * page
    e2 = dirty(ReferenceEngine(seed=1, staging_bytes=2 * page))
    e2.page_in(tmp_path / "s")
    assert e2.bridge.staging.allocated_bytes <= 2 * page
    assert_restore_is_bit_exact(e1, last, e2, steps=10)
    with pytest.raises(ValueError, match="fewer than two pages"):
        Staging("cpu", page, 2 * page - 1)


def test_sink_without_concurrency_gets_pages_in_order_from_one_thread():
    import threading

    class Recording(MemorySession):
        concurrent = False

        def __init__(self):
            super().__init__()
            self.calls = []

        def write_page(self, ix, data):
            self.calls.append((ix, threading.get_ident()))
            return super().write_page(ix, data)

    pool = random_pool("bf16", "flashinfer NHD", num_blocks=40)
    sink = Recording()
    seq = SeqBlocks("x", list(range(39, -1, -1)), 40 * 4 - 1)
    m = Bridge(pool, staging_bytes=6 * pool.page_bytes).page_out([seq], sink)
    assert [ix for ix, _ in sink.calls] == list(range(40))
    assert len({t for _, t in sink.calls}) == 1
    assert [sink.digests[i] for i in range(40)] == m.pages


def test_overlapping_writes_of_pinned_blocks_on_shared_threads_each_get_their_own_pages():
    """write_blocks_on (a live agent answers several store requests at once,
    their pages on threads they share): calls that overlap each get their own
    blocks' pages, unused slots zeroed, as write_blocks gives them."""
    from concurrent.futures import ThreadPoolExecutor

    pool = random_pool("bf16", "flashinfer NHD", num_blocks=40)
    bridge = Bridge(pool, staging_bytes=6 * pool.page_bytes)
    P = pool.block_size
    calls = [(list(range(k, 40, 4)), [P - (i + k) % 3 for i in range(10)]) for k in range(4)]
    want = []
    for blocks, used in calls:
        sink = MemorySession()
        bridge.write_blocks(blocks, used, sink)
        want.append(sink._staged)
    assert len({d for w in want for _, d in w.values()}) == 40

    def on_shared(call):
        sink = MemorySession()
        digests = bridge.write_blocks_on(ex, *call, sink)
        return sink._staged, digests
    for _ in range(5):
        with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(4) as callers:
            got = list(callers.map(on_shared, calls))
        assert [g for g, _ in got] == want
        assert [ds for _, ds in got] == [[w[i][1] for i in range(10)] for w in want]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layers_of_one_allocation_copy_a_block_at_once_and_the_same_bytes(layout):
    """allocate() gives every layer one allocation: gather and scatter copy a
    block of all layers in one strided copy, with the bytes the copy a layer at
    a time gives (the path of layers allocated one by one)."""
    stacked = random_pool("bf16", layout)
    assert stacked._layers_np() is not None
    apart = KVPool([t.clone() for t in stacked.layers], layout)
    assert apart._layers_np() is None
    idx = stacked.block_index([7, 2, 5])
    a = torch.empty((3, stacked.page_bytes), dtype=torch.uint8)
    b = torch.empty_like(a)
    stacked.gather(idx, a)
    apart.gather(idx, b)
    assert torch.equal(a, b)
    for i, blk in enumerate([7, 2, 5]):
        assert a[i].numpy().tobytes() == _expected_page(stacked.layers, layout, blk, 4)
    # Scattered back into other blocks, both give the same layers.
    c = torch.randint(0, 256, a.shape, dtype=torch.uint8)
    stacked.scatter(stacked.block_index([0, 1, 9]), c)
    apart.scatter(apart.block_index([0, 1, 9]), c)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(stacked.layers, apart.layers))


def test_threads_take_pages_in_turn_and_small_pages_page_in_on_one(monkeypatch):
    """A page-out and a page-in of 64 pages give each I/O thread one task that
    takes pages in turn, not a task a page (a future a page cost the calling
    thread more than a small page's decode); pages under 512 KiB are paged
    in on one thread, larger ones on io_workers."""
    from concurrent.futures import ThreadPoolExecutor

    from engine_bridge.core.bridge import PAGE_IN_THREADS_FROM
    submitted: list[str] = []
    real = ThreadPoolExecutor.submit

    def counting(self, fn, *args, **kw):
        submitted.append(getattr(fn, "__name__", "?"))
        return real(self, fn, *args, **kw)
    monkeypatch.setattr(ThreadPoolExecutor, "submit", counting)
    pool = random_pool("bf16", "flash_attn NHD", num_blocks=128)
    br = Bridge(pool, RefCountingAllocator(128), io_workers=2)
    seq = SeqBlocks("x", list(range(64)), 64 * 4 - 1)
    session = MemorySession()
    m = br.page_out([seq], session)
    assert len(m.pages) == 64 and len(submitted) <= 2, submitted
    submitted.clear()
    res = br.page_in(session)
    assert br.page_in_workers() == 1 and len(submitted) <= 2, submitted
    assert br.page_out(res.seqs, MemorySession()).pages == m.pages
    big = KVPool.allocate(num_blocks=2, dtype=torch.bfloat16, block_size=16, n_layers=8, n_heads=8,
                          head_dim=128)
    assert big.page_bytes == PAGE_IN_THREADS_FROM
    assert Bridge(big, io_workers=3).page_in_workers() == 3


def test_scales_all_one_are_the_null_scales():
    """kv.scales null and scales that are all 1.0 say the same (values not scaled):
    a page-in takes either for the other; any other scale is refused naming it."""
    from engine_bridge.core.bridge import check_manifest
    from pffs.manifest import Manifest
    geometry = {"page_size_tokens": 16, "n_layers": 2, "n_heads": 4, "head_dim": 8, "dtype": "fp8e4m3"}
    ones = {"k_has_rope": True, "scales": {"k": [1.0, 1], "v": [1.0, 1.0]}}
    m = Manifest(**geometry, pages=[], kv=ones)
    check_manifest(m, geometry, {"k_has_rope": True, "scales": None}, None)
    check_manifest(Manifest(**geometry, pages=[], kv=None), geometry, ones, None)
    half = {"k_has_rope": True, "scales": {"k": [1.0, 0.5], "v": [1.0, 1.0]}}
    with pytest.raises(MismatchError, match=r"kv.scales mismatch: session has .*0\.5.*engine has None"):
        check_manifest(Manifest(**geometry, pages=[], kv=half), geometry, ones, None)
