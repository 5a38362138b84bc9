#!/usr/bin/env python3
"""`cp -r` of a session within the mount, beside `cp -r` within a local folder,
`pffs fork`, and the same `cp -r` with copy_file_range off, in one run.

The session has Llama-3.1-8B's geometry by default (2 MiB pages: 32 layers x
16 tokens x 8 KV heads x 128 x K,V x bf16), its bytes real bf16 KV values
(the shared MiniLM tensors, laid end to end, each page stamped to be its own).
Prints seconds and MB/s of each copy, the ratio to the local copy, the blob
bytes each added to the store, and whether the copy checks (sha256sum -c of
every page, `pffs check --read-data` of the store at the end). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import kv_pages  # noqa: E402
from fs import Floor, borg_create  # noqa: E402
from mountutil import Mount  # noqa: E402
from pffs_testdata import kv_file  # noqa: E402
from sessions import make_manifest  # noqa: E402

# The full MiniLM KV where there is one ($PFFS_TEST_DATA, ../shared/data), else tests/data's.
KV_FILE = kv_file(full=True)

GEOMETRIES = {
    "8b": dict(n_layers=32, n_heads=8, head_dim=128),      # 2 MiB pages
    "small": dict(n_layers=6, n_heads=12, head_dim=32),    # all-MiniLM-L6-v2: 144 KiB pages
}


def pages_of(geometry: dict, total: int) -> list[bytes]:
    size = 2 * geometry["n_layers"] * 16 * geometry["n_heads"] * geometry["head_dim"] * 2
    real = b"".join(kv_pages("bf16", path=KV_FILE))
    out = []
    for i in range(max(1, total // size)):
        start = (i * 7919 * 64) % len(real)
        page = bytearray((real[start:] + real * (size // len(real) + 2))[:size])
        for off in range(0, size, 1 << 16):          # stamped: every page its own
            page[off:off + 8] = (i * 1_000_003 + off).to_bytes(8, "little")
        out.append(bytes(page))
    return out


def write_local(path: Path, pages: list[bytes], geometry: dict) -> None:
    (path / "pages").mkdir(parents=True)
    for i, p in enumerate(pages):
        (path / "pages" / f"{i:06d}").write_bytes(p)
    (path / "manifest.json").write_bytes(make_manifest(pages, **geometry).to_json())


def stats(mnt: Path) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def timed(*cmd) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(c) for c in cmd], check=True)
    return time.perf_counter() - t0


def checks(src: Path, dst: Path) -> bool:
    sums = subprocess.run(["sha256sum"] + sorted(os.listdir(src / "pages")), cwd=src / "pages",
                          check=True, capture_output=True, text=True).stdout
    r = subprocess.run(["sha256sum", "-c", "--quiet", "-"], input=sums, cwd=dst / "pages",
                       capture_output=True, text=True)
    return r.returncode == 0


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cold_read(session: Path, mount: Mount | None = None) -> tuple[float, float, float]:
    """Seconds to read every page file of *session* with the page cache dropped
    first, and the CPU-s cat took and *mount*'s daemon (0 without one)."""
    drop_caches()
    files = sorted(str(p) for p in (session / "pages").iterdir())
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    d0 = mount.cpu() if mount is not None else 0.0
    t = time.perf_counter()
    subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "sh", *files], check=True)
    t = time.perf_counter() - t
    kids2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (t, kids2.ru_utime + kids2.ru_stime - kids.ru_utime - kids.ru_stime,
            mount.cpu() - d0 if mount is not None else 0.0)


