#!/usr/bin/env python3
"""SGLang's HiCache storage tier on pffs (PffsHiCacheStorage) beside the bridge's direct path.

SGLang's real host KV pool (``MHATokenToKVPoolHost``, ``page_first_direct``)
with Llama-3.1-8B's geometry (32 layers, 8 KV heads, head_dim 128, bf16,
pages of 16 tokens: 2 MiB) holds --mib MiB of real bf16 KV values (tests'
MiniLM data, tiled).  Each repetition, into two fresh stores:

- the backend's ``batch_set_v1`` of every page (128 a call, as SGLang's
  controller calls it) into mount A, then ``batch_get_v1`` of them all back
  into the host pool (bytes checked);
- the bridge's direct page-out of the same pages (a KV pool holding the same
  bytes) into mount B as a session, then its ``load_into`` back.

Both use the same number of I/O threads.  Prints MB/s of each and the ratio.
The workarounds SGLang needs without an accelerator are tests/sglang_cpu.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    try:
        import sglang_cpu
        sglang_cpu.install()
    except ImportError as e:
        print(f"sglang_hicache: SGLang does not import ({e}); nothing measured")
        return 0
    from bridge import fill_real_kv

    from engine_bridge import Bridge, KVPool, SeqBlocks
    from engine_bridge.core.pool import FLASHINFER
    from engine_bridge.sglang import PffsHiCacheStorage
    from mountutil import Mount
    from pffs.client.chainkeys import chain_keys
    from pffs.manifest import parse

    page_bytes = 2 * L * T * H * D * 2
    pages = a.mib * 2**20 // page_bytes
    tokens_n = pages * T
    pool = KVPool([torch.empty((pages, 2, T, H, D), dtype=torch.bfloat16) for _ in range(L)], FLASHINFER)
    what = fill_real_kv(pool)
    hc = sglang_cpu.make_hicache(page_size=T, n_layers=L, n_heads=H, head_dim=D, dtype=torch.bfloat16,
                                 storage_backend=None, device_tokens=tokens_n, host_tokens=tokens_n)
    host = hc.host_pool
    for layer in range(L):
        host.kv_buffer[:, :pages, layer] = pool.layers[layer].permute(1, 0, 2, 3, 4)
    want = host.kv_buffer[:, :pages].clone()
    print(f"{pages} pages of {page_bytes >> 20} MiB ({pages * page_bytes >> 20} MiB), {what}; "
          f"SGLang host pool {host.layout}; {a.threads} I/O threads each; {os.cpu_count()} cores")
    tmp = Path(tempfile.mkdtemp(prefix="pffs-sglang-bench-", dir=a.dir))
    rows: dict[str, list[float]] = {"backend set": [], "backend get": [], "direct page-out": [],
                                    "direct load_into": []}
    try:
        for rep in range(a.repeat):
            mounts = []
            for n in ("a", "b"):
                (tmp / f"{n}{rep}").mkdir()
                mounts.append(Mount(tmp / f"{n}{rep}").start())
            try:
                ma, mb = (m.path for m in mounts)
                tokens = [(rep * 7919 + i * 31) % 32000 for i in range(tokens_n)]
                keys = chain_keys(tokens, T)
                cfg = dataclasses.replace(_config(), extra_config={"root": str(ma), "interface_v1": 1,
                                                  "config_sha256": "be" * 32, "weights_sha256": "5e" * 32,
                                                  "io_threads": a.threads})
                st = PffsHiCacheStorage(cfg, {})
                st.register_mem_pool_host(host)
                idx = torch.arange(tokens_n, dtype=torch.int64)
                os.sync()       # (each timing starts with no write-back of the one before)
                t = time.perf_counter()
                for k in range(0, pages, BATCH):
                    ok = st.batch_set_v1(keys[k:k + BATCH], idx[k * T:(k + BATCH) * T])
                    assert all(ok), "a set failed"
                rows["backend set"].append(time.perf_counter() - t)
                host.kv_buffer[:, :pages].zero_()
                t = time.perf_counter()
                for k in range(0, pages, BATCH):
                    ok = st.batch_get_v1(keys[k:k + BATCH], idx[k * T:(k + BATCH) * T])
                    assert all(ok), "a get failed"
                rows["backend get"].append(time.perf_counter() - t)
                assert torch.equal(host.kv_buffer[:, :pages], want), "the pages came back changed"
                st.close()

                bridge = Bridge(pool, None, io_workers=a.threads)
                os.sync()
                t = time.perf_counter()
                m = bridge.page_out([SeqBlocks("b", list(range(pages)), tokens_n, tokens)], mb / "s")
                rows["direct page-out"].append(time.perf_counter() - t)
                t = time.perf_counter()
                bridge.load_into(mb / "s", list(range(pages)), list(range(pages)))
                rows["direct load_into"].append(time.perf_counter() - t)
                if rep == 0:
                    from pffs.client.prefix_lookup import longest_prefix
                    same = longest_prefix(ma, st.space, keys, touch=False) == \
                        parse((mb / "s" / "manifest.json").read_bytes()).pages == m.pages
                    print(f"the backend's blobs are the session's pages: {same}")
            finally:
                for mo in mounts:
                    mo.stop()
                    mo.cleanup()
    finally:
        hc.close()
    total = pages * page_bytes
    for what_, secs in rows.items():
        print(f"{what_:18} {total / min(secs) / 1e6:7.0f} MB/s   "
              + "  ".join(f"{s:.3f} s" for s in secs))
    for a_, b_ in (("backend set", "direct page-out"), ("backend get", "direct load_into")):
        print(f"{a_}: {min(rows[b_]) / min(rows[a_]):.2f}x the bridge's {b_} (best of {a.repeat})")
    return 0


def _config():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=None)


if __name__ == "__main__":
    sys.exit(main())
