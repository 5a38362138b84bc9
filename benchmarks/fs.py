#!/usr/bin/env python3
"""Filesystem speed beside plain local tools, all measured in one run.

1. Write a session of real bf16 KV pages (varied so every page differs) with
   `cp -r` + `sync` into the mount, beside (a) the same copy into a plain
   local directory, (b) the same work done by plain tools: `sha256sum` of
   the files plus `zstd -1` of each into a local directory, + `sync`, and
   (c) `cp -r` into a pyfuse3 filesystem that drops what it is given, and
   (f) `borg create --compression zstd,3` of the same folder (where borg is
   installed).
2. Read it back cold (remount, drop the kernel's caches) beside a cold read
   of the plain directory and (c) the same files served by a pyfuse3
   filesystem that does no work at all (benchmarks/fuse_floor.py): the round
   trips every pyfuse3 filesystem pays per file.
3. Forks: `cp -r`, `pffs fork`, and the metadata-only recipe, beside (d)
   starting the interpreter and (e) the recipe between two local folders;
   then the first listing of the fork, which makes its page files' rows.
4. `ls -l` of a 10,000-page session (and of 10,000 files of (c)), and the
   two quick forks again at that size, to show how they grow.
Each is measured in --rounds rounds (3 by default; every write round into a
new store), taking turns with its baselines; each figure is printed as the
median, then every round's. Prints seconds, MB/s, stored bytes, the
daemon's CPU time and peak RSS, and each ratio (per round, then the median).
--geometry 8b writes Llama-3.1-8B's 2 MiB pages (benchmarks/copies.py's),
the default the all-MiniLM-L6-v2 pages of the test data (144 KiB).
Needs root (FUSE, drop_caches).
"""

from __future__ import annotations

import argparse
import json
import os
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
from mountutil import Mount  # noqa: E402
from pffs_testdata import kv_file  # noqa: E402
from sessions import make_manifest, varied_pages, write_session  # noqa: E402

# The full MiniLM KV where there is one ($PFFS_TEST_DATA, ../shared/data), else tests/data's.
KV_FILE = kv_file(full=True)


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


def cpu_ticks() -> tuple[int, int]:
    """(stolen, all) CPU ticks of this machine so far: a virtual machine's host
    may run other guests on its cores, which slows everything measured here."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[7] if len(v) > 7 else 0, sum(v[:8])


def stolen_since(t0: tuple[int, int]) -> str:
    s1, a1 = cpu_ticks()
    return f"{100 * (s1 - t0[0]) / max(1, a1 - t0[1]):.0f}%"


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def borg_create(src: Path, repo: Path, before=None) -> tuple[float, float]:
    """Seconds of `borg create --compression zstd,3` of *src* into a new
    repository, + sync, and its stored ratio (original / deduplicated size);
    *before*: called once the repository is made, just before the timing."""
    env = {**os.environ, "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
           "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes", "BORG_BASE_DIR": str(repo.parent / "borg-home")}
    subprocess.run(["borg", "init", "-e", "none", str(repo)], check=True, env=env, capture_output=True)
    if before is not None:
        before()
    t = timed(lambda: (subprocess.run(["borg", "create", "--compression", "zstd,3", f"{repo}::s", src.name],
                                      cwd=src.parent, check=True, env=env), sh("sync")))
    info = json.loads(subprocess.run(["borg", "info", "--json", f"{repo}::s"], check=True, env=env,
                                     capture_output=True, text=True).stdout)
    st = info["archives"][0]["stats"]
    return t, st["original_size"] / st["deduplicated_size"]


def quick_forks(m, name: str, n: int, local: Path, tag: str = "") -> tuple[float, ...]:
    """Seconds for `pffs fork` (the command, then the same work in this process)
    and the metadata-only recipe, each forking session *name* of *n* pages;
    then two baselines: starting the interpreter that runs the command, and
    the recipe between two folders of *local*, a local directory.  Last, the
    first listing of the command's fork (which makes its page files' rows: a
    fork into an empty pages/ is one row until then) beside a second one."""
    src = m / name
    t_cmd = timed(lambda: sh(*PFFS, "fork", str(src), str(m / f"{name}-fork{tag}")))
    t_inproc = timed(lambda: __import__("pffs.client.mounted", fromlist=["fork"]).fork(
        str(src), str(m / f"{name}-fork2{tag}")))

    def recipe(a: Path, b: Path):
        (b / "pages").mkdir(parents=True)
        shutil.copyfile(a / "manifest.json", b / "manifest.json")
    t_meta = timed(lambda: recipe(src, m / f"{name}-meta{tag}"))
    listed = []
    t_unfold = timed(lambda: listed.append(len(os.listdir(m / f"{name}-fork{tag}" / "pages"))))
    t_relist = timed(lambda: listed.append(len(os.listdir(m / f"{name}-fork{tag}" / "pages"))))
    for f in ("fork2", "meta"):
        listed.append(len(os.listdir(m / f"{name}-{f}{tag}" / "pages")))
    assert listed == [n] * 4
    t_python = timed(lambda: sh(sys.executable, "-c", "pass"))
    recipe(src, local / f"{name}-src{tag}")
    t_local = timed(lambda: recipe(local / f"{name}-src{tag}", local / f"{name}-meta{tag}"))
    return t_cmd, t_inproc, t_meta, t_python, t_local, t_unfold, t_relist


# The command as a user types it: the console script installed beside this
# interpreter (python -m pffs.cli where there is none).
_SCRIPT = Path(sys.executable).parent / "pffs"
PFFS = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "pffs.cli"]


def print_quick_forks(runs: list[tuple[float, ...]]) -> None:
    """Median and every run of each of quick_forks' figures."""
    for label, col in (("pffs fork (command, incl. startup)", 0), ("pffs fork (the work itself)", 1),
                       ("mkdir pages + cp manifest.json", 2), ("(d) python -c pass", 3),
                       ("(e) mkdir + cp in a local dir", 4),
                       ("first ls of the fork (unfolds it)", 5), ("second ls of the fork", 6)):
        xs = [r[col] for r in runs]
        print(f"{label:34} {statistics.median(xs):8.4f}   ({each(xs, 4)})")


