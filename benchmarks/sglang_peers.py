#!/usr/bin/env python3
"""SGLang's HiCache storage tier: pffs (PffsHiCacheStorage) beside SGLang's own ``file`` backend.

SGLang's real HiCache stack (host pool ``MHATokenToKVPoolHost`` in
``page_first_direct``, its ``HybridCacheController``, the backend made by its
``StorageBackendFactory``) with Llama-3.1-8B's geometry (32 layers, 8 KV
heads, head_dim 128, bf16, pages of 16 tokens: 2 MiB), once with
``--hicache-storage-backend file`` (``HiCacheFile``: one raw file a page) and
once with pffs (``dynamic``, ``interface_v1``).  The host pool holds --mib
MiB of distinct real bf16 KV pages (asserted).  Both are driven through the
controller's own page functions, as its backup and prefetch threads call
them, 128 pages a call (SGLang's STORAGE_BATCH_SIZE): ``page_set_func``
(``HiCacheFile``: SGLang's copy of each page out of the host pool, then the
file; pffs: straight from the host pool), ``page_get_func`` back into the
host pool (bytes checked).

Each round, into fresh stores, in alternating order:
- set: every page (write-through);
- get cold: every page, with the stores' files evicted from the page cache
  (``posix_fadvise(DONTNEED)`` after a sync: the machine's cache cannot be
  dropped whole here);
- get warm: every page again.
Also the bytes each store holds.  Medians of the rounds; the ratios are
pffs's over the file backend's in MB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

L, H, D, T = 32, 8, 128, 16
BATCH = 128     # SGLang's STORAGE_BATCH_SIZE
SYSTEMS = ("file", "pffs")


def stored_bytes(folder: Path) -> int:
    """Bytes of the files under *folder* (a pffs store's ``reserve``, space it keeps
    for deletes on a full disk, not counted)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs
               if not (f == "reserve" and d == str(folder)))


class Op:
    """What the controller's page_get_func asks of its operation."""
    request_id = "bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    try:
        import sglang_cpu
        sglang_cpu.install()
    except ImportError as e:
        print(f"sglang_peers: SGLang does not import ({e}); nothing measured")
        return 0
    from bridge import evict, fill_real_kv

    from engine_bridge import KVPool
    from engine_bridge.core.pool import FLASHINFER
    from mountutil import Mount
    from pffs.client.chainkeys import chain_keys

    page_bytes = 2 * L * T * H * D * 2
    pages = a.mib * 2**20 // page_bytes
    tokens_n = pages * T
    total = pages * page_bytes
    src = KVPool([torch.empty((pages, 2, T, H, D), dtype=torch.bfloat16) for _ in range(L)], FLASHINFER)
    what = fill_real_kv(src)
    want = torch.empty((2, pages, L, T, H, D), dtype=torch.bfloat16)
    for layer in range(L):
        want[:, :, layer] = src.layers[layer].permute(1, 0, 2, 3, 4)
    del src
    tmp = Path(tempfile.mkdtemp(prefix="pffs-sglang-peers-", dir=a.dir))
    rows: dict[str, dict[str, list[float]]] = {s: {"set": [], "get cold": [], "get warm": []}
                                                for s in SYSTEMS}
    size: dict[str, list[int]] = {s: [] for s in SYSTEMS}
    idx = torch.arange(tokens_n, dtype=torch.int64)
    print(f"{pages} pages of {page_bytes >> 20} MiB ({total >> 20} MiB), {what}; SGLang "
          f"{__import__('sglang').__version__} host pool page_first_direct; {os.cpu_count()} cores")

    def run(system: str, rnd: int) -> None:
        here = tmp / f"{system}{rnd}"
        here.mkdir()
        mount = None
        if system == "file":
            kw = dict(storage_backend="file", storage_dir=str(here / "files"))
            folder = here / "files"
        else:
            mount = Mount(here).start()
            kw = dict(storage_backend="dynamic", backend_extra_config={
                "backend_name": "pffs", "module_path": "engine_bridge.sglang",
                "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mount.path),
                "config_sha256": "be" * 32, "weights_sha256": "5e" * 32})
            folder = mount.store
        try:
            with sglang_cpu.make_hicache(page_size=T, n_layers=L, n_heads=H, head_dim=D,
                                         dtype=torch.bfloat16, device_tokens=T * 4,
                                         host_tokens=tokens_n, **kw) as hc:
                ctl, host = hc.controller, hc.host_pool
                assert host.layout == "page_first_direct"
                host.kv_buffer[:, :pages] = want
                # (each round its own tokens: its own keys)
                keys = chain_keys([(rnd * 7919 + i * 31) % 32000 for i in range(tokens_n)], T)
                os.sync()
                t = time.perf_counter()
                for k in range(0, pages, BATCH):
                    ok = ctl.page_set_func(keys[k:k + BATCH], idx[k * T:(k + BATCH) * T])
                    assert ok, f"{system}: a set failed"
                rows[system]["set"].append(time.perf_counter() - t)
                size[system].append(stored_bytes(folder))
                for how in ("get cold", "get warm"):
                    if how == "get cold":
                        evict(folder)
                    host.kv_buffer[:, :pages].zero_()
                    t = time.perf_counter()
                    for k in range(0, pages, BATCH):
                        got = ctl.page_get_func(Op, keys[k:k + BATCH], idx[k * T:(k + BATCH) * T])
                        assert got == len(keys[k:k + BATCH]), f"{system}: a get found {got}"
                    rows[system][how].append(time.perf_counter() - t)
                    assert torch.equal(host.kv_buffer[:, :pages], want), f"{system}: pages changed"
        finally:
            if mount is not None:
                rc = mount.stop()
                if rc:
                    print(f"warning: the pffs daemon exited {rc}", file=sys.stderr)
                mount.cleanup()

    for rnd in range(a.rounds):
        for system in (SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]):
            run(system, rnd)
        print(f"round {rnd + 1}: " + "; ".join(
            f"{s} " + ", ".join(f"{k} {total / v[-1] / 1e6:.0f}" for k, v in rows[s].items())
            for s in SYSTEMS) + " MB/s", flush=True)

    print(f"\nmedians of {a.rounds} interleaved rounds, MB/s of pages "
          f"({os.cpu_count()} cores):\n{'':10}{'file':>10}{'pffs':>10}{'pffs/file':>11}")
    for how in ("set", "get cold", "get warm"):
        f, p = (total / statistics.median(rows[s][how]) / 1e6 for s in SYSTEMS)
        print(f"{how:10}{f:10.0f}{p:10.0f}{p / f:10.2f}x")
    fb, pb = (statistics.median(size[s]) for s in SYSTEMS)
    print(f"{'bytes':10}{fb / 2**20:9.0f}M{pb / 2**20:9.0f}M{pb / fb:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
