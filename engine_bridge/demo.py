"""``pffs demo``: a KV cache saved, forked with ordinary tools, restored, and continued.

Engine A (the reference engine, or Hugging Face transformers' continuous
batching with the same weights) reads a prompt and decodes; its sequence is
paged out into the mount; the session is forked with ``cp -r`` and with
``pffs fork`` (no page bytes moved); fresh engines B and C page the forks in
and continue, and their tokens and logits (logprobs for transformers) are
compared bit for bit with A continuing uninterrupted.  Then the figures of
the store.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine
from pffs.errors import PffsError

ENGINES = ("reference", "transformers")
SEED = 1234

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


def check_engine(engine: str) -> None:
    """Refuse (PffsError, one line) an engine the demo cannot run here, before anything starts."""
    if engine not in ENGINES:
        raise PffsError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    if engine == "transformers":
        try:
            from engine_bridge.transformers import transformers_adapter  # noqa: F401
        except ImportError as e:
            raise PffsError(f"the transformers engine is not available: {e}") from None


def _engines(engine: str, cfg: ModelConfig, dtype: str, n_tokens: int):
    """A factory of fresh engines of one kind (same weights), what they score steps by, and a description."""
    shape = f"{cfg.n_layers} layers, {cfg.n_kv_heads} KV heads x {cfg.head_dim}, {dtype}"
    if engine == "reference":
        def make(name: str):
            return ReferenceEngine(cfg, dtype=dtype, num_blocks=256, seed=SEED, name=name)
        return make, "logits", f"reference transformer ({shape})"
    if engine == "transformers":
        check_engine(engine)
        import transformers

        from engine_bridge.transformers.transformers_adapter import TransformersEngine, llama_model

        def make(name: str):
            return TransformersEngine(llama_model(cfg, dtype=dtype, seed=SEED), num_blocks=256,
                                      max_batch_tokens=max(512, n_tokens), name=name)
        return make, "logprobs", (f"transformers {transformers.__version__} continuous batching, "
                                  f"LlamaForCausalLM with the reference weights ({shape})")
    check_engine(engine)
    raise AssertionError(engine)


def _score(o):
    return o.logits if hasattr(o, "logits") else o.logprob


def _same(x, y) -> bool:
    """Bit for bit: tensors by torch.equal, floats by their exact hex form."""
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    return (x is None and y is None) or (x is not None and y is not None and x.hex() == y.hex())


def _differing(got, want) -> str:
    """Which steps differ, and by how much at most (for a report of a mismatch)."""
    steps, worst = [], 0.0
    for k, (x, y) in enumerate(zip(got, want)):
        if not _same(x, y):
            steps.append(k)
            if isinstance(x, torch.Tensor):
                worst = max(worst, (x.double() - y.double()).abs().max().item())
            elif x is not None and y is not None:
                worst = max(worst, abs(x - y))
    return f"{steps} (largest difference {worst:.3g})"


def run(mnt: Path, *, dtype: str = "f32", n_decode: int = 40, prompt_repeats: int = 8,
        out=print, engine: str = "reference") -> bool:
    """Run the demo in MNT/demo with *engine*; True when every continuation matched bit for bit."""
    mnt = Path(mnt)
    cfg = ModelConfig()
    prompt = tokenize(PROMPT * prompt_repeats, cfg.vocab_size)
    make, what, desc = _engines(engine, cfg, dtype, len(prompt))
    work = mnt / "demo"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    before = _stats(mnt)

    out(f"engine A: {desc}, prompt of {len(prompt)} tokens, decoding {n_decode}")
    a = make("A")
    a.add_request("chat-1", prompt)
    t0 = time.perf_counter()
    first_toks, first_scores = a.generate(["chat-1"], n_decode)
    t_prefill = time.perf_counter() - t0
    last_tok, last_score = first_toks["chat-1"][-1], first_scores["chat-1"][-1]

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
    ref_toks, ref_scores = a.generate(["chat-1"], n_decode)
    ok = True
    for name in ("b", "c"):
        e = make(name.upper())
        t0 = time.perf_counter()
        e.page_in(work / name)
        t_in = time.perf_counter() - t0
        # The saved KV covers every token but the newest (as in vLLM): the first
        # step after a restore recomputes A's last step from the restored KV.
        replay = e.step(["chat-1"])["chat-1"]
        same_replay = replay.token == last_tok and _same(_score(replay), last_score)
        toks, scores = e.generate(["chat-1"], n_decode)
        same_tokens = toks["chat-1"] == ref_toks["chat-1"]
        same_scores = all(_same(x, y) for x, y in zip(scores["chat-1"], ref_scores["chat-1"]))
        ok &= same_tokens and same_scores and same_replay
        out(f"engine {name.upper()}: paged in {name} in {t_in * 1000:.0f} ms; last step replayed "
            f"{'bit-identical' if same_replay else 'DIFFERENT'}; decoded {n_decode} more: "
            f"tokens {'identical' if same_tokens else 'DIFFERENT'}, "
            f"{what} {'bit-identical' if same_scores else 'DIFFERENT'} to A uninterrupted")
        if not same_scores:
            out(f"  {what} differ at steps {_differing(scores['chat-1'], ref_scores['chat-1'])}")

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


def main(argv: list[str] | None = None) -> int:
    """``python -m engine_bridge.demo [--check] [--engine E] MOUNTPOINT``: what
    ``pffs demo`` runs once the mount is up (``--check``: whether *E* can run here)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engine_bridge.demo")
    ap.add_argument("--engine", default="reference")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--check", action="store_true", help="only say whether the engine can run here")
    ap.add_argument("mountpoint", nargs="?")
    args = ap.parse_args(argv)
    try:
        check_engine(args.engine)
        if args.check:
            return 0
        if args.mountpoint is None:
            ap.error("a mountpoint is needed")
        ok = run(Path(args.mountpoint), dtype=args.dtype, n_decode=args.tokens, engine=args.engine)
    except PffsError as e:
        print(e, file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
