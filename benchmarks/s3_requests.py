#!/usr/bin/env python3
"""What one S3 request costs in CPU: boto3's ``get_object`` beside pffs's lean path.

A SeaweedFS server on loopback (tests/seaweed.py); 128 distinct real-KV 8B
pages (2 MiB: 32 layers x 16 tokens x 8 heads x 128, bf16), stored raw (as
SGLang's seaweedfs backend keeps them) and as pffs frames.  Each case reads
all 128 on 4 threads; printed per request: the client process's CPU
(user + system) and the server's, and MB/s of page bytes.  Interleaved
rounds (default 3):

- a 1 KB object's GET, through boto3 and through pffs.store.s3lean;
- a page frame's GET (1.4 MiB), both ways;
- SGLang's read: boto3 GET of the raw page and a copy into the host pool's
  K and V runs;
- pffs's read: the lean GET of the frame, decoded straight into the runs,
  sha256 checked (as an S3 mount verifies); and the same through boto3.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

N, THREADS = 128, 4


def proc_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return proc_cpu(pid) + sum(tree_cpu(int(k)) for k in kids)


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import boto3
    import shared_index as si
    from botocore.config import Config
    from seaweed import ACCESS_KEY, SECRET_KEY, Seaweed, weed_problem

    from pffs import codec
    from pffs.store.s3lean import LeanS3
    if weed_problem():
        print(f"s3_requests: SeaweedFS cannot run here: {weed_problem()}; nothing measured")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="pffs-s3-requests-"))
    weed = Seaweed(tmp)
    try:
        weed.start()
        src, what = si.real_source()
        L, H, D, T = 32, 8, 128, 16
        k, v = si.make_kv(src, L, N * T, H, D, T, salt=7)
        pages = [si.page_bytes_of(k, v, T, p) for p in range(N)]
        names = [hashlib.sha256(p).digest() for p in pages]
        assert len(set(names)) == N, "pages are not all distinct"
        frames = [codec.encode(p, name=n) for p, n in zip(pages, names)]
        bucket = weed.make_bucket("req")
        session = boto3.session.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                                        region_name="us-east-1")
        cl = session.client("s3", endpoint_url=weed.endpoint, config=Config(
            max_pool_connections=32, request_checksum_calculation="when_required",
            response_checksum_validation="when_required"))
        lean = LeanS3(cl, session.get_credentials(), bucket, "path", 10.0)
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda i: cl.put_object(Bucket=bucket, Key=f"f{i}", Body=frames[i]), range(N)))
            list(ex.map(lambda i: cl.put_object(Bucket=bucket, Key=f"p{i}", Body=pages[i]), range(N)))
        cl.put_object(Bucket=bucket, Key="tiny", Body=b"x" * 1000)
        local = threading.local()

        def runs() -> list[bytearray]:
            if not hasattr(local, "runs"):      # (the host pool's K and V of one page)
                local.runs = [bytearray(len(pages[0]) // 2) for _ in range(2)]
            return local.runs

        def boto(key: str) -> bytes:
            return cl.get_object(Bucket=bucket, Key=key)["Body"].read()

        def sglang_read(i: int) -> None:
            d, (kk, vv) = boto(f"p{i}"), runs()
            h = len(d) // 2
            memoryview(kk)[:] = memoryview(d)[:h]
            memoryview(vv)[:] = memoryview(d)[h:]

        cases = {
            "1 KB GET, boto3": lambda i: boto("tiny"),
            "1 KB GET, lean": lambda i: lean.send("GET", "tiny"),
            "frame GET, boto3": lambda i: boto(f"f{i}"),
            "frame GET, lean": lambda i: lean.send("GET", f"f{i}"),
            "SGLang read (boto3 GET, copy)": sglang_read,
            "pffs read (lean GET, decode, sha256)": lambda i: codec.decode_into_runs(
                lean.send("GET", f"f{i}").body, runs(), names[i], rehash=True),
            "pffs read through boto3": lambda i: codec.decode_into_runs(
                boto(f"f{i}"), runs(), names[i], rehash=True),
        }
        print(f"{N} distinct 2 MiB pages ({what}), {THREADS} threads, SeaweedFS on loopback, "
              f"{os.cpu_count()} cores; frames {sum(map(len, frames)) / sum(map(len, pages)):.3f}x the bytes")
        got: dict[str, list[tuple[float, float, float]]] = {c: [] for c in cases}
        for _ in range(a.rounds):
            for name, fn in cases.items():
                c0, w0, t0 = self_cpu(), tree_cpu(weed.proc.pid), time.perf_counter()
                with ThreadPoolExecutor(THREADS) as ex:
                    list(ex.map(fn, range(N)))
                dt = time.perf_counter() - t0
                got[name].append(((self_cpu() - c0) / N * 1e3, (tree_cpu(weed.proc.pid) - w0) / N * 1e3,
                                  N * len(pages[0]) / dt / 1e6))
        print(f"{'':40s} client CPU ms/request   server CPU ms/request   MB/s of pages (rounds)")
        for name, xs in got.items():
            print(f"{name:40s} " + "   ".join(
                ", ".join(f"{x[j]:.2f}" if j < 2 else f"{x[j]:.0f}" for x in xs) for j in range(3)))
    finally:
        weed.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
