#!/usr/bin/env python3
"""Engine bridge on a CUDA device: pinned staging versus plain copies, and a
bit-exact restore.

On a pool of --pool-gib GiB (Llama-3.1-8B geometry, bf16, 2 MiB pages) on
the GPU, prints GB/s of:

- bridge page-out through pinned staging on a side stream (double-buffered
  gather -> device-to-host) into a sink that only discards (the transfer
  alone), into one that hashes (what every sink does), and into a session
  folder on /dev/shm;
- bridge page-in from an in-memory session (verify -> host-to-device ->
  scatter) and from the /dev/shm folder;
- beside them, torch's plain ``.cpu()`` of the same blocks and plain
  ``.to(device)`` back, and a single pinned ``copy_`` (the link's ceiling).

Then runs the reference engine on the GPU, pages its sequences out and into
a fresh engine, and checks that 40 more tokens and their logits are bit for
bit those of the uninterrupted run (f32 and bf16).  Without CUDA it says so
and exits 0; ``--device cpu`` runs the same script on the CPU as a dry run.
"""

from __future__ import annotations

import os

# cuBLAS is deterministic only with a fixed workspace; set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_bridge import (Bridge, KVPool, MemorySession, RefCountingAllocator,  # noqa: E402
                           SeqBlocks)
from engine_bridge.reference.reference_engine import ReferenceEngine  # noqa: E402
from pffs.types import Digest, digest_of  # noqa: E402

GEOM = dict(block_size=16, n_layers=32, n_heads=8, head_dim=128)
_ZERO = Digest("sha256:" + "0" * 64)


class DiscardSink:
    """Takes pages and keeps nothing: measures the device-to-host path alone."""

    concurrent = True

    def write_page(self, ix, data):
        return _ZERO

    def write_manifest(self, data):
        pass

    def commit(self):
        pass

    def abort(self):
        pass


