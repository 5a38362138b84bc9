#!/usr/bin/env python3
"""What ``-o verify=sha256`` costs the bridge's page-in, beside ``verify=crc32`` in the same run.

For each geometry (``8b``: Llama-3.1-8B's, 2 MiB pages; ``small``: MiniLM's,
144 KiB pages) a pool of --pool-mib MiB of real bf16 KV, every page distinct,
is paged out once into a pffs mount (the direct path); then the same store is
mounted with each verify mode in turn, twice each, interleaved, and the
session is paged in straight from the store (best of --repeat a mount).
Prints MB/s of page bytes for each mode and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bridge import GEOMETRIES, best_of, fill_real_kv, mbps  # noqa: E402
from mountutil import Mount  # noqa: E402

from engine_bridge import Bridge, KVPool, RefCountingAllocator, SeqBlocks  # noqa: E402


def pool_of(mib: int, geometry: dict) -> tuple[KVPool, int]:
    g = geometry
    page = 2 * g["n_layers"] * g["block_size"] * g["n_heads"] * g["head_dim"] * 2
    pool = KVPool.allocate(num_blocks=max(2, (mib << 20) // page), dtype=torch.bfloat16, **g)
    fill_real_kv(pool)
    for b in range(pool.num_blocks):     # (tiled values could repeat a page: each one made distinct)
        pool.layers[0][0, b, 0, 0, :4] = torch.tensor(list(b.to_bytes(4, "little")), dtype=torch.bfloat16)
    return pool, page


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--geometry", action="append", choices=sorted(GEOMETRIES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    for name in args.geometry or ["8b", "small"]:
        pool, page = pool_of(args.pool_mib, GEOMETRIES[name])
        bridge = Bridge(pool, RefCountingAllocator(pool.num_blocks), engine_name="bench")
        n = pool.num_blocks
        seq = SeqBlocks("s", list(range(n)), n * pool.block_size, list(range(n * pool.block_size)))
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            store = Path(tmp) / "store"
            (Path(tmp) / "w").mkdir()
            m = Mount(Path(tmp) / "w", store).start()
            try:
                bridge.page_out([seq], m.path / "s")
            finally:
                m.stop()
                m.cleanup()
            best: dict[str, float] = {}
            for i, mode in enumerate(["crc32", "sha256"] * 2):
                root = Path(tmp) / f"r{i}"
                root.mkdir()
                m = Mount(root, store, [f"verify={mode}"]).start()
                try:
                    def page_in(bridge=bridge, m=m) -> None:
                        bridge.allocator.free(bridge.page_in(m.path / "s").blocks)
                    page_in()       # (warm: the page cache holds the blob files)
                    best[mode] = min(best.get(mode, float("inf")), best_of(page_in, args.repeat))
                finally:
                    m.stop()
                    m.cleanup()
        total = n * page
        a, b = mbps(total, best["crc32"]), mbps(total, best["sha256"])
        print(f"{name}: {n} distinct pages of {page >> 10} KiB ({total >> 20} MiB), direct page-in:"
              f" verify=crc32 {a:.0f} MB/s, verify=sha256 {b:.0f} MB/s ({b / a:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
