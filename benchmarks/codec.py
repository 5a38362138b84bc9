#!/usr/bin/env python3
"""Codec ratios and one-core speeds on real KV pages, beside plain zstd.

For bf16 and fp16 pages cut from the MiniLM KV file (16 tokens, the
contract's §1 layout: the full file of $PFFS_TEST_DATA or ../shared/data where
there is one, else the repository's trimmed copy in tests/data; the first line
printed names it) and for os.urandom pages of the same size, prints for every pffs
codec the ratio and MB/s to compress and decompress a page at a time on one
core, next to plain zstd level 1 and 19 (python-zstandard, no pffs framing)
and the zstd command line, all measured in this run; then sha256 MB/s.
With --fp8: bf16 pages beside fp8 ones (the fp16 KV quantized to e4m3 and
e5m2 at a scale a layer, as an fp8 engine writes them), planes-zstd1
against zstd-1 and zstd-3.  With --low-plane: planes-zstd1's encode of
distinct real-KV pages at an 8B model's sizes (2 MiB: 16 tokens; 4 MiB:
vLLM's CPU block of 32), its low plane tried on samples first (as pffs
encodes) beside compressed whole (as before), in interleaved rounds: CPU
time a page on this thread and the bytes of the frames.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pffs import codec  # noqa: E402
from pffs_testdata import kv_file, tokens_in  # noqa: E402

KV_FILE = kv_file(full=True)


def fp8_pages(kind: str) -> list[bytes]:
    """The real f16 KV quantized as an fp8 engine writes it: each layer's K and V
    divided by a scale of their own (amax over the fp8 type's largest value), then
    rounded to e4m3 or e5m2; cut into pages as :func:`pages_of`."""
    import numpy as np
    import torch
    from pffs_testdata import load_raw
    fp8 = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}[kind]
    top = torch.finfo(fp8).max
    halves = []
    for name in ("k_fp16", "v_fp16"):
        t = torch.from_numpy(np.array(load_raw(KV_FILE, name)).view(np.float16)).float()
        scale = t.abs().amax(dim=tuple(range(1, t.dim())), keepdim=True) / top
        halves.append((t / scale).to(fp8).view(torch.uint8).numpy())
    k, v = halves
    return [np.ascontiguousarray(k[:, s:s + 16]).tobytes() + np.ascontiguousarray(v[:, s:s + 16]).tobytes()
            for s in range(0, k.shape[1], 16)]


def pages_of(kind: str) -> list[bytes]:
    if kind == "urandom":
        return [os.urandom(147456) for _ in range(128)]
    if kind.startswith("fp8"):
        return fp8_pages(kind)
    from conftest import kv_pages
    return kv_pages(kind, path=KV_FILE)


def timed(fn, items, min_time=0.3):
    """Best MB/s over repeated passes (at least min_time seconds in all)."""
    total = sum(len(x) for x in items)
    best = 0.0
    spent = 0.0
    out = None
    while spent < min_time or best == 0.0:
        t0 = time.perf_counter()
        out = [fn(x) for x in items]
        dt = time.perf_counter() - t0
        spent += dt
        best = max(best, total / dt / 1e6)
    return best, out


def cli_zstd(pages: list[bytes], level: int) -> tuple[float, float]:
    """zstd CLI compressing the pages as files (one process for all): ratio, MB/s."""
    exe = shutil.which("zstd")
    if not exe:
        return float("nan"), float("nan")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "src")
        src.mkdir()
        for i, p in enumerate(pages):
            (src / f"{i:06d}").write_bytes(p)
        out = Path(d, "out")
        out.mkdir()
        files = sorted(str(p) for p in src.iterdir())
        t0 = time.perf_counter()
        subprocess.run([exe, f"-{level}", "-q", "-T1", "--output-dir-flat", str(out), *files], check=True)
        dt = time.perf_counter() - t0
        stored = sum(p.stat().st_size for p in out.iterdir())
    raw = sum(map(len, pages))
    return raw / stored, raw / dt / 1e6


def low_plane(rounds: int) -> int:
    """--low-plane: the encode with the low plane sampled first, beside compressed whole."""
    import statistics

    import torch
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vllm_packing import real_pages
    print(f"real KV: {KV_FILE}; planes-zstd1 encode a page on one thread, medians of {rounds} "
          "interleaved rounds (thread CPU time)")
    whole_from = 1 << 62
    for tokens in (16, 32):
        pages = real_pages(32, 2 * 32 * tokens * 8 * 128).view(torch.uint8)
        views = [pages[i].numpy().data for i in range(len(pages))]
        got: dict[str, list[float]] = {"sampled": [], "whole": []}
        size: dict[str, int] = {}
        sampled_from = codec.LO_PROBE_FROM
        try:
            for r in range(rounds):
                for how in (("sampled", "whole") if r % 2 == 0 else ("whole", "sampled")):
                    codec.LO_PROBE_FROM = sampled_from if how == "sampled" else whole_from
                    t0 = time.thread_time()
                    frames = [codec.encode(v, "planes-zstd1") for v in views]
                    got[how].append((time.thread_time() - t0) / len(views) * 1e3)
                    size[how] = sum(map(len, frames))
        finally:
            codec.LO_PROBE_FROM = sampled_from
        mib = pages.shape[1] >> 20
        s, w = statistics.median(got["sampled"]), statistics.median(got["whole"])
        print(f"{mib} MiB pages ({len(views)} distinct): low plane sampled {s:.2f} ms "
              f"({pages.shape[1] / s / 1e3:.0f} MB/s), compressed whole {w:.2f} ms "
              f"({pages.shape[1] / w / 1e3:.0f} MB/s): {w / s:.2f}x; frames "
              f"{size['sampled'] / pages.numel():.4f} and {size['whole'] / pages.numel():.4f} of the bytes")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--fp8", action="store_true", help="fp8 pages (e4m3, e5m2) beside bf16: "
                    "planes-zstd1 against zstd-1 and zstd-3")
    ap.add_argument("--low-plane", action="store_true", help="planes-zstd1 encode at 2 and 4 MiB pages, "
                    "the low plane sampled first beside compressed whole")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (--low-plane)")
    args = ap.parse_args()
    if args.low_plane:
        return low_plane(args.rounds)
    kinds, codecs, levels = ("bf16", "fp16", "urandom"), ("planes-zstd1", "zstd-1", "zstd-19", "raw"), (1, 19)
    if args.fp8:
        kinds, codecs, levels = ("bf16", "fp8e4m3", "fp8e5m2"), ("planes-zstd1", "zstd-1", "zstd-3"), (1, 3)
    print(f"real KV: {KV_FILE} ({tokens_in(KV_FILE)} tokens, {tokens_in(KV_FILE) // 16} pages a dtype)")
    print(f"{'data':8} {'codec':22} {'ratio':>7} {'comp MB/s':>10} {'decomp MB/s':>12}")
    for kind in kinds:
        pages = pages_of(kind)
        raw = sum(map(len, pages))
        rows = []
        for name in codecs:
            c = codec.parse_codec(name)
            cmb, frames = timed(lambda p: codec.encode(p, c), pages, args.min_time)
            dmb, _ = timed(codec.decode, frames, args.min_time)
            rows.append((f"pffs {name}", raw / sum(map(len, frames)), cmb, dmb))
        for level in levels:
            z = zstandard.ZstdCompressor(level=level)
            dz = zstandard.ZstdDecompressor()
            cmb, frames = timed(z.compress, pages, args.min_time)
            dmb, _ = timed(dz.decompress, frames, args.min_time)
            rows.append((f"plain zstd-{level}", raw / sum(map(len, frames)), cmb, dmb))
        for level in levels:
            ratio, mbs = cli_zstd(pages, level)
            rows.append((f"zstd CLI -{level}", ratio, mbs, float("nan")))
        for label, ratio, cmb, dmb in rows:
            print(f"{kind:8} {label:22} {ratio:7.3f} {cmb:10.0f} {dmb:12.0f}")
    pages = pages_of("urandom")
    mbs, _ = timed(lambda p: hashlib.sha256(p).digest(), pages, args.min_time)
    print(f"sha256 of 147456-byte pages: {mbs:.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
