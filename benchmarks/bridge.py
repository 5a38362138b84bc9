#!/usr/bin/env python3
"""Engine bridge speed on the CPU, beside baselines measured in the same run.

Builds a KV pool with the geometry of Llama-3.1-8B (32 layers, 8 KV heads,
head_dim 128, bf16, blocks of 16 tokens; 2 MiB pages) of --pool-mib MiB,
filled with real bf16 KV values (tests' MiniLM data, tiled), holding one
sequence over every block in shuffled order.  Prints MB/s of:

- page-out (gather -> staging -> sha256 -> file) and page-in (file ->
  sha256 -> staging -> scatter) through each sink (``--sink``; ``dir`` is
  a plain local directory, ``mount`` a pffs mount started for the run,
  ``store`` an unmounted store written with pffs.client.offline, and, while
  StoreSessionSink takes pages from one thread, ``store-threads`` the same
  sink taking them from the bridge's I/O threads); each repetition writes
  into a fresh place, so blobs are always compressed and stored anew;
- a plain tensor ``.clone()`` of the same bytes, sha256 alone, and the pffs
  default codec compressing the same page bytes on one core;
- page-out into the store beside the default codec alone;
- the reference engine recomputing the same number of tokens (prefill)
  versus restoring its own KV for them, and beside each sink's page-in.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from engine_bridge import (Bridge, DirSink, DirSource, KVPool, MemorySession,  # noqa: E402
                           RefCountingAllocator, SeqBlocks, store_access)
from engine_bridge.core.pool import VLLM_ORDERS, VllmKVPool  # noqa: E402
from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine  # noqa: E402
from pffs import codec  # noqa: E402
from pffs.client.offline import StoreSessionSink, StoreSessionSource  # noqa: E402
from pffs_testdata import kv_file  # noqa: E402

KV_FILE = kv_file(full=True)   # the full MiniLM KV where there is one, else tests/data's
GEOMETRIES = {
    "8b": dict(block_size=16, n_layers=32, n_heads=8, head_dim=128),     # Llama-3.1-8B: 2 MiB pages
    "small": dict(block_size=16, n_layers=6, n_heads=12, head_dim=32),   # all-MiniLM-L6-v2: 144 KiB pages
}
GEOM = GEOMETRIES["8b"]

class ConcurrentStoreSink(StoreSessionSink):
    """StoreSessionSink taking pages from several threads (its blob puts are thread-safe)."""

    concurrent = True


@contextlib.contextmanager
def dir_sink(root: Path):
    """A plain local directory."""
    root.mkdir(parents=True)
    yield lambda name: (root / name, root / name)


def _unmount(m) -> None:
    rc = m.stop()
    m.cleanup()
    if rc != 0:
        print(f"warning: the benchmark's pffs daemon exited {rc}", file=sys.stderr)


@contextlib.contextmanager
def _mounted(root: Path):
    sys.path.insert(0, str(ROOT / "tests"))
    from mountutil import Mount
    root.mkdir(parents=True)
    m = Mount(root).start()
    try:
        yield m
    finally:
        _unmount(m)


@contextlib.contextmanager
def mount_sink(root: Path):
    """A pffs mount (daemon in a subprocess, store under *root*), every byte through FUSE."""
    with _mounted(root) as m:
        yield lambda name: (DirSink(m.path / name), lambda: DirSource(m.path / name))


@contextlib.contextmanager
def direct_sink(root: Path):
    """The same mount, page bytes straight to and from its store (engine_bridge.transport.direct)."""
    with _mounted(root) as m:
        if store_access(m.path) is None:
            raise SystemExit("the direct path is not open on the benchmark's mount")
        yield lambda name: (m.path / name, m.path / name)


class _Weed:
    """One SeaweedFS for the run's S3 sinks (started on first use, stopped at exit)."""
    server = None
    made = 0

    @classmethod
    def bucket_url(cls, root: Path) -> str:
        sys.path.insert(0, str(ROOT / "tests"))
        from seaweed import Seaweed, weed_problem
        if cls.server is None:
            problem = weed_problem()
            if problem:
                raise SystemExit(f"cannot start SeaweedFS: {problem}")
            cls.server = Seaweed(Path(tempfile.mkdtemp(prefix="pffs-bridge-weed-")))
            os.environ.update(cls.server.env())
            cls.server.start()
            import atexit
            atexit.register(cls.server.stop)
        cls.made += 1
        return f"s3://{cls.server.make_bucket('bench')}/kv"


