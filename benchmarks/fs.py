#!/usr/bin/env python3
"""Filesystem speed beside plain local tools, all measured in one run.

1. Write a session of real bf16 KV pages (varied so every page differs) with
   `cp -r` + `sync` into the mount, beside (a) the same copy into a plain
   local directory, (b) the same work done by plain tools: `sha256sum` of
   the files plus `zstd -1` of each into a local directory, + `sync`, and
   (c) `cp -r` into a pyfuse3 filesystem that drops what it is given.
2. Read it back cold (remount, drop the kernel's caches) beside a cold read
   of the plain directory and (c) the same files served by a pyfuse3
   filesystem that does no work at all (benchmarks/fuse_floor.py): the round
   trips every pyfuse3 filesystem pays per file.
3. Forks: `cp -r`, `pffs fork`, and the metadata-only recipe.
4. `ls -l` of a 10,000-page session (and of 10,000 files of (c)), and the
   two quick forks again at that size, to show how they grow.
Prints seconds, MB/s, stored bytes, the daemon's CPU time and peak RSS, and each ratio.
Needs root (FUSE, drop_caches).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import kv_pages  # noqa: E402
from mountutil import Mount  # noqa: E402
from sessions import make_manifest, varied_pages, write_session  # noqa: E402


def sh(*cmd, cwd=None):
    subprocess.run(cmd, check=True, cwd=cwd, stdout=subprocess.DEVNULL)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_tree(path: Path) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 20):
                    total += len(chunk)
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def quick_forks(m, name: str, n: int) -> tuple[float, float, float]:
    """Seconds for `pffs fork` (the command, then the same work in this process)
    and the metadata-only recipe, each forking session *name* of *n* pages."""
    src = m / name
    t_cmd = timed(lambda: sh(sys.executable, "-m", "pffs.cli", "fork", str(src), str(m / f"{name}-fork")))
    t_inproc = timed(lambda: __import__("pffs.tools", fromlist=["fork"]).fork(
        str(src), str(m / f"{name}-fork2")))

    def meta():
        (m / f"{name}-meta" / "pages").mkdir(parents=True)
        shutil.copyfile(src / "manifest.json", m / f"{name}-meta" / "manifest.json")
    t_meta = timed(meta)
    for f in ("fork", "fork2", "meta"):
        assert len(os.listdir(m / f"{name}-{f}" / "pages")) == n
    return t_cmd, t_inproc, t_meta


def print_quick_forks(t_cmd: float, t_inproc: float, t_meta: float) -> None:
    print(f"{'pffs fork (command, incl. startup)':34} {t_cmd:8.3f}")
    print(f"{'pffs fork (the work itself)':34} {t_inproc:8.3f}")
    print(f"{'mkdir pages + cp manifest.json':34} {t_meta:8.3f}")


class Floor:
    """benchmarks/fuse_floor.py mounted: pyfuse3 answering every request at once."""

    def __init__(self, where: Path, n: int, size: int):
        self.path = where
        where.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fuse_floor.py"),
                                      str(where), str(n), str(size)])
        end = time.monotonic() + 30
        while not os.path.ismount(where):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("benchmarks/fuse_floor.py did not mount")
            time.sleep(0.05)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
        self.proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="session size in MiB")
    ap.add_argument("--ls-pages", type=int, default=10_000)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on /tmp's disk)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pffs-bench-", dir=args.dir))
    try:
        base = kv_pages("bf16")
        n = args.mib * (1 << 20) // len(base[0])
        pages = varied_pages(base, n)
        src = work / "src"
        write_session(src, pages)
        del pages
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        mb = size / 1e6
        print(f"session: {n} pages of {len(base[0])} bytes, {size / 2**20:.0f} MiB; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start")
        drop_caches()
        sh("cat", *[str(p) for p in sorted((src / "pages").iterdir())[:1]])

        # (a) plain copy into a local directory
        plain = work / "plain"
        t_plain = timed(lambda: (sh("cp", "-r", str(src), str(plain)), sh("sync")))
        # (b) the same work by plain tools: hash and compress every file
        zdir = work / "zstd"
        zdir.mkdir()
        files = sorted(str(p) for p in (src / "pages").iterdir()) + [str(src / "manifest.json")]
        t_tools = timed(lambda: (
            subprocess.run(["sha256sum", *files], check=True, stdout=subprocess.DEVNULL),
            sh("zstd", "-1", "-q", "-T1", "--output-dir-flat", str(zdir), *files), sh("sync")))
        zbytes = sum(p.stat().st_size for p in zdir.iterdir())

        (work / "m").mkdir()
        m = Mount(work / "m", work / "store")
        rss_max = 0
        orig_stop = m.stop

        def stop_and_measure():
            nonlocal rss_max
            rss_max = max(rss_max, peak_rss(m.proc.pid))
            return orig_stop()
        m.stop = stop_and_measure
        m.start()
        try:
            c0 = cpu_seconds(m.proc.pid)
            t_pffs = timed(lambda: (sh("cp", "-r", str(src), str(m / "s")), sh("sync")))
            st = json.loads((m / ".pffs" / "stats.json").read_text())
            cpu_write = cpu_seconds(m.proc.pid) - c0
            print(f"\n{'write':34} {'seconds':>8} {'MB/s':>8} {'stored MiB':>11}")
            print(f"{'pffs cp -r + sync':34} {t_pffs:8.2f} {mb / t_pffs:8.0f} {st['stored_bytes'] / 2**20:11.1f}")
            print(f"{'(a) cp -r to local dir + sync':34} {t_plain:8.2f} {mb / t_plain:8.0f} {size / 2**20:11.1f}")
            print(f"{'(b) sha256sum + zstd -1 + sync':34} {t_tools:8.2f} {mb / t_tools:8.0f} {zbytes / 2**20:11.1f}")
            with Floor(work / "floor-w", 0, len(base[0])) as fl:
                t_wfloor = timed(lambda: sh("cp", "-r", str(src), str(fl / "s")))
            print(f"{'(c) cp -r to pyfuse3 doing nothing':34} {t_wfloor:8.2f} {mb / t_wfloor:8.0f} {0:11.1f}")
            print(f"pffs write / (b): {t_tools / t_pffs:.2f}x   pffs write / (a): {t_plain / t_pffs:.2f}x   "
                  f"compression {st['compression_ratio']:.3f} (zstd -1: {size / zbytes:.3f})")
            print(f"daemon CPU for the write: {cpu_write:.2f} s ({cpu_write / n * 1e3:.2f} ms a page)")

            # Cold reads
            m.stop()
            m.start()
            cold = drop_caches()
            c0 = cpu_seconds(m.proc.pid)
            t_read = timed(lambda: read_tree(m / "s"))
            cpu_read = cpu_seconds(m.proc.pid) - c0
            drop_caches()
            t_read_plain = timed(lambda: read_tree(plain))
            print(f"\n{'cold read' + ('' if cold else ' (caches NOT dropped)'):34} {'seconds':>8} {'MB/s':>8}")
            print(f"{'pffs':34} {t_read:8.2f} {mb / t_read:8.0f}")
            print(f"{'local directory':34} {t_read_plain:8.2f} {mb / t_read_plain:8.0f}")
            with Floor(work / "floor", n, len(base[0])) as fl:
                drop_caches()
                t_floor = timed(lambda: read_tree(fl))
            print(f"{'(c) pyfuse3 doing nothing, same files':34} {t_floor:8.2f} {mb / t_floor:8.0f}")
            print(f"pffs cold read / local: {t_read_plain / t_read:.2f}x   (c) / local: "
                  f"{t_read_plain / t_floor:.2f}x   pffs / (c): {t_floor / t_read:.2f}x")
            print(f"daemon CPU for the cold read: {cpu_read:.2f} s ({cpu_read / n * 1e3:.2f} ms a page)")

            # Forks
            before = json.loads((m / ".pffs" / "stats.json").read_text())["stored_bytes"]
            t_cp = timed(lambda: sh("cp", "-r", str(m / "s"), str(m / "fork-cp")))
            t_fork, t_fork_inproc, t_meta = quick_forks(m, "s", n)
            after = json.loads((m / ".pffs" / "stats.json").read_text())["stored_bytes"]
            print(f"\n{'fork of ' + str(n) + ' pages':34} {'seconds':>8}")
            print(f"{'cp -r':34} {t_cp:8.3f}")
            print_quick_forks(t_fork, t_fork_inproc, t_meta)
            print(f"stored bytes added by 4 forks: {after - before}")

            # ls -l of a big session (one page digest listed many times)
            big = make_manifest(varied_pages(base, 1) * args.ls_pages)  # page 0 of the session
            (m / "big" / "pages").mkdir(parents=True)
            (m / "big" / "manifest.json").write_bytes(big.to_json())
            assert len(os.listdir(m / "big" / "pages")) == args.ls_pages
            m.stop()
            m.start()
            t_ls = timed(lambda: subprocess.run(["ls", "-l", str(m / "big" / "pages")], check=True,
                                                stdout=subprocess.DEVNULL))
            t_ls2 = timed(lambda: subprocess.run(["ls", "-l", str(m / "big" / "pages")], check=True,
                                                 stdout=subprocess.DEVNULL))
            with Floor(work / "floor-ls", args.ls_pages, len(base[0])) as fl:
                t_ls_floor = timed(lambda: subprocess.run(["ls", "-l", str(fl)], check=True,
                                                          stdout=subprocess.DEVNULL))
            print(f"\nls -l of {args.ls_pages} pages: {t_ls:.3f} s cold, {t_ls2:.3f} s warm; "
                  f"(c) pyfuse3 doing nothing: {t_ls_floor:.3f} s")
            # How the forks grow with the session: the same three at 10,000 pages.
            print(f"\n{'fork of ' + str(args.ls_pages) + ' pages':34} {'seconds':>8}")
            print_quick_forks(*quick_forks(m, "big", args.ls_pages))
            m.stop()
            print(f"daemon peak RSS (largest over the mounts of this run): {rss_max / 2**20:.0f} MiB")
        finally:
            if m.proc is not None:
                m.stop()
            m.cleanup()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
