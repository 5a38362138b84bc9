#!/usr/bin/env python3
"""One cache for many hosts: pffs's shared token-chain index beside SGLang's own SeaweedFS backend.

A real SeaweedFS server (tests/seaweed.py) and two real pffs mounts of one
bucket, each with its own cache folder, as on two hosts.  SGLang's real
HiCache stack on the CPU (tests/sglang_cpu.py) with Llama-3.1-8B's page
geometry (32 layers x 16 tokens x 8 KV heads x 128, bf16: 2 MiB pages;
``--small``: 4 layers x 16 x 2 x 64, 32 KiB pages), filled with real bf16 KV
values (tests' MiniLM data, each layer from its own offset) and a per-page
stamp, so every page differs (asserted by sha256).

Each round (pffs and SGLang interleaved, their order alternating):

1. host A (mount A, a HiCache with PffsHiCacheStorage) stores --mib MiB of
   pages by write-through; host B (mount B, a fresh HiCache) prefetches them
   by tokens alone, cold (B never saw them, its frame cache holds none of
   them): its MB/s.  Baseline: SGLang's ``seaweedfs`` backend on the same
   server, one HiCache storing, a fresh one prefetching the same tokens.
3. before that prefetch, ``batch_exists`` of 128 keys that host B never saw
   (kept by key on A, published) beside the SGLang backend's ``batch_exists``
   of the same 128 keys (HEADs of objects it holds under them).

Then: 2. the bytes each keeps in the bucket for the same pages, and what a
fork (``pffs from-tokens`` of A's pages) adds; 4. ``prefix_index.find`` of
128 keys in a namespace of many million keys (built with pffs's own schema
and ``cache_pages``); 5. the shared index's Publisher (4 threads) publishing
fresh keys: keys/s and the page-save rate it keeps up with.

Everything (mounts, server) is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

KV_FILE = Path("/work/shared/data/kv-minilm/kv.safetensors")
BATCH = 128     # SGLang's STORAGE_BATCH_SIZE (and the 128 keys of part 3)
IDENTITY = {"config_sha256": "be" * 32, "weights_sha256": "5e" * 32}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def med(xs):
    return statistics.median(xs)


# -- pages -------------------------------------------------------------------------

def real_source() -> tuple[torch.Tensor, str]:
    if KV_FILE.exists():
        from safetensors.torch import load_file
        t = load_file(str(KV_FILE))
        return (torch.cat([t["k_bf16"].flatten(), t["v_bf16"].flatten()]),
                f"real MiniLM bf16 KV values from {KV_FILE}, each layer from its own offset, a stamp a page")
    return torch.randn(1 << 22).to(torch.bfloat16), f"random normals ({KV_FILE} missing)"


def make_kv(src: torch.Tensor, L: int, n_tok: int, H: int, D: int, T: int, salt: int):
    """K and V (L, n_tok, H, D) bf16 from *src*, layer l of K/V starting at its own
    offset, and a stamp (salt, page) in the first 4 values of each page's K (positive
    finite bf16 words), so no two pages of any round are equal."""
    step = src.numel() // (2 * L)
    out = []
    for kv in range(2):
        t = torch.empty((L, n_tok, H, D), dtype=torch.bfloat16)
        for layer in range(L):
            flat = t[layer].view(-1)
            n = flat.numel()
            off = ((2 * layer + kv) * step + salt * 7919 * H * D) % src.numel()
            reps = -(-(n + off) // src.numel())
            flat.copy_(src.repeat(reps)[off:off + n])
        out.append(t)
    k16 = out[0].view(torch.int16)
    for p in range(n_tok // T):
        v = salt * 1_000_003 + p
        for w in range(4):
            k16[0, p * T, 0, w] = (v >> (14 * w)) & 0x3FFF
    return out[0], out[1]


def page_digests(k: torch.Tensor, v: torch.Tensor, T: int) -> list[str]:
    """sha256 of each SPEC §1 page (K[:, page] then V[:, page], C order): pffs's digests."""
    out = []
    for s in range(0, k.shape[1], T):
        h = hashlib.sha256()
        h.update(k[:, s:s + T].contiguous().view(torch.uint8).numpy().data)
        h.update(v[:, s:s + T].contiguous().view(torch.uint8).numpy().data)
        out.append("sha256:" + h.hexdigest())
    return out