@contextlib.contextmanager
def _s3_mounted(root: Path):
    sys.path.insert(0, str(ROOT / "tests"))
    from seaweed import s3_mount_class
    url = _Weed.bucket_url(root)
    root.mkdir(parents=True)
    m = s3_mount_class()(root, url).start()

    def cold() -> None:
        # Page-ins read from the bucket: the mount's frame cache emptied, the daemon restarted.
        m.stop()
        shutil.rmtree(m.store / "blobs", ignore_errors=True)
        m.start()
    try:
        yield m, cold
    finally:
        _unmount(m)


@contextlib.contextmanager
def s3_mount_sink(root: Path):
    """A mount of an S3 store (SeaweedFS on loopback), every byte through FUSE; page-in cold."""
    with _s3_mounted(root) as (m, cold):
        yield lambda name: (DirSink(m.path / name), lambda: (cold(), DirSource(m.path / name))[1])


@contextlib.contextmanager
def s3_direct_sink(root: Path):
    """The same, page bytes straight to and from the bucket (engine_bridge.transport.direct); page-in cold."""
    with _s3_mounted(root) as (m, cold):
        access = store_access(m.path)
        if access is None or access.kind != "s3":
            raise SystemExit("the direct path is not open on the benchmark's S3 mount")
        yield lambda name: (m.path / name, lambda: (cold(), m.path / name)[1])


def store_sink(sink_cls):
    @contextlib.contextmanager
    def make(root: Path):
        """Straight into an unmounted store (no FUSE)."""
        root.mkdir(parents=True)
        store = root / "store"
        # The source is opened once the session is committed.
        yield lambda name: (sink_cls(store, name), lambda: StoreSessionSource(store, name))
    return make


# A sink context takes a scratch folder and yields a function that maps a
# session name to what Bridge.page_out accepts (a path or a SessionSink) and
# what page_in reads back (a path, a source, or a function opening one).
SINKS: dict[str, Callable[[Path], contextlib.AbstractContextManager]] = {
    "dir": dir_sink,
    "mount": mount_sink,
    "direct": direct_sink,
    "store": store_sink(StoreSessionSink),
    "s3-mount": s3_mount_sink,
    "s3-direct": s3_direct_sink,
}
#: Sinks measured only when asked for (they start a SeaweedFS server).
ON_REQUEST = {"s3-mount", "s3-direct"}
if not getattr(StoreSessionSink, "concurrent", False):
    SINKS["store-threads"] = store_sink(ConcurrentStoreSink)


