"""Read safetensors tensors as raw little-endian arrays (bf16 as uint16), torch-free."""

from __future__ import annotations

import json
import struct

import numpy as np

_DT = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U8": np.uint8}


def load_raw(path, name: str) -> np.ndarray:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header[name]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        buf = f.read(end - start)
    return np.frombuffer(buf, dtype=_DT[meta["dtype"]]).reshape(meta["shape"])
