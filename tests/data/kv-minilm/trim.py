#!/usr/bin/env python3
"""Make tests/data/kv-minilm/kv.safetensors: the first TOKENS tokens of every
tensor of the full MiniLM KV file (README.md beside this script says what it
holds and why it is trimmed).

    python tests/data/kv-minilm/trim.py ../shared/data/kv-minilm/kv.safetensors

Each tensor keeps its name, dtype and layout [n_layers, tokens, n_heads,
head_dim]; only the token axis is cut.  numpy only, so the bytes written
depend on nothing but the source file: run twice, the same sha256.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))          # tests/: pffs_testdata

from pffs_testdata import load_raw  # noqa: E402

TOKENS = 512     # 32 pages of 16 tokens a dtype: 9.4 MB for the four tensors
NAMES = ("k_bf16", "v_bf16", "k_fp16", "v_fp16")
DTYPES = {"k_bf16": "BF16", "v_bf16": "BF16", "k_fp16": "F16", "v_fp16": "F16"}


def header_of(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def trim(src: Path, dst: Path, tokens: int = TOKENS) -> None:
    meta = dict(header_of(src).get("__metadata__", {}))
    full = meta.get("tokens")
    meta.update(tokens=str(tokens), trimmed_from=f"{full} tokens: the first {tokens} of each tensor")
    header: dict = {"__metadata__": meta}
    blobs = []
    at = 0
    for name in NAMES:
        a = load_raw(src, name)
        cut = a[:, :tokens].copy(order="C")
        raw = cut.tobytes()
        header[name] = {"dtype": DTYPES[name], "shape": list(cut.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)               # (the data starts 8-byte aligned)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    tmp.replace(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="the full kv.safetensors (6 x 2048 x 12 x 32 a tensor)")
    ap.add_argument("dst", type=Path, nargs="?", default=HERE / "kv.safetensors")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="tokens kept (a multiple of 16)")
    args = ap.parse_args()
    if args.tokens <= 0 or args.tokens % 16:
        ap.error(f"--tokens {args.tokens}: not a positive multiple of 16")
    trim(args.src, args.dst, args.tokens)
    print(f"{args.dst}: {args.dst.stat().st_size} bytes, the first {args.tokens} tokens of {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