def borg_snapshot(work: Path) -> tuple[float | None, float | None]:
    """borg create --compression zstd,3 of the session, page cache dropped first:
    seconds and stored ratio (None without borg)."""
    if shutil.which("borg") is None:
        return None, None
    return borg_create(work / "src", work / "borg-repo", before=drop_caches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="session size in MiB")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on /tmp's disk)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of cp -r within the mount")
    args = ap.parse_args()
    geometry = GEOMETRIES[args.geometry]
    work = Path(tempfile.mkdtemp(prefix="pffs-copies-", dir=args.dir))
    try:
        pages = pages_of(geometry, args.mib << 20)
        nbytes = sum(map(len, pages))
        print(f"session: {len(pages)} pages of {len(pages[0]) / 2**20:.2f} MiB ({args.geometry} geometry),"
              f" {nbytes / 2**20:.0f} MiB of real bf16 KV values from {KV_FILE}")
        write_local(work / "src", pages, geometry)
        subprocess.run(["sync"], check=True)
        # (row 0, cp -r within a local folder, is timed in rounds beside the mount's)
        rows = [("", 0.0, None, True),
                ("cp -r + sync within a local folder",
                 timed("sh", "-c", f"cp -r '{work / 'src'}' '{work / 'local-copy2'}' && sync"), None, True)]

        borg_t, borg_ratio = borg_snapshot(work)
        local_read, local_cat, _ = cold_read(work / "src")

        (work / "m").mkdir()
        m = Mount(work / "m").start()
        try:
            snap = timed("sh", "-c", f"cp -r '{work / 'src'}' '{m.path / 'a'}' && sync")
            snap_ratio = nbytes / stats(m.path)["stored_bytes"]
            # cp -r within the mount, in rounds alternating with the same cp -r
            # within a local folder and cp of as many files within pyfuse3 doing
            # nothing (benchmarks/fuse_floor.py: the round trips alone).
            s0 = stats(m.path)["stored_bytes"]
            within, local_within, floor = [], [], []
            with Floor(work / "floor", len(pages) + 1, len(pages[0])) as fl:
                for r in range(args.rounds):
                    subprocess.run(["sync"], check=True)    # (no write-back left from the round before)
                    local_within.append(timed("cp", "-r", work / "src", work / f"local-copy-{r}"))
                    shutil.rmtree(work / f"local-copy-{r}")
                    within.append(timed("cp", "-r", m.path / "a", m.path / ("b" if r == 0 else f"b{r}")))
                    floor.append(timed("sh", "-c", f"mkdir '{fl}/c{r}' && cp '{fl}'/0* '{fl}/c{r}/'"))
            med = statistics.median
            t = med(within)
            rows.append(("cp -r within the mount", t, stats(m.path)["stored_bytes"] - s0,
                         checks(work / "src", m.path / "b")))
            print(f"cp -r within the mount, {args.rounds} rounds: {fmt(within)} s; within a local folder:"
                  f" {fmt(local_within)} s ({med(local_within) / t:.2f}x); cp of as many files within"
                  f" pyfuse3 doing nothing: {fmt(floor)} s ({med(local_within) / med(floor):.2f}x)")
            local = med(local_within)
            rows[0] = (f"cp -r within a local folder (median of {args.rounds})", local, None, True)
            t = timed("sh", "-c", f"cp -r '{m.path / 'a'}' '{m.path / 'b2'}' && sync")
            rows.append(("cp -r + sync within the mount", t, None, checks(work / "src", m.path / "b2")))
            s0 = stats(m.path)["stored_bytes"]
            t = timed(sys.executable, "-m", "pffs.cli", "fork", m.path / "a", m.path / "c")
            rows.append(("pffs fork within the mount", t, stats(m.path)["stored_bytes"] - s0,
                         checks(work / "src", m.path / "c")))
        finally:
            m.stop()
        m = Mount(work / "m").start()   # (a fresh daemon: nothing cached in it)
        try:
            mount_read, mount_cat, mount_daemon = cold_read(m.path / "a", m)
        finally:
            m.stop()
        # The same cold read with every page decoded in the daemon already (its
        # blob cache made to hold them all, the kernel's page cache dropped):
        # what a cold read costs beyond decoding, the requests and the copies.
        m = Mount(work / "m", opts=[f"cache_size={(nbytes >> 20) + 64}M"]).start()
        try:
            cold_read(m.path / "a", m)
            held_read, held_cat, held_daemon = cold_read(m.path / "a", m)
        finally:
            m.stop()
        os.environ["PFFS_STOCK_PYFUSE3"] = "1"
        m = Mount(work / "m").start()
        try:
            s0 = stats(m.path)["stored_bytes"]
            t = timed("cp", "-r", m.path / "a", m.path / "d")
            rows.append(("cp -r within the mount, copy_file_range off", t,
                         stats(m.path)["stored_bytes"] - s0, checks(work / "src", m.path / "d")))
        finally:
            m.stop()
            del os.environ["PFFS_STOCK_PYFUSE3"]
        check = subprocess.run([sys.executable, "-m", "pffs.cli", "check", "--read-data", "--store",
                                str(m.store)], capture_output=True, text=True)
        print(f"\n{'':46} {'s':>7} {'MB/s':>8} {'vs local':>9} {'new blob bytes':>15}  sha256sum -c")
        for name, t, added, ok in rows:
            print(f"{name:46} {t:7.2f} {nbytes / t / 1e6:8.0f} {local / t:8.2f}x "
                  f"{'-' if added is None else added:>15}  {'ok' if ok else 'FAILED'}")
        print("\nsnapshot of the local session (s, MB/s, stored ratio, vs borg):")
        if borg_t is not None:
            print(f"  borg create --compression zstd,3            {borg_t:7.2f} {nbytes / borg_t / 1e6:8.0f}"
                  f"  {borg_ratio:.2f}x")
        else:
            print("  borg create: borg is not installed (apt install borgbackup)")
        vs = f"{borg_t / snap:.2f}x borg" if borg_t else ""
        print(f"  cp -r + sync into the mount                 {snap:7.2f} {nbytes / snap / 1e6:8.0f}"
              f"  {snap_ratio:.2f}x  {vs}")
        print(f"cold read of every page (cat > /dev/null, page cache dropped): local {local_read:.2f} s "
              f"({nbytes / local_read / 1e6:.0f} MB/s), mount {mount_read:.2f} s "
              f"({nbytes / mount_read / 1e6:.0f} MB/s) = {local_read / mount_read:.2f}x local")
        cores = os.cpu_count() or 1
        bound = (mount_cat + mount_daemon) / cores
        print(f"  its CPU: cat {local_cat:.2f} CPU-s locally; cat {mount_cat:.2f} and the daemon {mount_daemon:.2f}"
              f" from the mount: over {cores} cores at least {bound:.2f} s, at most {local_read / bound:.2f}x local")
        print(f"  with every page decoded in the daemon already (its cache holding them, the kernel's dropped):"
              f" {held_read:.2f} s = {local_read / held_read:.2f}x local (cat {held_cat:.2f}, the daemon"
              f" {held_daemon:.2f} CPU-s)")
        print(f"\npffs check --read-data: {check.stdout.strip().splitlines()[-1] if check.stdout else ''}"
              f" (exit {check.returncode})")
        return 0 if check.returncode == 0 and all(r[3] for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
