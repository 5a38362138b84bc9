"""``pffs demo``: a KV cache saved, forked with ordinary tools, restored, and continued.

Engine A (the reference engine) reads a prompt and decodes; its sequence is
paged out into the mount; the session is forked with ``cp -r`` and with
``pffs fork`` (no page bytes moved); fresh engines B and C page the forks in
and continue, and their tokens and logits are compared bit for bit with A
continuing uninterrupted.  Then the figures of the store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .reference import ModelConfig, ReferenceEngine

PROMPT = ("pffs keeps the KV cache of a conversation as plain files: one folder a session, "
          "one file a page, so that cp, ls, sha256sum and rsync just work. ")


def tokenize(text: str, vocab: int) -> list[int]:
    """Bytes as token ids (the reference model's vocabulary is tiny)."""
    return [b % vocab for b in text.encode()]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _stats(mnt: Path) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def run(mnt: Path, *, dtype: str = "f32", n_decode: int = 40, prompt_repeats: int = 8,
        out=print) -> bool:
    """Run the demo in MNT/demo; True when every continuation matched bit for bit."""
    mnt = Path(mnt)
    work = mnt / "demo"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    cfg = ModelConfig()
    prompt = tokenize(PROMPT * prompt_repeats, cfg.vocab_size)
    before = _stats(mnt)

    def engine(name: str) -> ReferenceEngine:
        return ReferenceEngine(cfg, dtype=dtype, num_blocks=256, seed=1234, name=name)

    out(f"engine A: reference transformer ({cfg.n_layers} layers, {cfg.n_kv_heads} KV heads x "
        f"{cfg.head_dim}, {dtype}), prompt of {len(prompt)} tokens, decoding {n_decode}")
    a = engine("A")
    a.add_request("chat-1", prompt)
    t0 = time.perf_counter()
    first_toks, first_logits = a.generate(["chat-1"], n_decode)
    t_prefill = time.perf_counter() - t0
    last_tok, last_logits = first_toks["chat-1"][-1], first_logits["chat-1"][-1]

    t0 = time.perf_counter()
    m = a.page_out(work / "a")
    t_out = time.perf_counter() - t0
    page_bytes = m.page_bytes
    out(f"paged out {len(m.pages)} pages of {_human(page_bytes)} to {work / 'a'} in {t_out * 1000:.0f} ms "
        f"(prefill + decode took {t_prefill * 1000:.0f} ms)")

    subprocess.run(["cp", "-r", str(work / "a"), str(work / "b")], check=True)
    out(f"forked with cp -r            -> {work / 'b'}")
    subprocess.run([sys.executable, "-m", "pffs.cli", "fork", str(work / "a"), str(work / "c")],
                   check=True, stdout=subprocess.DEVNULL)
    out(f"forked with pffs fork        -> {work / 'c'}")
    sums = subprocess.run(["sha256sum", "pages/000000"], cwd=work / "c", check=True,
                          capture_output=True, text=True).stdout.split()[0]
    out(f"sha256sum c/pages/000000     =  {sums[:16]}…  (manifest lists {m.pages[0][7:23]}…)")

    # A continues uninterrupted; B and C continue from the restored forks.
    ref_toks, ref_logits = a.generate(["chat-1"], n_decode)
    ok = True
    for name in ("b", "c"):
        e = engine(name.upper())
        t0 = time.perf_counter()
        e.page_in(work / name)
        t_in = time.perf_counter() - t0
        # The saved KV covers every token but the newest (as in vLLM): the first
        # step after a restore recomputes A's last step from the restored KV.
        replay = e.step(["chat-1"])["chat-1"]
        same_replay = replay.token == last_tok and torch.equal(replay.logits, last_logits)
        toks, logits = e.generate(["chat-1"], n_decode)
        same_tokens = toks["chat-1"] == ref_toks["chat-1"]
        same_logits = all(torch.equal(x, y) for x, y in zip(logits["chat-1"], ref_logits["chat-1"]))
        ok &= same_tokens and same_logits and same_replay
        out(f"engine {name.upper()}: paged in {name} in {t_in * 1000:.0f} ms; last step replayed "
            f"{'bit-identical' if same_replay else 'DIFFERENT'}; decoded {n_decode} more: "
            f"tokens {'identical' if same_tokens else 'DIFFERENT'}, "
            f"logits {'bit-identical' if same_logits else 'DIFFERENT'} to A uninterrupted")

    after = _stats(mnt)
    logical = after["logical_bytes"] - before["logical_bytes"]
    stored = after["stored_bytes"] - before["stored_bytes"]
    out("")
    out(f"sessions: 3 ({len(m.pages)} pages each), logical {_human(logical)}, "
        f"new stored bytes {_human(stored)}")
    out(f"store: {after['sessions']} sessions, {after['unique_blobs']} blobs, "
        f"logical {_human(after['logical_bytes'])}, unique {_human(after['unique_bytes'])}, "
        f"stored {_human(after['stored_bytes'])}; dedup {after['dedup_ratio']:.2f}x, "
        f"compression {after['compression_ratio']:.2f}x")
    out(f"result: {'every continuation matched bit for bit' if ok else 'MISMATCH'}")
    return ok


def default_mountpoint() -> Path:
    env = os.environ.get("PFFS_MOUNT")
    if env:
        return Path(env)
    if os.getuid() == 0:
        return Path("/mnt/kvcache")
    return Path.home() / "kvcache"