def page_bytes_of(k, v, T, p) -> bytes:
    s = p * T
    return (k[:, s:s + T].contiguous().view(torch.uint8).numpy().tobytes()
            + v[:, s:s + T].contiguous().view(torch.uint8).numpy().tobytes())


# -- the mounts --------------------------------------------------------------------

def published(m, timeout=120.0) -> float:
    """Seconds until the mount's publishing threads are idle (.pffs/stats.json)."""
    from mountutil import wait_for
    t = time.perf_counter()
    wait_for(lambda: json.loads((m.path / ".pffs" / "stats.json").read_bytes())
             .get("shared_index", {}).get("pending", 1) == 0, timeout=timeout, what="publishing")
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=None, help="MiB of pages a round (512; --small 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a smaller geometry for a quick run")
    ap.add_argument("--index-keys", type=int, default=None, help="keys of part 4 (10,000,000; --small 200,000)")
    ap.add_argument("--index-seconds", type=float, default=180.0, help="most build time of part 4")
    ap.add_argument("--publish", type=int, default=None, help="keys of part 5 (2,000; --small 500)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--index-only", action="store_true", help="part 4 alone (no server, no engine)")
    a = ap.parse_args()
    if a.small:
        L, H, D, T = 4, 2, 64, 16
    else:
        L, H, D, T = 32, 8, 128, 16
    mib = a.mib if a.mib is not None else (8 if a.small else 512)
    index_keys = a.index_keys if a.index_keys is not None else (200_000 if a.small else 10_000_000)
    publish_n = a.publish if a.publish is not None else (500 if a.small else 2000)

    if a.index_only:
        tmp = Path(tempfile.mkdtemp(prefix="pffs-shared-index-bench-", dir=a.dir))
        try:
            part_index(tmp, index_keys, a.index_seconds)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    try:
        import sglang_cpu
        sglang_cpu.install()
    except ImportError as e:
        print(f"shared_index: SGLang does not import ({e}); nothing measured")
        return 0
    from seaweed import Seaweed, s3_mount_class, weed_problem
    problem = weed_problem()
    if problem:
        print(f"shared_index: SeaweedFS cannot run here: {problem}; nothing measured")
        return 0

    page_bytes = 2 * L * T * H * D * 2
    pages = max(BATCH, mib * 2**20 // page_bytes)
    n_tok = pages * T
    src, what = real_source()
    tmp = Path(tempfile.mkdtemp(prefix="pffs-shared-index-bench-", dir=a.dir))
    weed = Seaweed(tmp / "seaweed")
    mounts = []
    try:
        os.environ.update(weed.env())
        weed.start()
        S3Mount = s3_mount_class()
        bucket = weed.make_bucket("pffs")
        url = f"s3://{bucket}/kv"
        for n in ("a", "b", "c"):
            (tmp / n).mkdir()
            mounts.append(S3Mount(tmp / n, url).start())
        ma, mb, mc = mounts
        print(f"{pages} pages of {page_bytes / 2**20:g} MiB a round ({pages * page_bytes >> 20} MiB; "
              f"{L} layers x {T} tokens x {H} heads x {D}, bf16), {a.rounds} rounds; {what}; "
              f"SeaweedFS {weed.endpoint}, pffs mounts A, B (and C, the diagnostic) of {url} (own cache folders); "
              f"{os.cpu_count()} cores")
        res = run_rounds(a, weed, ma, mb, mc, bucket, src, L, H, D, T, pages, page_bytes)
        res.update(part_bytes(weed, ma, bucket, res, tmp))
        for m in mounts:
            m.stop()
        mounts_stopped = list(mounts)
        mounts.clear()
        for m in mounts_stopped:
            m.cleanup()
        res.update(part_index(tmp, index_keys, a.index_seconds))
        res.update(part_publish(tmp, weed, publish_n, page_bytes))
        table(res, a.rounds, page_bytes)
    finally:
        for m in mounts:
            try:
                if m.proc is not None:
                    m.stop()
            finally:
                m.cleanup()
        weed.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# -- parts 1 and 3: stores, cold prefetches, batch_exists ---------------------------

#: The readers of each round: host B (pffs), SGLang's fresh instance, and a diagnostic
#: pffs host C whose lookups in this process wait up to DIAG_DEADLINE seconds for the
#: bucket instead of pffs's 50 ms (shared_index.remote_run's deadline, patched here only).
DIAG = "pffs(5s)"
DIAG_DEADLINE = 5.0
READERS = ("pffs", "sglang", DIAG)


class deadline:
    """Within the block, shared_index.remote_run's default deadline is *secs* (None: as is)."""

    def __init__(self, secs):
        self.secs = secs

    def __enter__(self):
        from pffs.bucket import shared_index
        self.was = dict(shared_index.remote_run.__kwdefaults__)
        if self.secs is not None:
            shared_index.remote_run.__kwdefaults__ = {**self.was, "deadline": self.secs, "limit": self.secs}

    def __exit__(self, *exc):
        from pffs.bucket import shared_index
        shared_index.remote_run.__kwdefaults__ = self.was


def pffs_extra(mount) -> dict:
    return {"backend_name": "pffs", "module_path": "engine_bridge.sglang",
            "class_name": "PffsHiCacheStorage", "interface_v1": 1, "root": str(mount.path), **IDENTITY}


def run_rounds(a, weed, ma, mb, mc, bucket, src, L, H, D, T, pages, page_bytes) -> dict:
    import sglang_cpu
    from pffs.bucket import shared_index
    from pffs.client.prefix_lookup import cache_blobs

    n_tok = pages * T
    total = pages * page_bytes
    sg_bucket = weed.make_bucket("sglang")
    sg_extra = {"endpoint": weed.endpoint, "bucket": sg_bucket, "region": "us-east-1",
                "access_key": os.environ["AWS_ACCESS_KEY_ID"],
                "secret_key": os.environ["AWS_SECRET_ACCESS_KEY"]}
    kw = dict(page_size=T, n_layers=L, n_heads=H, head_dim=D, dtype=torch.bfloat16,
              device_tokens=n_tok, host_tokens=n_tok)
    r = {"pffs set": [], "sglang set": [], "publish lag": [], "tokens": [], "digests": []}
    for who in READERS:
        for what in ("get", "got", "exists", "exists found", "requests"):
            r[f"{who} {what}"] = []
    seen: set[str] = set()
    for rnd in range(a.rounds):
        k, v = make_kv(src, L, n_tok, H, D, T, salt=rnd + 1)
        digests = page_digests(k, v, T)
        assert len(set(digests)) == pages and not seen & set(digests), "pages are not all distinct"
        seen |= set(digests)
        base = 1000 + rnd * 2 * n_tok
        tokens = [(base + i) % 120_000 + 1 for i in range(n_tok)]
        # Part 3's keys: another 128 pages of tokens, kept by key on host A (pffs) and
        # under the same keys in SGLang's bucket, never seen by host B.
        xtokens = [(base + n_tok + i) % 120_000 + 1 for i in range(BATCH * T)]
        r["tokens"].append(tokens)
        r["digests"].append(digests)
        order = ("pffs", "sglang") if rnd % 2 == 0 else ("sglang", "pffs")
        for who in order:
            # host A: stores by write-through
            extra = pffs_extra(ma) if who == "pffs" else sg_extra
            backend = "dynamic" if who == "pffs" else "seaweedfs"
            with sglang_cpu.make_hicache(storage_backend=backend, backend_extra_config=extra, **kw) as hc:
                xkeys = hc.page_keys(xtokens)
                os.sync()
                t = time.perf_counter()
                hc.insert(tokens, k, v)
                hc.wait_storage_writes(timeout=600)
                r[f"{who} set"].append(time.perf_counter() - t)
                if who == "pffs":
                    r["publish lag"].append(published(ma))
                    space = hc.storage.space
                    cache_blobs(ma.path, space, list(zip(xkeys, digests[:BATCH])))
                    published(ma)
                else:
                    st = hc.storage
                    keys = hc.page_keys(tokens)
                    r.setdefault("sg copies", set()).update(st._object_key(x) for x in xkeys)
                    with ThreadPoolExecutor(16) as ex:
                        list(ex.map(lambda kk: st._s3.copy_object(
                            Bucket=sg_bucket, Key=st._object_key(kk[1]),
                            CopySource={"Bucket": sg_bucket, "Key": st._object_key(kk[0])}),
                            zip(keys[:BATCH], xkeys)))
            hc = st = None
            gc.collect()        # (a HiCache's pools sit in reference cycles: freed only by gc)
            readers = [(who, mb if who == "pffs" else None)] + ([(DIAG, mc)] if who == "pffs" else [])
            for reader, mount in readers:
                time.sleep(2.1)     # (past every recent-answer cache: pffs's HEADs, misses, quiet time)
                # host B: a fresh HiCache; batch_exists of 128 unseen keys, then a cold prefetch
                extra = pffs_extra(mount) if mount is not None else sg_extra
                with sglang_cpu.make_hicache(storage_backend=backend, backend_extra_config=extra,
                                             **kw) as hc, deadline(DIAG_DEADLINE if reader == DIAG else None):
                    # (warm: the first call opens the index and the bucket client; a key nobody has)
                    hc.storage.batch_exists(["0" * 64])
                    time.sleep(2.1)
                    before = shared_index.lookups().requests
                    t = time.perf_counter()
                    found = hc.storage.batch_exists(xkeys)
                    r[f"{reader} exists"].append(time.perf_counter() - t)
                    r[f"{reader} exists found"].append(found)
                    r[f"{reader} requests"].append(shared_index.lookups().requests - before)
                    time.sleep(2.1)
                    t = time.perf_counter()
                    host = hc.prefetch(tokens, timeout=600)
                    r[f"{reader} get"].append(time.perf_counter() - t)
                    got = len(host) // T
                    r[f"{reader} got"].append(got)
                    if got:
                        back = hc.host_page_bytes(host[[0, (got - 1) * T]].repeat_interleave(T)
                                                  + torch.arange(T).repeat(2))
                        assert back == [page_bytes_of(k, v, T, 0), page_bytes_of(k, v, T, got - 1)], \
                            f"{reader}: prefetched pages differ"
                hc = host = None
                gc.collect()
        print(f"round {rnd + 1}: pffs set {r['pffs set'][-1]:.2f} s, sglang set {r['sglang set'][-1]:.2f} s; "
            + "  ".join(f"{w}: get {r[f'{w} get'][-1]:.2f} s "
            f"({r[f'{w} got'][-1]}/{pages} pages), exists {r[f'{w} exists'][-1] * 1e3:.1f} ms "
            f"({r[f'{w} exists found'][-1]}/{BATCH})"
            for w in READERS) + f"; pffs publish lag {r['publish lag'][-1]:.2f} s; "
            f"rss {_rss_mib():.0f} MiB", flush=True)
        del k, v
    r["sg_bucket"] = sg_bucket
    r["pages"] = pages
    r["total"] = total
    return r


# -- part 2: bytes in the bucket, a fork ---------------------------------------------

def bucket_bytes(weed, bucket: str, prefix: str = "", skip=frozenset()) -> dict[str, tuple[int, int]]:
    """{area: (objects, bytes)} under *prefix*, area the first path part after it
    (objects named in *skip* left out)."""
    out: dict[str, list[int]] = {}
    for key, size in weed.objects(bucket, prefix).items():
        if key in skip:
            continue
        area = key[len(prefix):].split("/", 1)[0]
        c = out.setdefault(area, [0, 0])
        c[0] += 1
        c[1] += size
    return {k: (n, b) for k, (n, b) in out.items()}


def part_bytes(weed, ma, bucket, res, tmp) -> dict:
    from mountutil import pffs
    pf = bucket_bytes(weed, bucket, "kv/")
    sg = bucket_bytes(weed, res["sg_bucket"], skip=res.get("sg copies", set()))
    out = {"pffs areas": pf, "sglang areas": sg}
    # A fork of host A's last round's pages into a named session.
    tfile = tmp / "tokens.json"
    tfile.write_text(json.dumps(res["tokens"][-1]))
    templates = sorted((ma.path / ".hicache").glob("*.json"))
    t = time.perf_counter()
    r = pffs("from-tokens", ma.path / "fork", "--like", templates[0], "--tokens", tfile, check=False)
    out["fork s"] = time.perf_counter() - t
    out["fork rc"] = (r.returncode, (r.stdout + r.stderr).strip()[-300:])
    if r.returncode == 0:
        man = json.loads((ma.path / "fork" / "manifest.json").read_bytes())
        out["fork same pages"] = man["pages"] == res["digests"][-1]
    published(ma)
    out["pffs areas after fork"] = bucket_bytes(weed, bucket, "kv/")
    return out


# -- part 4: local lookup at scale -----------------------------------------------------

def key_of(i: int) -> str:
    return hashlib.sha256(b"k" + i.to_bytes(8, "little")).hexdigest()


def digest_of_i(i: int) -> str:
    return "sha256:" + hashlib.sha256(b"d" + i.to_bytes(8, "little")).hexdigest()


def part_index(tmp: Path, want: int, budget: float) -> dict:
    from pffs.namespace import prefix_index as pix
    from pffs.namespace import schema
    from pffs.namespace.rows import BlobRow, insert_blob_rows
    folder = tmp / "index"
    folder.mkdir()
    conn = schema.open_db(folder)
    space = "ab" * 32
    chunk = 250_000
    t0 = time.perf_counter()
    n = 0
    build_rates = []
    last_cache = None
    total = 0       # (the key-only cache's bytes, counted as the mount's writer thread counts them)
    while n < want and time.perf_counter() - t0 < budget:
        m = min(chunk, want - n)
        t = time.perf_counter()
        rows = [(key_of(i), digest_of_i(i), 2 << 20) for i in range(n, n + m)]
        conn.execute("BEGIN IMMEDIATE")
        insert_blob_rows(conn, [BlobRow(d, s, s // 2, "bp-zstd1") for _, d, s in rows])
        _, total = pix.cache_pages_counted(conn, space, rows, schema.now_ns(), 1 << 62, total)
        conn.execute("COMMIT")
        n += m
        last_cache = time.perf_counter() - t
        build_rates.append(m / last_cache)
    built = time.perf_counter() - t0
    # One write batch of 128 keys at this scale (what each HiCache batch_set costs the mount's index).
    rows = [(key_of(i), digest_of_i(i), 2 << 20) for i in range(n, n + BATCH)]
    conn.execute("BEGIN IMMEDIATE")
    insert_blob_rows(conn, [BlobRow(d, s, s // 2, "bp-zstd1") for _, d, s in rows])
    t = time.perf_counter()
    pix.cache_pages_counted(conn, space, rows, schema.now_ns(), 1 << 62, total)
    put128 = time.perf_counter() - t
    conn.execute("COMMIT")
    n += BATCH
    conn.close()
    size = (folder / schema.DB_NAME).stat().st_size
    conn = schema.open_db(folder)
    rnd = random.Random(7)
    times = []
    for _ in range(20):
        s = rnd.randrange(0, n - BATCH)
        keys = [key_of(i) for i in range(s, s + BATCH)]
        t = time.perf_counter()
        found = pix.find(conn, space, keys)
        times.append(time.perf_counter() - t)
        assert [d for d, _ in found] == [digest_of_i(i) for i in range(s, s + BATCH)]
    conn.close()
    print(f"index: {n:,} keys in {built:.0f} s ({n / built:,.0f} keys/s; last chunk {build_rates[-1]:,.0f} "
          f"keys/s), db {size / 2**30:.2f} GiB; find of 128: median {med(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms; cache_pages of 128 at this size {put128 * 1e3:.0f} ms", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return {"index keys": n, "index build s": built, "find": times, "cache_pages 128": put128,
            "index db": size}


# -- part 5: publishing ----------------------------------------------------------------

def part_publish(tmp: Path, weed, n: int, page_bytes: int) -> dict:
    from pffs.bucket.shared_index import Publisher
    from pffs.store.s3 import S3BlobStore
    bucket = weed.make_bucket("publish")
    (tmp / "pubcache").mkdir()
    blobs = S3BlobStore(tmp / "pubcache", f"s3://{bucket}/kv", options={"endpoint": weed.endpoint})
    pub = Publisher(blobs, threads=4)
    space = "cd" * 32
    pairs = [(key_of(10**9 + i), digest_of_i(10**9 + i)) for i in range(n)]
    t = time.perf_counter()
    for k in range(0, n, BATCH):            # (as a mount records them: a HiCache batch at a time)
        pub.publish(space, pairs[k:k + BATCH])
    ok = pub.flush(timeout=600)
    secs = time.perf_counter() - t
    counts = dict(pub.counts)
    pub.close()
    stored = len(weed.objects(bucket, "kv/index/"))
    # The same keys one publish() call each (the Publisher's 4 threads all busy).
    pub = Publisher(blobs, threads=4)
    pairs1 = [(key_of(2 * 10**9 + i), digest_of_i(i)) for i in range(n)]
    t = time.perf_counter()
    for p in pairs1:
        pub.publish(space, [p])
    pub.flush(timeout=600)
    secs1 = time.perf_counter() - t
    pub.close()
    blobs.close()
    print(f"publish: {n} keys in {secs:.2f} s ({n / secs:.0f} keys/s, batches of {BATCH}), flushed {ok}, "
          f"{counts}, {stored} index objects; one key a call: {n / secs1:.0f} keys/s", flush=True)
    return {"publish n": n, "publish s": secs, "publish s one": secs1, "publish counts": counts,
            "publish stored": stored, "page bytes": page_bytes}


# -- the table ---------------------------------------------------------------------------

def table(r: dict, rounds: int, page_bytes: int) -> None:
    total = r["total"]
    pages = r["pages"]
    print()
    print(f"== shared index: pffs beside SGLang's seaweedfs backend (median of {rounds} interleaved rounds) ==")

    def mbps(who):
        got = med(r[f"{who} got"])
        return got * page_bytes / med(r[f"{who} get"]) / 1e6, got

    pg, pgot = mbps("pffs")
    sgv, sgot = mbps("sglang")
    ps = total / med(r["pffs set"]) / 1e6
    ss = total / med(r["sglang set"]) / 1e6
    print(f"1. host B cold prefetch   pffs {pg:7.0f} MB/s ({pgot:.0f}/{pages} pages)   "
          f"SGLang seaweedfs {sgv:7.0f} MB/s ({sgot:.0f}/{pages})   pffs/SGLang {pg / sgv:.2f}x (target >= 1.0)")
    dg, dgot = mbps(DIAG)
    print(f"   diagnostic: host C, pffs lookups given {DIAG_DEADLINE:g} s instead of 50 ms: {dg:7.0f} MB/s "
          f"({dgot:.0f}/{pages}); pffs(5s)/SGLang {dg / sgv:.2f}x")
    print(f"   host A write-through   pffs {ps:7.0f} MB/s   SGLang seaweedfs {ss:7.0f} MB/s   "
          f"pffs/SGLang {ps / ss:.2f}x;  pffs publish lag after it: median {med(r['publish lag']):.2f} s")
    pf, sg = r["pffs areas"], r["sglang areas"]
    pf_b = sum(pf.get(x, (0, 0))[1] for x in ("blobs", "index"))
    sg_b = sum(b for _, b in sg.values())
    print(f"2. bucket bytes, {rounds * pages} pages   pffs blobs/+index/ {pf_b / 2**20:8.1f} MiB "
          f"({pf.get('blobs', (0, 0))[0]} blobs {pf.get('blobs', (0, 0))[1] / 2**20:.1f} MiB, "
          f"{pf.get('index', (0, 0))[0]} index entries {pf.get('index', (0, 0))[1] / 2**10:.1f} KiB; "
          f"all areas {sum(b for _, b in pf.values()) / 2**20:.1f} MiB)   SGLang {sg_b / 2**20:8.1f} MiB "
          f"({sum(n for n, _ in sg.values())} objects, part 3's copies left out)   "
          f"pffs/SGLang {pf_b / sg_b:.3f} (target <= 0.75)")
    af = r["pffs areas after fork"]
    print(f"   fork (pffs from-tokens of A's {pages} pages, {r['fork s']:.2f} s, rc {r['fork rc'][0]}"
          f"{', same pages' if r.get('fork same pages') else ''}): blobs "
          f"{pf.get('blobs', (0, 0))[1]:,} -> {af.get('blobs', (0, 0))[1]:,} bytes, index objects "
          f"{pf.get('index', (0, 0))[0]} -> {af.get('index', (0, 0))[0]}, all "
          f"{sum(b for _, b in pf.values()):,} -> {sum(b for _, b in af.values()):,} bytes")
    if r["fork rc"][0] != 0:
        print(f"   fork failed: {r['fork rc'][1]}")
    pe, se = med(r["pffs exists"]) * 1e3, med(r["sglang exists"]) * 1e3
    print(f"3. batch_exists of 128 unseen keys on host B   pffs {pe:6.1f} ms (found "
          f"{r['pffs exists found']}, requests {r['pffs requests']})   SGLang seaweedfs {se:6.1f} ms "
          f"(found {r['sglang exists found']})   pffs/SGLang {pe / se:.2f}x")
    de = med(r[f"{DIAG} exists"]) * 1e3
    print(f"   diagnostic: host C, lookups given {DIAG_DEADLINE:g} s: {de:6.1f} ms (found "
          f"{r[f'{DIAG} exists found']}, requests {r[f'{DIAG} requests']}); pffs(5s)/SGLang {de / se:.2f}x")
    f = med(r["find"]) * 1e3
    print(f"4. prefix_index.find of 128 keys in {r['index keys']:,} keys (built in {r['index build s']:.0f} s, "
          f"{r['index db'] / 2**30:.2f} GiB): median {f:.2f} ms of 20, max {max(r['find']) * 1e3:.2f} ms "
          f"(target <= 5 ms); cache_pages of 128 keys at that size: {r['cache_pages 128'] * 1e3:.0f} ms")
    kps = r["publish n"] / r["publish s"]
    kps1 = r["publish n"] / r["publish s one"]
    print(f"5. Publisher (4 threads), {r['publish n']} fresh keys in batches of {BATCH}: {kps:.0f} keys/s = "
          f"{kps * page_bytes / 1e9:.2f} GB/s of {page_bytes / 2**20:g} MiB pages (target >= 1 GB/s); "
          f"one key a call: {kps1:.0f} keys/s = {kps1 * page_bytes / 1e9:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
