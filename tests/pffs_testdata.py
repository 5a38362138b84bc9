"""The tests' real KV data, and safetensors tensors read as raw little-endian
arrays (bf16 as uint16), torch-free.

Tests read the trimmed copy in the repository (tests/data/kv-minilm, its
README says how it was cut), so a plain clone tests itself; $PFFS_TEST_DATA
names another data folder (the full file) for them.  Benchmarks read the full
file where there is one ($PFFS_TEST_DATA, else ../shared/data beside the
checkout) and say which file they measured.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
IN_REPO = REPO / "tests" / "data"          # the trimmed copy: 512 tokens
BESIDE = REPO.parent / "shared" / "data"    # the full file, where the checkout has one beside it
KV_NAME = Path("kv-minilm") / "kv.safetensors"

_DT = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U8": np.uint8}


def kv_file(full: bool = False) -> Path:
    """The MiniLM KV file: $PFFS_TEST_DATA's if set; else, for *full* (benchmarks),
    the one in ../shared/data where it exists; else the repository's trimmed copy."""
    env = os.environ.get("PFFS_TEST_DATA")
    if env:
        return Path(env) / KV_NAME
    if full and (BESIDE / KV_NAME).exists():
        return BESIDE / KV_NAME
    return IN_REPO / KV_NAME


def tokens_in(path) -> int:
    """Tokens a tensor of the KV file holds (its shape's second axis)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header["k_bf16"]["shape"][1]


def load_raw(path, name: str) -> np.ndarray:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header[name]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        buf = f.read(end - start)
    return np.frombuffer(buf, dtype=_DT[meta["dtype"]]).reshape(meta["shape"])