class HashSink(DiscardSink):
    """Hashes each page (as every real sink does) and keeps nothing."""

    def write_page(self, ix, data):
        return digest_of(data)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat):
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bit_exact_restore(device, dtype, tmp: Path) -> bool:
    prompts = {"a": [(7 * i + 3) % 512 for i in range(300)],
               "b": [(11 * i + 5) % 512 for i in range(77)],
               "c": [(13 * i + 1) % 512 for i in range(160)]}
    ids = list(prompts)
    e1 = ReferenceEngine(dtype=dtype, seed=1, device=device, num_blocks=128)
    for sid, p in prompts.items():
        e1.add_request(sid, p)
    last = None
    for _ in range(6):
        last = e1.step(ids)
    e1.page_out(tmp / f"restore-{dtype}")
    want_t, want_l = e1.generate(ids, 40)
    e2 = ReferenceEngine(dtype=dtype, seed=1, device=device, num_blocks=128)
    e2.add_request("other", [1] * 50)  # so the restored blocks land elsewhere
    e2.step(["other"])
    e2.page_in(tmp / f"restore-{dtype}")
    replay = e2.step(ids)
    ok = all(torch.equal(replay[s].logits, last[s].logits) for s in ids)
    got_t, got_l = e2.generate(ids, 40)
    ok = ok and got_t == want_t and all(torch.equal(x, y) for s in ids
                                         for x, y in zip(got_l[s], want_l[s]))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--staging-mib", type=int, default=128)
    ap.add_argument("--io-workers", type=int, default=0, help="hashing/I/O threads (default: the bridge's)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here: nothing to measure (use --device cpu for a dry run)")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"

    page = 2 * GEOM["n_layers"] * GEOM["block_size"] * GEOM["n_heads"] * GEOM["head_dim"] * 2
    nb = max(4, int(args.pool_gib * 2**30) // page)
    pool = KVPool.allocate(num_blocks=nb, dtype=torch.bfloat16, device=device, **GEOM)
    for layer in pool.layers:
        layer.normal_()
    order = torch.randperm(nb).tolist()
    seq = SeqBlocks("req-0", order, nb * GEOM["block_size"] - 3)
    total = nb * page
    bridge = Bridge(pool, RefCountingAllocator(nb), engine_name="gpu-bench",
                    staging_bytes=args.staging_mib << 20, io_workers=args.io_workers or None)
    print(f"{name}: pool of {total / 2**30:.2f} GiB bf16, {nb} pages of {page >> 20} MiB; "
          f"staging {args.staging_mib} MiB ({'pinned' if bridge.staging.pinned else 'pageable'}), "
          f"{bridge.io_workers} hashing/I-O threads, {os.cpu_count()} cores; best of {args.repeat}")
    rows = []

    def gbps(seconds):
        return total / seconds / 1e9

    # Plain torch copies of the same blocks, batch by batch as naive code would.
    batch = bridge.staging.max_batch
    idx = [torch.tensor(order[a:a + batch], device=device) for a in range(0, nb, batch)]

    def plain_out():
        return [torch.stack([t.index_select(1, i) for t in pool.layers]).cpu() for i in idx]

    host_copies = plain_out()

    def plain_in():
        for i, h in zip(idx, host_copies):
            d = h.to(device)
            for layer, t in enumerate(pool.layers):
                t.index_copy_(1, i, d[layer])

    big_dev = torch.empty(min(total, 1 << 30), dtype=torch.uint8, device=device)
    big_host = torch.empty(big_dev.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")

    def pinned_copy():
        big_host.copy_(big_dev, non_blocking=True)

    rows.append(("bridge page-out, transfer only (discarding sink)",
                 gbps(timed(lambda: bridge.page_out([seq], DiscardSink()), device, args.repeat))))
    rows.append(("bridge page-out, hashing sink",
                 gbps(timed(lambda: bridge.page_out([seq], HashSink()), device, args.repeat))))
    rows.append(("torch: gather + plain .cpu() per batch",
                 gbps(timed(plain_out, device, args.repeat))))
    t = timed(pinned_copy, device, args.repeat)
    rows.append(("torch: one pinned copy_ device->host (ceiling)", big_dev.numel() / t / 1e9))

    mem = MemorySession()
    bridge.page_out([seq], mem)

    def page_in_mem():
        res = bridge.page_in(mem)
        bridge.allocator.free(res.blocks)

    rows.append(("bridge page-in from memory (verify, host->device, scatter)",
                 gbps(timed(page_in_mem, device, args.repeat))))
    rows.append(("torch: plain .to(device) + scatter per batch", gbps(timed(plain_in, device, args.repeat))))
    del mem, host_copies

    # A RAM-backed folder keeps the disk out of the figures, if it has room.
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < total + (1 << 30):
        shm = Path(tempfile.gettempdir())
    tmp = Path(tempfile.mkdtemp(prefix="pffs-gpu-bench-", dir=shm))
    try:
        outs, ins = [], []
        for r in range(args.repeat):
            dest = tmp / f"s{r}"
            sync(device)
            t0 = time.perf_counter()
            bridge.page_out([seq], dest)
            outs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = bridge.page_in(dest)
            sync(device)
            ins.append(time.perf_counter() - t0)
            bridge.allocator.free(res.blocks)
            shutil.rmtree(dest)
        rows.append((f"bridge page-out -> folder on {shm}", gbps(min(outs))))
        rows.append((f"bridge page-in  <- folder on {shm}", gbps(min(ins))))

        width = max(len(r[0]) for r in rows)
        for label, v in rows:
            print(f"  {label:<{width}}  {v:7.2f} GB/s")

        del pool, bridge, big_dev, big_host
        ok = True
        for dtype in ("f32", "bf16"):
            good = bit_exact_restore(device, dtype, tmp)
            ok = ok and good
            print(f"bit-exact restore on {device.type} ({dtype}, 3 sequences, 40 tokens): "
                  f"{'PASS' if good else 'FAIL'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
