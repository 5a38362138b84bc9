#!/usr/bin/env python3
"""Files written in place and fsynced: a database and a sequential writer,
each beside the same work on a local directory (the store's filesystem), in
one run.

1. SQLite: 10,000 rows in 100 transactions, WAL mode (each commit fsyncs).
2. fio, if installed: sequential 1 MiB writes of a 512 MiB file, then one
   fsync (`--end_fsync=1`); fio's own figure.
3. The same as a plain loop, timed to the close's return: 512 writes of
   1 MiB (incompressible), fsync, close.
Each is measured in --rounds rounds, taking turns with its baseline; each
figure is printed as the median, then every round's, with the ratio. The
FUSE requests the mount answered come last (`.pffs/stats.json`).
Needs root (FUSE).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mountutil import Mount  # noqa: E402


def sqlite_rows(d: Path) -> float:
    """Seconds for 10,000 rows in 100 transactions."""
    p = d / "t.db"
    for suffix in ("", "-wal", "-shm"):
        Path(str(p) + suffix).unlink(missing_ok=True)
    t0 = time.perf_counter()
    c = sqlite3.connect(p)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT)")
    c.commit()
    for _ in range(100):
        c.executemany("INSERT INTO t(b) VALUES (?)", [("x" * 100,)] * 100)
        c.commit()
    c.close()
    return time.perf_counter() - t0


def fio(d: Path) -> float:
    """fio's MiB/s for sequential 1 MiB writes of 512 MiB and an fsync."""
    r = subprocess.run(["fio", "--name=w", f"--directory={d}", "--rw=write", "--bs=1M", "--size=512M",
                        "--end_fsync=1", "--output-format=json"], capture_output=True, text=True,
                       check=True)
    for f in d.glob("w.*"):
        f.unlink()
    return json.loads(r.stdout)["jobs"][0]["write"]["bw"] / 1024


def sequential(d: Path) -> float:
    """MiB/s of 512 writes of 1 MiB, fsync and close, to the close's return."""
    buf = os.urandom(1 << 20)
    p = d / "seq"
    t0 = time.perf_counter()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for i in range(512):
        os.write(fd, buf[i:] + buf[:i])
    os.fsync(fd)
    os.close(fd)
    t = time.perf_counter() - t0
    p.unlink()
    return 512 / t


def show(what: str, unit: str, local: list[float], mnt: list[float], higher_better: bool) -> None:
    ratios = [m / l if higher_better else l / m for l, m in zip(local, mnt)]
    fmt = (lambda xs: " ".join(f"{x:.2f}" for x in xs)) if unit == "s" else \
        (lambda xs: " ".join(f"{x:.0f}" for x in xs))
    print(f"{what}: local {statistics.median(local):.3g} {unit} ({fmt(local)}), "
          f"mount {statistics.median(mnt):.3g} {unit} ({fmt(mnt)}); "
          f"mount/local speed {statistics.median(ratios):.2f}x ({' '.join(f'{r:.2f}' for r in ratios)})",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the store and the local directory go "
                    "(default: a temporary folder in /tmp)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pffs-writes-", dir=args.dir))
    (root / "store").mkdir()
    local = root / "local"
    local.mkdir()
    m = Mount(root)
    m.start()
    try:
        tests = [("SQLite, 10,000 rows in 100 transactions", "s", sqlite_rows, False)]
        if shutil.which("fio"):
            tests.append(("fio, 512 MiB of 1 MiB writes + fsync", "MiB/s", fio, True))
        else:
            print("fio: not installed, skipped")
        tests.append(("512 MiB of 1 MiB writes + fsync + close", "MiB/s", sequential, True))
        for what, unit, fn, higher in tests:
            a, b = [], []
            for _ in range(args.rounds):
                a.append(fn(local))
                b.append(fn(m.path))
            show(what, unit, a, b, higher)
        req = json.loads((m.path / ".pffs" / "stats.json").read_text())["requests"]
        print("FUSE requests:", ", ".join(f"{k} {v}" for k, v in sorted(req.items())))
    finally:
        rc = m.stop()
        m.cleanup()
        problems = m.log_problems()
        shutil.rmtree(root)
    if rc != 0 or problems:
        print(f"daemon exited {rc}", *problems[:10], sep="\n", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
