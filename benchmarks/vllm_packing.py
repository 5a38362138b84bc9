#!/usr/bin/env python3
"""What converting vLLM's CPU-kernel packing into SPEC §1 pages costs, beside no conversion.

vLLM's CPU attention keeps a head's block as a K region then a V region,
packed for its kernel (docs/engines.md §10).  The connector converts on the
way out and back on the way in.  This benchmark builds one pool of vLLM's
``LBHNC`` views per packing, all holding the same distinct pages of real
bf16 KV (each page's values shifted so no two pages are alike), and
measures, best of --repeat interleaved rounds (after one not counted), in one run:

- gather and scatter alone (the conversion: block <-> page bytes) for token
  rows (flash-attention's packing: a plain strided copy, no conversion),
  the vector kernels' packing (``vec``) and AMX's (``amx``), beside a
  contiguous copy of the same bytes;
- the bridge's page-out into an unmounted store and page-in from it (sha256,
  the default codec, blob writes), for each packing, on --threads I/O threads.

The packings are vLLM's own, probed with its ``cpu_attn_reshape_and_cache``
(an AMX packing is probed on any x86 host: writing it needs no AMX tiles).
Geometries: ``8b`` (Llama-3.1-8B: 32 layers, 8 KV heads x 128, blocks of
32 tokens, vLLM's CPU minimum: 4 MiB pages) and ``small`` (MiniLM: 6 layers,
12 heads x 32: 288 KiB pages).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from pffs_testdata import kv_file  # noqa: E402

from engine_bridge import Bridge, RefCountingAllocator, SeqBlocks  # noqa: E402
from engine_bridge.core.pool import VllmKVPool  # noqa: E402
from engine_bridge.vllm.packing import cpu_packing  # noqa: E402
from pffs.client.offline import StoreSessionSink, StoreSessionSource  # noqa: E402

GEOMETRIES = {
    "8b": dict(block_size=32, n_layers=32, n_heads=8, head_dim=128),
    "small": dict(block_size=32, n_layers=6, n_heads=12, head_dim=32),
}


def real_pages(n: int, page_elems: int) -> torch.Tensor:
    """*n* distinct pages of real bf16 KV values ``[n, page_elems]``."""
    path = kv_file(full=True)
    if path.exists():
        from safetensors.torch import load_file
        t = load_file(str(path))
        src = torch.cat([t["k_bf16"].flatten(), t["v_bf16"].flatten()])
    else:
        src = torch.randn(1 << 22).to(torch.bfloat16)
    reps = -(-n * page_elems // src.numel())
    flat = src.repeat(reps)[:n * page_elems].view(n, page_elems).clone()
    # Each page starts at another offset of the data, and its first value
    # says which page it is: no two pages alike, none easier to compress.
    for i in range(n):
        flat[i] = flat[i].roll(i * 4099)
        flat[i, 0] = float(i)
    return flat


def best(fn, repeat: int) -> float:
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def one_round(pool: VllmKVPool, bridge: Bridge, seq: SeqBlocks, pages: torch.Tensor,
              out: torch.Tensor, store: Path) -> list[float]:
    """Seconds of a gather, a scatter, a page-out into *store* and a page-in from it."""
    blocks = seq.block_ids
    got = [best(lambda: pool.gather(blocks, out), 1),
           best(lambda: pool.scatter(blocks, pages), 1),
           best(lambda: bridge.page_out([seq], StoreSessionSink(store, "s")), 1),
           best(lambda: bridge.allocator.free(bridge.page_in(StoreSessionSource(store, "s")).blocks), 1)]
    shutil.rmtree(store)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="the bridge's I/O threads")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    g = GEOMETRIES[a.geometry]
    page_bytes = 2 * g["n_layers"] * g["block_size"] * g["n_heads"] * g["head_dim"] * 2
    n = max(2, (a.pool_mib << 20) // page_bytes)
    pages = real_pages(n, page_bytes // 2).view(torch.uint8)
    total = n * page_bytes
    print(f"{a.geometry} geometry: {n} distinct pages of {page_bytes / 2**20:.2f} MiB "
          f"({total / 2**20:.0f} MiB), vLLM LBHNC views, best of {a.repeat}, "
          f"{a.threads} I/O threads, {os.cpu_count()} cores")
    packings = {"token rows (no conversion)": None,
                "vec": cpu_packing("vec", torch.bfloat16, g["block_size"], g["head_dim"]),
                "amx": cpu_packing("amx", torch.bfloat16, g["block_size"], g["head_dim"])}
    blocks = list(range(n))
    out = torch.empty_like(pages)
    copy_t = best(lambda: out.copy_(pages), a.repeat)
    print(f"{'contiguous copy of the same bytes':>34}: {total / copy_t / 1e6:8.0f} MB/s")
    base = Path(tempfile.mkdtemp(prefix="pffs-packing-bench-", dir=a.dir))
    pools, bridges = {}, {}
    for name, packing in packings.items():
        pool = pools[name] = VllmKVPool.allocate_vllm(num_blocks=n, dtype=torch.bfloat16,
                                                      order="LBHNC", packing=packing, **g)
        pool.scatter(blocks, pages)
        check = torch.empty_like(pages)
        pool.gather(blocks, check)
        assert torch.equal(check, pages), name
        bridges[name] = Bridge(pool, RefCountingAllocator(n), engine_name="bench", io_workers=a.threads)
    seq = SeqBlocks("r", blocks, n * g["block_size"], None)
    times: dict[str, list[float]] = {name: [float("inf")] * 4 for name in packings}
    try:
        # Interleaved rounds (one of each packing, then again): the host's drift
        # falls on every packing alike.  The first round warms the codec's
        # threads and the store's folders and is not counted.
        for r in range(a.repeat + 1):
            for name in packings:
                got = one_round(pools[name], bridges[name], seq, pages, out, base / f"{r}-{len(name)}")
                if r:
                    times[name] = [min(x, y) for x, y in zip(times[name], got)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [(name, *times[name]) for name in packings]
    ref = rows[0]
    print(f"{'packing':>34}  {'gather':>14}  {'scatter':>14}  {'page-out':>14}  {'page-in':>14}")
    for name, g_t, s_t, o_t, i_t in rows:
        cells = [f"{total / t / 1e6:6.0f} ({r / t:4.2f}x)" for t, r in
                 ((g_t, ref[1]), (s_t, ref[2]), (o_t, ref[3]), (i_t, ref[4]))]
        print(f"{name:>34}  " + "  ".join(f"{c:>14}" for c in cells))
    print("(MB/s; each ratio against token rows, which copy without converting)")


if __name__ == "__main__":
    main()