def fill_real_kv(pool: KVPool) -> str:
    """Tile real bf16 KV values over the pool; random normals if the data is missing."""
    if KV_FILE.exists():
        from safetensors.torch import load_file
        t = load_file(str(KV_FILE))
        src = torch.cat([t["k_bf16"].flatten(), t["v_bf16"].flatten()])
        what = f"real MiniLM bf16 KV values from {KV_FILE}, tiled"
    else:
        src = torch.randn(1 << 22).to(torch.bfloat16)
        what = f"random normals ({KV_FILE} missing)"
    # Layers start at offsets spread over the source, so the layers within one
    # page never repeat each other (which would flatter the codec).
    step = src.numel() // len(pool.layers)
    for i, layer in enumerate(pool.layers):
        flat = layer.view(-1)
        n = flat.numel()
        reps = -(-n // src.numel())
        flat.copy_(src.roll(-i * step).repeat(reps)[:n])
    # Tiled values repeat a page every len(src) values: each page stamped its own
    # (its block number in its first values), so a content-addressed store dedups none.
    row = torch.empty((1, pool.page_bytes), dtype=torch.uint8)
    for b in range(pool.num_blocks):
        pool.gather([b], row)
        # (finite values: a NaN would not compare equal to itself after a round trip)
        row[0, :8] = torch.tensor([float(x) for x in (b + 1).to_bytes(4, "little")],
                                  dtype=torch.bfloat16).view(torch.uint8)
        pool.scatter([b], row)
    n = assert_distinct(pool)
    return f"{what}, {n} distinct pages (asserted)"


def evict(*folders) -> int:
    """Every file under *folders* out of the page cache, after a sync (the machine's
    cache cannot be dropped whole here); how many files."""
    os.sync()
    n = 0
    for folder in folders:
        for dirpath, _, files in os.walk(folder):
            for f in files:
                try:
                    fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                finally:
                    os.close(fd)
    return n


def assert_distinct(pool: KVPool) -> int:
    """The pool's pages are all distinct (sha256 of each); their number."""
    import hashlib
    row = torch.empty((1, pool.page_bytes), dtype=torch.uint8)
    seen = set()
    for b in range(pool.num_blocks):
        pool.gather([b], row)
        seen.add(hashlib.sha256(row.numpy().tobytes()).digest())
    assert len(seen) == pool.num_blocks, f"{pool.num_blocks - len(seen)} pages repeat another"
    return len(seen)


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bucket_alone(frames: list[bytes], threads: int, total: int, repeat: int) -> list[tuple[str, float]]:
    """Baselines of an S3 sink: plain boto3 put_object and get_object of the
    same frames (compressed pages), one object a page, on as many threads as
    an S3 store uploads on (its default upload_threads)."""
    from pffs.store.s3 import DEFAULT_UPLOAD_THREADS
    threads = DEFAULT_UPLOAD_THREADS
    _Weed.bucket_url(Path(tempfile.gettempdir()))  # (the server up, its AWS variables set)
    import boto3
    client = boto3.client("s3")
    bucket = _Weed.server.make_bucket("plain")
    keys = [f"plain/{i:06d}" for i in range(len(frames))]
    with ThreadPoolExecutor(threads) as ex:
        t_put = best_of(lambda: list(ex.map(lambda i: client.put_object(Bucket=bucket, Key=keys[i],
                                                                       Body=frames[i]),
                                            range(len(frames)))), repeat)
        t_get = best_of(lambda: list(ex.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(),
                                            keys)), repeat)
    return [(f"baseline: boto3 put_object of the frames, {threads} threads (page bytes/s)", mbps(total, t_put)),
            (f"baseline: boto3 get_object of the frames, {threads} threads (page bytes/s)", mbps(total, t_get))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-mib", type=int, default=512)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where sessions are written")
    ap.add_argument("--sink", action="append", choices=sorted(SINKS),
                    help="default: all but " + ", ".join(sorted(ON_REQUEST)))
    ap.add_argument("--staging-mib", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b",
                    help="page geometry: 8b (2 MiB pages, default) or small (144 KiB pages)")
    ap.add_argument("--threads", default="1,2", help="the bridge's I/O thread counts to measure (default 1,2)")
    ap.add_argument("--pool-layout", default="flash_attn", choices=["flash_attn", *VLLM_ORDERS],
                    help="the pool's layout: vLLM FlashAttention's 5-D tensors (default) or vLLM's "
                         "packed K/V views in one of its physical orders (engine_bridge.vllm)")
    args = ap.parse_args()
    global GEOM
    GEOM = GEOMETRIES[args.geometry]
    torch.manual_seed(0)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    itemsize = 2
    page = 2 * GEOM["n_layers"] * GEOM["block_size"] * GEOM["n_heads"] * GEOM["head_dim"] * itemsize
    num_blocks = max(2, (args.pool_mib << 20) // page)
    pool = KVPool.allocate(num_blocks=num_blocks, dtype=torch.bfloat16, **GEOM)
    what = fill_real_kv(pool)
    if args.pool_layout != "flash_attn":
        # The same page bytes in vLLM's views of that order.
        vpool = VllmKVPool.allocate_vllm(num_blocks=num_blocks, dtype=torch.bfloat16,
                                         order=args.pool_layout, **GEOM)
        for a in range(0, num_blocks, 16):
            ix = pool.block_index(range(a, min(a + 16, num_blocks)))
            buf = torch.empty((len(ix), page), dtype=torch.uint8)
            pool.gather(ix, buf)
            vpool.scatter(ix, buf)
        pool = vpool
        what += f", in vLLM's {args.pool_layout} views"
    order = torch.randperm(num_blocks).tolist()
    n_tokens = num_blocks * GEOM["block_size"] - 5
    seq = SeqBlocks("req-0", order, n_tokens, None)
    total = num_blocks * page
    print(f"pool: {total / 2**20:.0f} MiB bf16 ({args.geometry} geometry: {GEOM['n_layers']} layers x "
          f"{GEOM['n_heads']} KV heads x {GEOM['head_dim']}), "
          f"{num_blocks} pages of {page / 2**20:.1f} MiB, one sequence of {n_tokens} tokens; {what}")
    print(f"staging: {args.staging_mib} MiB host buffers ({'pinned' if torch.cuda.is_available() else 'plain'}), "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores, sessions under {args.dir}; "
          f"best of {args.repeat}")
    print()
    rows = []

    base = Path(tempfile.mkdtemp(prefix="pffs-bridge-bench-", dir=args.dir))
    threads_list = [int(x) for x in args.threads.split(",")]
    try:
        t_out: dict[tuple[str, int], float] = {}
        t_in: dict[tuple[str, int], float] = {}
        t_enc: dict[int, float] = {}
        t_dec: dict[int, float] = {}
        t_dec_sha: dict[int, float] = {}
        page_list: list[bytes] = []
        frames: list[bytes] = []
        for threads in threads_list:
            # One bridge for every sink, its staging buffers allocated and touched by
            # an untimed round trip first (an engine does that once, at its first page-out).
            bridge = Bridge(pool, RefCountingAllocator(num_blocks), engine_name="bench",
                            staging_bytes=args.staging_mib << 20, io_workers=threads)
            if not page_list:
                warm = MemorySession()
                bridge.page_out([seq], warm)
                bridge.allocator.free(bridge.page_in(warm).blocks)
                page_list = [warm.pages[i] for i in sorted(warm.pages)]
                # Named frames, as a store holds them (a read checks name and crc32).
                names = [hashlib.sha256(p).digest() for p in page_list]
                frames = [codec.encode(p, codec.DEFAULT_CODEC, name=n) for p, n in zip(page_list, names)]
                for f in frames[:8]:  # (the decoder's first use, untimed too)
                    codec.decode(f)
                del warm
            pool_ex = ThreadPoolExecutor(threads)

            def encode_alone() -> float:
                # What a page-out must do per page, on the same thread count: sha256 + encode.
                t0 = time.perf_counter()
                list(pool_ex.map(lambda p: (hashlib.sha256(p).digest(),
                                            codec.encode(p, codec.DEFAULT_CODEC)), page_list))
                return time.perf_counter() - t0

            def decode_alone(rehash: bool) -> float:
                # What a page-in must do per page: decode + the crc32 and name
                # check; *rehash*: decode + sha256 (how frames without a name are read).
                out = [bytearray(page) for _ in range(threads)]
                slot = threading.local()
                ids = iter(range(threads))
                lock = threading.Lock()

                def one(f):
                    buf = getattr(slot, "buf", None)
                    if buf is None:
                        with lock:
                            buf = slot.buf = out[next(ids)]
                    if rehash:
                        codec.decode_into(f, buf, check_crc=False)
                        hashlib.sha256(buf).digest()
                    else:
                        codec.decode_into_checked(f, buf, codec.frame_name(f))
                t0 = time.perf_counter()
                list(pool_ex.map(one, frames))
                return time.perf_counter() - t0

            # The codec alone on the same threads, while no daemon starts up beside it.
            sinks = args.sink or [x for x in SINKS if x not in ON_REQUEST]
            if any(x in ("direct", "store", "s3-direct") for x in sinks):
                t_enc[threads] = min(encode_alone() for _ in range(args.repeat))
            if any(x in ("direct", "s3-direct") for x in sinks):
                t_dec[threads] = min(decode_alone(False) for _ in range(args.repeat))
                t_dec_sha[threads] = min(decode_alone(True) for _ in range(args.repeat))
            if any(x.startswith("s3-") for x in sinks):
                rows.extend(bucket_alone(frames, threads, total, args.repeat))
            for sink_name in sinks:
                if threads != threads_list[0] and sink_name not in ("direct", "mount", "s3-direct",
                                                                    "s3-mount"):
                    continue
                mode = ("held in staging" if num_blocks <= bridge.staging.capacity
                        else "larger than staging: verified, then streamed")
                outs, ins = [], []
                scratch = base / f"{sink_name}-{threads}"
                for r in range(args.repeat):
                    # A fresh place each time: a store that already holds the blobs
                    # would skip compressing them.
                    with SINKS[sink_name](scratch / f"r{r}") as place:
                        dest, src = place("session")
                        t0 = time.perf_counter()
                        bridge.page_out([seq], dest)
                        outs.append(time.perf_counter() - t0)
                        if callable(src):
                            src = src()
                        t0 = time.perf_counter()
                        res = bridge.page_in(src)
                        ins.append(time.perf_counter() - t0)
                        bridge.allocator.free(res.blocks)
                        if hasattr(src, "close"):
                            src.close()
                        if isinstance(src, Path):
                            shutil.rmtree(src)
                    shutil.rmtree(scratch / f"r{r}", ignore_errors=True)
                t_out[sink_name, threads], t_in[sink_name, threads] = min(outs), min(ins)
                rows.append((f"page-out -> {sink_name}, {threads} threads (gather, sha256, write)",
                             mbps(total, min(outs))))
                rows.append((f"page-in  <- {sink_name}, {threads} threads (read, verify, scatter; {mode})",
                             mbps(total, min(ins))))
                shutil.rmtree(scratch, ignore_errors=True)
            if threads in t_enc:
                rows.append((f"baseline: sha256 + {codec.DEFAULT_CODEC} encode alone, {threads} threads",
                             mbps(total, t_enc[threads])))
            if threads in t_dec:
                rows.append((f"baseline: {codec.DEFAULT_CODEC} decode + crc32 alone, {threads} threads",
                             mbps(total, t_dec[threads])))
                rows.append((f"baseline: {codec.DEFAULT_CODEC} decode + sha256 alone, {threads} threads",
                             mbps(total, t_dec_sha[threads])))
            pool_ex.shutdown()

        t = best_of(lambda: [x.clone() for x in pool.layers], args.repeat)
        rows.append(("baseline: tensor .clone() of the pool", mbps(total, t)))

        pages = page_list
        plain = base / "plain"

        def write_files():
            shutil.rmtree(plain, ignore_errors=True)
            plain.mkdir()
            for i, p in enumerate(pages):
                with open(plain / f"{i:06d}", "wb") as f:
                    f.write(p)

        def read_files():
            for i in range(len(pages)):
                with open(plain / f"{i:06d}", "rb") as f:
                    f.read()

        rows.append(("baseline: write the page bytes to files, one thread", mbps(total, best_of(write_files, args.repeat))))
        rows.append(("baseline: read them back, one thread", mbps(total, best_of(read_files, args.repeat))))
        shutil.rmtree(plain)
        t = best_of(lambda: [hashlib.sha256(p).digest() for p in pages], 1)
        rows.append(("baseline: sha256 alone, one core", mbps(total, t)))
        t0 = time.perf_counter()
        stored = sum(len(codec.encode(p, codec.DEFAULT_CODEC)) for p in pages)
        t_codec = time.perf_counter() - t0
        rows.append((f"baseline: {codec.DEFAULT_CODEC} compress, one core (ratio {total / stored:.2f}x)",
                     mbps(total, t_codec)))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    for name, v in rows:
        print(f"  {name:<{width}}  {v:8.0f} MB/s")
    print()
    for direct, mount in (("direct", "mount"), ("s3-direct", "s3-mount")):
        for n in threads_list:
            if (direct, n) not in t_out:
                continue
            do, di = t_out[direct, n], t_in[direct, n]
            line = [f"{direct}, {n} threads: page-out {mbps(total, do):.0f} MB/s"]
            if n in t_enc:
                line.append(f"= {t_enc[n] / do:.2f}x encode + sha256 alone")
            if (mount, n) in t_out:
                line.append(f"= {t_out[mount, n] / do:.1f}x the mount path")
            line.append(f"; page-in {mbps(total, di):.0f} MB/s")
            if n in t_dec:
                line.append(f"= {t_dec[n] / di:.2f}x decode + crc32 alone, "
                            f"{t_dec_sha[n] / di:.2f}x decode + sha256 alone")
            if (mount, n) in t_in:
                line.append(f"= {t_in[mount, n] / di:.1f}x the mount path")
            print("  " + " ".join(line))
        if len(threads_list) > 1 and (direct, threads_list[0]) in t_out and (direct, threads_list[-1]) in t_out:
            a, b = threads_list[0], threads_list[-1]
            print(f"  {direct}, {b} threads against {a}: page-out {t_out[direct, a] / t_out[direct, b]:.2f}x, "
                  f"page-in {t_in[direct, a] / t_in[direct, b]:.2f}x")

    # Recompute versus restore, on the reference engine's own (tiny) model.
    print()
    cfg = ModelConfig(max_position=max(8192, n_tokens + 16))
    nb = -(-n_tokens // 16) + 1
    eng = ReferenceEngine(cfg, dtype="bf16", num_blocks=nb, seed=0)
    prompt = [(i * 7919) % cfg.vocab_size for i in range(n_tokens)]
    eng.add_request("r", prompt)
    t0 = time.perf_counter()
    eng.step(["r"])
    t_prefill = time.perf_counter() - t0
    sess = base.parent / (base.name + "-ref")
    try:
        eng.page_out(sess)
        eng2 = ReferenceEngine(cfg, dtype="bf16", num_blocks=nb, seed=0)
        t0 = time.perf_counter()
        eng2.page_in(sess)
        t_restore = time.perf_counter() - t0
    finally:
        shutil.rmtree(sess, ignore_errors=True)
    kv_bytes = eng.pool.page_bytes * -(-n_tokens // 16)
    print(f"reference engine ({cfg.n_layers} layers, d_model {cfg.d_model}, bf16): "
          f"prefill of {n_tokens} tokens {t_prefill:.2f} s = {n_tokens / t_prefill:,.0f} tokens/s")
    print(f"  restoring its KV for them ({kv_bytes / 2**20:.1f} MiB) from a plain directory: "
          f"{t_restore * 1e3:.0f} ms = {n_tokens / t_restore:,.0f} tokens/s "
          f"({t_prefill / t_restore:.1f}x faster than recomputing)")
    print(f"  the 8B-geometry session above ({total / 2**20:.0f} MiB) restores the same {n_tokens} tokens in:")
    for (name, n), t in t_in.items():
        print(f"    {name + f', {n} threads':<24} {t:6.2f} s  (the reference prefill took {t_prefill:.2f} s; "
              f"an 8B model's prefill needs ~{2 * 8e9 * n_tokens / 1e12:.0f} TFLOP for them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
