#!/usr/bin/env python3
"""Live-engine snapshot speed through the mount, beside the bridge's direct page-out, in one run.

An engine (a KV pool with Llama-3.1-8B's geometry: 32 layers, 8 KV heads,
head_dim 128, bf16, 16-token blocks, so 2 MiB pages) holds one sequence over
--mib MiB of blocks in shuffled order, filled with real bf16 KV values (the
tests' MiniLM data, tiled).  It attaches to a pffs mount started for the run,
in this process, through engine_bridge.attach.agent.  Prints MB/s of:

- bridge page-out into memory (gather + sha256: the floor of any snapshot);
- bridge page-out through the mount into the store (a session written by the engine);
- a live snapshot read through the mount: manifest.json (the daemon pins the
  blocks, gathers each page into shared staging and hashes it), then every
  page file (served from staging, or gathered again from the pinned blocks);
- ``cp -r`` of the live session into the store, beside the page-out through the mount;
- ``pffs fork`` and ``cp -r`` of the live session out of ``engines/`` (the engine
  pages it out itself; the daemon stores the pages it gathers) and ``pffs fork``
  and ``cp -r`` of a session into ``engines/`` (a
  second engine pages it in), beside the bridge's own page-out and page-in through the mount (both
  by the direct path where this process may use the store).
``--threads N`` gives both engines N I/O threads (their page-out, page-in and
the stores for a copy out; default one a core, up to 4): with fewer than the
host's cores, the daemon and cp have a core to themselves, as beside an
engine on a large host.
Needs root (FUSE).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from engine_bridge import Bridge, KVPool, MemorySession, RefCountingAllocator, SeqBlocks  # noqa: E402
from engine_bridge.attach.agent import Agent  # noqa: E402
from engine_bridge.attach.engine_adapter import StepLock  # noqa: E402
from mountutil import Mount, wait_for  # noqa: E402
from pffs_testdata import kv_file  # noqa: E402

KV_FILE = kv_file(full=True)   # the full MiniLM KV where there is one, else tests/data's


class PoolAdapter:
    """A bare pool with one long sequence: what the agent needs, without a model."""

    def __init__(self, bridge: Bridge, seq: SeqBlocks):
        self.bridge = bridge
        self.lock = StepLock()
        self.seq = seq

    def sequences(self):
        return [self.seq]

    def pin(self, blocks):
        self.bridge.allocator.incref(blocks)

    def unpin(self, blocks):
        self.bridge.allocator.free(blocks)

    def page_in(self, source):
        raise RuntimeError("this benchmark engine takes no sessions")


class LoadingAdapter(PoolAdapter):
    """An engine that pages sessions in and lets them go at once (so each load can be timed again)."""

    def sequences(self):
        return []

    def page_in(self, source):
        res = self.bridge.page_in(source)
        self.bridge.allocator.free(res.blocks)
        return [s.id for s in res.seqs]


def fill(pool: KVPool) -> str:
    """Real bf16 KV values over the pool, every page distinct (asserted): bridge.fill_real_kv."""
    from bridge import fill_real_kv     # (benchmarks/ is this script's folder)
    return fill_real_kv(pool)


def read_tree(session: Path) -> int:
    """Read manifest.json, then every page file, the way a copying tool does."""
    total = 0
    paths = [session / "manifest.json"]
    paths += sorted((session / "pages").iterdir())
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_timed(fn, mnt: Mount) -> tuple[float, tuple[float, float, float]]:
    """Seconds of *fn*, and the CPU-s it took of this process (the engines:
    their page-out and page-in, their agents), of the daemon and of child
    processes (cp, pffs fork)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    d0 = mnt.cpu()
    t = timed(fn)
    me2, kids2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return t, (me2.ru_utime + me2.ru_stime - me.ru_utime - me.ru_stime, mnt.cpu() - d0,
               kids2.ru_utime + kids2.ru_stime - kids.ru_utime - kids.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="session size in MiB (2 MiB pages)")
    ap.add_argument("--staging", type=int, default=64, help="the agent's shared staging, MiB")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement (best is shown)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None,
                    help="the engines' I/O threads (page-out, page-in, stores for a copy out; "
                         "default: the bridge's, one a core up to 4)")
    args = ap.parse_args()

    # As pip install does: byte-compiled, so that timing a `pffs` command does not time the compiler.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "pffs")], check=True)
    n = max(2, args.mib // 2)
    pool = KVPool.allocate(num_blocks=n + 8, block_size=16, n_layers=32, n_heads=8, head_dim=128,
                           dtype=torch.bfloat16)
    data = fill(pool)
    alloc = RefCountingAllocator(pool.num_blocks)
    blocks = alloc.allocate(n)
    random.Random(0).shuffle(blocks)
    n_tokens = n * 16 - 5       # a partly filled last page, as while decoding
    seq = SeqBlocks("bench", blocks, n_tokens, [i % 128000 for i in range(n_tokens)])
    bridge = Bridge(pool, alloc, engine_name="bench", model={"name": "bench", "revision": "0"},
                    io_workers=args.threads)
    size = n * pool.page_bytes
    print(f"session: {n} pages of {pool.page_bytes >> 20} MiB ({size / 1e6:.0f} MB), {data}; "
          f"agent staging {args.staging} MiB; {bridge.io_workers} I/O threads an engine, "
          f"{os.cpu_count()} cores; best of {args.repeat}")

    work = Path(args.dir or tempfile.mkdtemp(prefix="pffs-live-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "m", ignore_errors=True)    # (a run before, in the same --dir)
    (work / "m").mkdir()
    mnt = Mount(work / "m").start()
    rows = []
    try:
        rows = measure(args, pool, bridge, alloc, seq, size, n, mnt)
    finally:
        rc = mnt.stop()
        mnt.cleanup()
        if rc != 0:
            print(f"warning: the pffs daemon exited {rc}", file=sys.stderr)
        shutil.rmtree(work / "m" if args.dir else work, ignore_errors=True)
    report(rows)
    return 0


def measure(args, pool: KVPool, bridge: Bridge, alloc, seq: SeqBlocks, size: int, n: int,
            mnt: Mount) -> list[tuple[str, int, float]]:
    """(what, bytes, best seconds) of each measurement, the engine attaching in between."""
    rows = []

    def mem():
        bridge.page_out([seq], MemorySession())
    rows.append(("bridge page-out -> memory (gather + sha256)", size, _best(mem, args.repeat)))

    k = iter(range(1000))

    def out_mount():
        bridge.page_out([seq], mnt.path / f"direct-{next(k)}")
    rows.append(("bridge page-out -> mount (store)", size,
                 _best(out_mount, args.repeat, lambda: perturb(pool))))
    pool2 = KVPool.allocate(num_blocks=pool.num_blocks, block_size=16, n_layers=32, n_heads=8,
                            head_dim=128, dtype=torch.bfloat16)
    bridge2 = Bridge(pool2, RefCountingAllocator(pool2.num_blocks), engine_name="loader",
                     model=bridge.model, io_workers=args.threads)

    def in_mount():
        bridge2.allocator.free(bridge2.page_in(mnt.path / "direct-0").blocks)
    rows.append(("bridge page-in <- mount (store)", size, _best(in_mount, args.repeat)))

    agent = Agent(PoolAdapter(bridge, seq), mnt.path, "bench", staging_bytes=args.staging << 20)
    with agent:
        live = mnt.path / "engines" / "bench" / "bench"
        wait_for(lambda: live.exists(), what="the live session")

        def snapshot_only():
            (live / "manifest.json").read_bytes()
        rows.append(("live: manifest.json (pin, gather, sha256)", size, _best(snapshot_only, args.repeat)))

        def snapshot_read():
            got = read_tree(live)
            assert got >= size
        rows.append(("live: snapshot read (manifest + pages)", size, _best(snapshot_read, args.repeat)))

        def clean():
            # What the last measurement wrote goes, and gc takes its blobs, before
            # each one that writes the store: the store (on /dev/shm, say) does
            # not grow, and each writes into memory the machine has touched
            # before, as the others do (a virtual machine's first touch of a
            # page is slow; see docs/performance.md: the third of three
            # writers in a row paid for it, the first did not).
            for p in mnt.path.iterdir():
                if p.name.startswith(("fork-", "snap-")) or (p.name.startswith("direct-")
                                                              and p.name != "direct-0"):
                    shutil.rmtree(p)
            subprocess.run([sys.executable, "-m", "pffs.cli", "gc", "--store", str(mnt.store),
                            "--grace", "0"], check=True, capture_output=True)

        j = iter(range(1000))

        def cp_live():
            subprocess.run(["cp", "-r", str(live), str(mnt.path / f"snap-{next(j)}")], check=True)
        def fresh():
            # Each copy reads a snapshot of its own: the last one is released
            # first (2 s after its last use), as a later copy would find it
            # still in use and copy it again, its pages stored already.
            wait_for(lambda: agent.snapshots_pinned == 0, what="the last snapshot released")
            clean()
            perturb(pool)
        rows.append(("live: cp -r into the store", size, _best(cp_live, args.repeat, fresh)))

        f = iter(range(1000))
        pffs = [sys.executable, "-m", "pffs.cli", "fork"]

        def fork_out():
            subprocess.run([*pffs, str(live), str(mnt.path / f"fork-{next(f)}")], check=True,
                           capture_output=True)
        loader = Agent(LoadingAdapter(bridge2, seq), mnt.path, "loader", staging_bytes=args.staging << 20)
        with loader:
            wait_for(lambda: (mnt.path / "engines" / "loader").exists(), what="the loading engine")
            g = iter(range(1000))

            def fork_in():
                subprocess.run([*pffs, str(mnt.path / "direct-0"),
                                str(mnt.path / "engines" / "loader" / f"s{next(g)}")], check=True,
                               capture_output=True)

            def cp_in():
                subprocess.run(["cp", "-r", str(mnt.path / "direct-0"),
                                str(mnt.path / "engines" / "loader" / f"c{next(g)}")], check=True)
            # Alternating rounds (this host's speed drifts between runs): each
            # pffs fork beside the bridge's own page-out or page-in, the same bytes.
            times: dict[str, list[float]] = {k: [] for k in ("po", "fo", "co", "pi", "fi", "ci")}
            cpus: dict[str, list[tuple[float, float, float]]] = {k: [] for k in ("po", "co", "pi", "ci")}

            def run(key: str, fn) -> None:
                if key not in cpus:
                    times[key].append(timed(fn))
                    return
                t, cpu = cpu_timed(fn, mnt)
                times[key].append(t)
                cpus[key].append(cpu)
            for _ in range(args.repeat):
                clean()
                perturb(pool)
                run("po", out_mount)
                clean()
                perturb(pool)
                run("fo", fork_out)
                fresh()
                run("co", cp_live)
                run("pi", in_mount)
                run("fi", fork_in)
                run("ci", cp_in)
            med = {k: statistics.median(v) for k, v in times.items()}
            CPU.update({k: tuple(statistics.median(c[i] for c in v) for i in range(3))  # type: ignore[misc]
                        for k, v in cpus.items()})
            rows.append(("alternating: bridge page-out -> mount (median)", size, med["po"]))
            rows.append(("live: pffs fork out of engines/ (median; the engine pages out)", size, med["fo"]))
            rows.append(("live: cp -r out of engines/ (median; the daemon stores the pages)", size, med["co"]))
            rows.append(("alternating: bridge page-in <- mount (median)", size, med["pi"]))
            rows.append(("live: pffs fork into engines/ (median; the engine pages in)", size, med["fi"]))
            rows.append(("live: cp -r into engines/ (median; the engine pages in)", size, med["ci"]))
        # Snapshots are released once idle; check the pins went back.
        wait_for(lambda: alloc.num_free() == pool.num_blocks - n, what="pins released")
    return rows


# Medians of the alternating rounds' CPU-s (engines, daemon, cp), by round kind (measure fills it).
CPU: dict[str, tuple[float, float, float]] = {}


def report(rows: list[tuple[str, int, float]]) -> None:
    width = max(len(r[0]) for r in rows)
    base = {r[0]: r for r in rows}
    for name, nbytes, secs in rows:
        print(f"{name:<{width}}  {secs:7.3f} s  {nbytes / secs / 1e6:8.1f} MB/s")
    direct_mem = base["bridge page-out -> memory (gather + sha256)"][2]
    direct_mount = base["bridge page-out -> mount (store)"][2]
    live_read = base["live: snapshot read (manifest + pages)"][2]
    cp_live = base["live: cp -r into the store"][2]
    print(f"live snapshot read vs page-out into memory: {direct_mem / live_read:.2f}x the speed")
    print(f"cp -r of the live session vs page-out through the mount: {direct_mount / cp_live:.2f}x the speed")
    fork_out = base["live: pffs fork out of engines/ (median; the engine pages out)"][2]
    fork_in = base["live: pffs fork into engines/ (median; the engine pages in)"][2]
    page_out = base["alternating: bridge page-out -> mount (median)"][2]
    page_in = base["alternating: bridge page-in <- mount (median)"][2]
    print(f"pffs fork out of engines/ vs the bridge's page-out through the mount: "
          f"{page_out / fork_out:.2f}x the speed (medians of alternating rounds)")
    print(f"pffs fork into engines/ vs the bridge's page-in through the mount: {page_in / fork_in:.2f}x "
          "the speed (medians of alternating rounds)")
    cp_out = base["live: cp -r out of engines/ (median; the daemon stores the pages)"][2]
    print(f"cp -r of the live session out of engines/ vs the bridge's page-out through the mount: "
          f"{page_out / cp_out:.2f}x the speed (medians of alternating rounds)")
    cp_in = base["live: cp -r into engines/ (median; the engine pages in)"][2]
    print(f"cp -r of a session into engines/ vs the bridge's page-in through the mount: "
          f"{page_in / cp_in:.2f}x the speed (medians of alternating rounds)")
    # Where the cores are the limit: a copy takes at least its CPU over the
    # host's cores, whatever order the work is done in.
    cores = os.cpu_count() or 1
    print(f"CPU-s of the alternating rounds (medians: engines / daemon / cp or pffs), {cores} cores:")
    for key, what, base_t in (("po", "bridge page-out", None), ("co", "cp -r out of engines/", page_out),
                              ("pi", "bridge page-in", None), ("ci", "cp -r into engines/", page_in)):
        if key not in CPU:
            continue
        e, d, c = CPU[key]
        line = f"  {what:<22} {e:6.3f} / {d:6.3f} / {c:6.3f} = {e + d + c:6.3f} CPU-s"
        if base_t is not None:
            floor = (e + d + c) / cores
            line += f"; over {cores} cores at least {floor:.3f} s: at most {base_t / floor:.2f}x"
        print(line)


def _best(fn, repeat: int, setup=None) -> float:
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        best = min(best, timed(fn))
    return best


_round = iter(range(1, 1 << 30))


def perturb(pool: KVPool) -> None:
    """Give every block new bytes (one value of each changes), so that a page-out
    stores and compresses every page anew instead of finding it stored."""
    k = next(_round)
    pool.layers[0][0, :, 0, 0, 0] = float(k % 1000) / 7.0


if __name__ == "__main__":
    sys.exit(main())
