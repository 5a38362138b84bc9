#!/usr/bin/env python3
"""Every GPU check of the project, in one run of under 8 minutes on a CUDA machine.

Runs, one after the other with what is left of --budget seconds each:

1. ``gpu_bridge.py``: the bridge's pinned-staging page-out and page-in
   beside torch's plain and pinned copies of the same blocks, and a
   bit-exact restore of the reference engine (f32 and bf16);
2. ``gpu_vllm.py``: vLLM with the pffs connector: save, ``cp -r`` fork,
   load in a fresh engine (tokens and logprobs identical to computing), the
   connector's page-out/page-in beside torch's pinned copies.

Each prints its figures beside its baselines; this prints a last line per
script (passed, failed, or ran out of time) and exits non-zero if any did
not pass.  Without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHECKS = [
    ("gpu_bridge", ["--pool-gib", "4", "--repeat", "3"]),
    ("gpu_vllm", ["--layers", "16", "--prompt-tokens", "4000"]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all of them (default 480)")
    a = ap.parse_args()
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("gpu_all: no CUDA device; nothing measured")
        return 0
    end = time.monotonic() + a.budget
    results = []
    for name, args in CHECKS:
        left = end - time.monotonic()
        if left < 30:
            results.append((name, "not run: out of time"))
            continue
        print(f"==== {name} {' '.join(args)}", flush=True)
        try:
            rc = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *args], timeout=left).returncode
            results.append((name, "passed" if rc == 0 else f"failed (exit {rc})"))
        except subprocess.TimeoutExpired:
            results.append((name, f"ran out of time ({a.budget:.0f} s in all)"))
    for name, what in results:
        print(f"gpu_all: {name}: {what}")
    return 0 if all(what == "passed" for _, what in results) else 1


if __name__ == "__main__":
    sys.exit(main())