def print_cpu(what: str, cpu: list[float], n: int, ticks: tuple[int, int]) -> None:
    m = statistics.median(cpu)
    print(f"daemon CPU for {what}: {m:.2f} s ({m / n * 1e3:.2f} ms a page; {each(cpu)});"
          f" CPU time stolen by the host meanwhile: {stolen_since(ticks)}")


def each(xs, digits: int = 2) -> str:
    return " ".join(f"{x:.{digits}f}" for x in xs)


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
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of each measurement (medians printed, then every round)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on /tmp's disk)")
    ap.add_argument("--geometry", choices=("small", "8b"), default="small",
                    help="page size: all-MiniLM-L6-v2's 144 KiB (the test data) or Llama-3.1-8B's 2 MiB")
    args = ap.parse_args()
    rounds = range(args.rounds)
    med = statistics.median

    # As pip install does: a command that compiled its modules each time it
    # starts (an editable install under PYTHONDONTWRITEBYTECODE) would time
    # the compiler.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "pffs")], check=True)
    work = Path(tempfile.mkdtemp(prefix="pffs-bench-", dir=args.dir))
    mounts: list[Mount] = []
    rss_max = 0

    def new_mount(name: str) -> Mount:
        (work / name).mkdir()
        m = Mount(work / name, work / f"{name}-store")
        orig_stop = m.stop

        def stop_and_measure():
            nonlocal rss_max
            rss_max = max(rss_max, peak_rss(m.proc.pid))
            return orig_stop()
        m.stop = stop_and_measure
        mounts.append(m)
        return m.start()

    try:
        if args.geometry == "8b":
            from copies import GEOMETRIES, pages_of  # (copies imports this module)
            geometry = GEOMETRIES["8b"]
            pages = pages_of(geometry, args.mib << 20)
            base = pages[:1]
        else:
            geometry = {}
            base = kv_pages("bf16", path=KV_FILE)
            pages = varied_pages(base, args.mib * (1 << 20) // len(base[0]))
        n = len(pages)
        src = work / "src"
        write_session(src, pages, **geometry)
        del pages
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        mb = size / 1e6
        print(f"session: {n} pages of {len(base[0])} bytes, {size / 2**20:.0f} MiB (real KV from {KV_FILE}); "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
              f"{args.rounds} rounds of each figure (median, then every round)")
        drop_caches()
        sh("cat", *[str(p) for p in sorted((src / "pages").iterdir())[:1]])

        # Writes: in each round (a), (b) and pffs, each into new folders (pffs:
        # a new store, so that nothing is deduplicated against an earlier round).
        t_plain, t_tools, t_pffs, t_borg, cpu_write = [], [], [], [], []
        borg_ratio = None
        files = sorted(str(p) for p in (src / "pages").iterdir()) + [str(src / "manifest.json")]
        ticks = cpu_ticks()
        for r in rounds:
            plain = work / f"plain{r}"
            t_plain.append(timed(lambda: (sh("cp", "-r", str(src), str(plain)), sh("sync"))))
            zdir = work / f"zstd{r}"
            zdir.mkdir()
            t_tools.append(timed(lambda: (
                subprocess.run(["sha256sum", *files], check=True, stdout=subprocess.DEVNULL),
                sh("zstd", "-1", "-q", "-T1", "--output-dir-flat", str(zdir), *files), sh("sync"))))
            zbytes = sum(p.stat().st_size for p in zdir.iterdir())
            if shutil.which("borg"):
                t, borg_ratio = borg_create(src, work / f"borg{r}")
                t_borg.append(t)
            m = new_mount(f"m{r}")
            c0 = cpu_seconds(m.proc.pid)
            t_pffs.append(timed(lambda: (sh("cp", "-r", str(src), str(m / "s")), sh("sync"))))
            cpu_write.append(cpu_seconds(m.proc.pid) - c0)
            st = json.loads((m / ".pffs" / "stats.json").read_text())
            if r:
                m.stop()
        m = mounts[0]
        with Floor(work / "floor-w", 0, len(base[0])) as fl:
            t_wfloor = [timed(lambda: sh("cp", "-r", str(src), str(fl / f"s{r}"))) for r in rounds]
        print(f"\n{'write':34} {'seconds':>8} {'MB/s':>8} {'stored MiB':>11}   (every round, seconds)")
        for label, ts, stored in (("pffs cp -r + sync", t_pffs, st["stored_bytes"]),
                                  ("(a) cp -r to local dir + sync", t_plain, size),
                                  ("(b) sha256sum + zstd -1 + sync", t_tools, zbytes),
                                  ("(c) cp -r to pyfuse3 doing nothing", t_wfloor, 0)):
            print(f"{label:34} {med(ts):8.2f} {mb / med(ts):8.0f} {stored / 2**20:11.1f}   ({each(ts)})")
        if t_borg:
            print(f"{'(f) borg create zstd,3 + sync':34} {med(t_borg):8.2f} {mb / med(t_borg):8.0f} "
                  f"{size / borg_ratio / 2**20:11.1f}   ({each(t_borg)})")
            vs_f = [f / p for f, p in zip(t_borg, t_pffs)]
            print(f"pffs write / (f): {med(vs_f):.2f}x ({each(vs_f)}); stored ratio pffs "
                  f"{size / st['stored_bytes']:.2f}x, borg {borg_ratio:.2f}x")
        else:
            print("(f) borg create: borg is not installed (apt install borgbackup)")
        vs_b = [b / p for b, p in zip(t_tools, t_pffs)]
        vs_a = [a / p for a, p in zip(t_plain, t_pffs)]
        print(f"pffs write / (b): {med(vs_b):.2f}x ({each(vs_b)})   pffs write / (a): {med(vs_a):.2f}x   "
              f"compression {st['compression_ratio']:.3f} (zstd -1: {size / zbytes:.3f})")
        print_cpu("the write", cpu_write, n, ticks)

        # Cold reads: in each round pffs (remounted), the local directory and
        # (c), each after dropping the kernel's caches.
        plain = work / "plain0"
        t_read, t_read_plain, t_floor, cpu_read = [], [], [], []
        cold = True
        ticks = cpu_ticks()
        with Floor(work / "floor", n, len(base[0])) as fl:
            for r in rounds:
                m.stop()
                m.start()
                cold = drop_caches() and cold
                c0 = cpu_seconds(m.proc.pid)
                t_read.append(timed(lambda: read_tree(m / "s")))
                cpu_read.append(cpu_seconds(m.proc.pid) - c0)
                drop_caches()
                t_read_plain.append(timed(lambda: read_tree(plain)))
                drop_caches()
                t_floor.append(timed(lambda: read_tree(fl)))
        print(f"\n{'cold read' + ('' if cold else ' (caches NOT dropped)'):34} {'seconds':>8} {'MB/s':>8}"
              "   (every round, seconds)")
        for label, ts in (("pffs", t_read), ("local directory", t_read_plain),
                          ("(c) pyfuse3 doing nothing, same files", t_floor)):
            print(f"{label:34} {med(ts):8.2f} {mb / med(ts):8.0f}   ({each(ts)})")
        vs_local = [pl / p for pl, p in zip(t_read_plain, t_read)]
        floor_local = [pl / f for pl, f in zip(t_read_plain, t_floor)]
        vs_floor = [f / p for f, p in zip(t_floor, t_read)]
        print(f"pffs cold read / local: {med(vs_local):.2f}x ({each(vs_local)})   (c) / local: "
              f"{med(floor_local):.2f}x ({each(floor_local)})   pffs / (c): {med(vs_floor):.2f}x")
        print_cpu("the cold read", cpu_read, n, ticks)

        # Forks
        before = json.loads((m / ".pffs" / "stats.json").read_text())["stored_bytes"]
        t_cp = timed(lambda: sh("cp", "-r", str(m / "s"), str(m / "fork-cp")))
        forks = [quick_forks(m, "s", n, work / "local-forks", f"-{r}") for r in rounds]
        after = json.loads((m / ".pffs" / "stats.json").read_text())["stored_bytes"]
        print(f"\n{'fork of ' + str(n) + ' pages':34} {'seconds':>8}")
        print(f"{'cp -r':34} {t_cp:8.3f}")
        print_quick_forks(forks)
        print(f"stored bytes added by {1 + 3 * args.rounds} forks: {after - before}")

        # ls -l of a big session (one page digest listed many times)
        big = make_manifest(varied_pages(base, 1) * args.ls_pages, **geometry)  # page 0 of the session
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
        print_quick_forks([quick_forks(m, "big", args.ls_pages, work / "local-forks", f"-{r}")
                           for r in rounds])
        m.stop()
        print(f"daemon peak RSS (largest over the mounts of this run): {rss_max / 2**20:.0f} MiB")
    finally:
        for m in mounts:
            if m.proc is not None:
                m.stop()
            m.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
