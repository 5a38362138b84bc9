"""A real pffs mount in a subprocess, for tests: start, poll, unmount, check the log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

DEADLINE = 30.0


def wait_for(cond, timeout=DEADLINE, interval=0.02, what="condition"):
    """Poll *cond* until it is true or the deadline passes (then fail)."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# -- counted FUSE requests ------------------------------------------------------

# Kinds of FUSE request whose number follows the kernel's timing as much as the
# operation counted: LOOKUP and GETATTR revalidate names and attributes whose
# timeouts ran out (10 s for the namespace's, 0.5 s for a live session's, 0
# for .pffs/), which a run slowed down by a loaded host crosses more often, and
# FORGET is sent whenever the kernel trims its caches. A test counting requests
# bounds these apart from the kinds the operation itself must cause (mkdir,
# create, write, rename, getxattr, read, ...), each generously: an operation
# that asks O(1) of them still fails it if it comes to ask them once a page.
KERNEL_TIMED = frozenset({"lookup", "getattr", "forget"})


def fuse_requests(mnt) -> dict[str, int]:
    """FUSE requests the daemon has served so far, by kind (.pffs/stats.json)."""
    return json.loads((mnt / ".pffs" / "stats.json").read_text())["requests"]


def requests_made(mnt, fn) -> dict[str, int]:
    """FUSE requests ``fn()`` made, by kind, less what reading stats.json costs
    (measured just before: its KERNEL_TIMED kinds may differ by one or two)."""
    a = fuse_requests(mnt)
    b = fuse_requests(mnt)
    fn()
    c = fuse_requests(mnt)
    made = {k: c.get(k, 0) - b.get(k, 0) - (b.get(k, 0) - a.get(k, 0)) for k in c}
    return {k: v for k, v in made.items() if v}


def by_timing(made: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """*made* split: (the kinds the operation causes, the KERNEL_TIMED kinds)."""
    return ({k: v for k, v in made.items() if k not in KERNEL_TIMED},
            {k: v for k, v in made.items() if k in KERNEL_TIMED})


def pffs(*args, check=True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pffs.cli", *map(str, args)], capture_output=True,
                       text=True, timeout=kw.pop("timeout", 600), **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"pffs {' '.join(map(str, args))} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def is_mounted(path: Path) -> bool:
    mp = str(Path(path).absolute())
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == mp for line in f)


def lazy_unmount(path: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


class Mount:
    def __init__(self, root: Path, store: Path | None = None, opts: list[str] = ()):
        self.path = root / "mnt"
        self.store = store or (root / "store")
        self.opts = list(opts)
        self.path.mkdir(exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.allowed: list[str] = []
        self.log_offset = 0
        self.stderr_path = root / f"daemon-stderr-{id(self)}.txt"

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> "Mount":
        log = self.store / "pffs.log"
        self.log_offset = log.stat().st_size if log.exists() else 0
        cmd = [sys.executable, "-m", "pffs.cli", "mount", "-f", "--store", str(self.store)]
        for o in self.opts:
            cmd += ["-o", o]
        cmd.append(str(self.path))
        self._stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._stderr, stderr=self._stderr, stdin=subprocess.DEVNULL)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode} before mounting:\n"
                                     + self.stderr_path.read_text(errors="replace"))
            return is_mounted(self.path) and (self.path / ".pffs" / "version").exists()
        wait_for(ready, what="the mount")
        return self

    def stop(self) -> int:
        """Unmount cleanly and return the daemon's exit status."""
        assert self.proc is not None
        end = time.monotonic() + DEADLINE
        while is_mounted(self.path):
            r = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True, text=True)
            if r.returncode == 0:
                break
            if time.monotonic() > end:
                lazy_unmount(self.path)
                break
            time.sleep(0.1)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self.proc = None
        self._stderr.close()
        return rc

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None
        self._stderr.close()
        lazy_unmount(self.path)

    def cleanup(self) -> None:
        """Always leave no mount and no daemon behind."""
        if self.proc is not None and self.proc.poll() is None:
            lazy_unmount(self.path)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if is_mounted(self.path):
            lazy_unmount(self.path)

    def cpu(self) -> float:
        """CPU-s the daemon's threads have used so far (for benchmarks)."""
        assert self.proc is not None
        total = 0
        for t in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                with open(f"/proc/{self.proc.pid}/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])     # (nanoseconds on the CPU)
            except (OSError, ValueError, IndexError):
                pass        # (a thread that ended meanwhile)
        return total / 1e9

    # -- checks ---------------------------------------------------------------

    def allow(self, pattern: str) -> None:
        """Log lines matching *pattern* (a regex) are expected in this test."""
        self.allowed.append(pattern)

    def log_text(self) -> str:
        log = self.store / "pffs.log"
        text = ""
        if log.exists():
            with open(log, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        if self.stderr_path.exists():
            text += self.stderr_path.read_text(errors="replace")
        return text

    def log_problems(self) -> list[str]:
        bad = []
        for line in self.log_text().splitlines():
            if "Traceback (most recent call last)" in line or " CRITICAL " in line:
                bad.append(line)
            elif (" WARNING " in line or " ERROR " in line) and not any(
                    re.search(p, line) for p in self.allowed):
                bad.append(line)
        return bad

    def check_store(self, *extra) -> subprocess.CompletedProcess:
        return pffs("check", "--store", self.store, *extra, check=False)

    def __truediv__(self, other) -> Path:
        return self.path / other


def stop_all(mounts) -> list[str]:
    """Unmount every mount; what went wrong (daemon exit status, unexpected log lines)."""
    failures = []
    for m in mounts:
        try:
            if m.proc is not None:
                rc = m.stop()
                if rc != 0:
                    failures.append(f"daemon for {m.path} exited {rc}")
        finally:
            m.cleanup()
        # Shown by pytest only when the test failed: what the daemon said last.
        tail = m.log_text().splitlines()[-40:]
        print(f"--- last lines of the daemon log of {m.path} ---", *tail, sep="\n")
        problems = m.log_problems()
        if problems:
            failures.append(f"daemon log of {m.path} has unexpected lines:\n" + "\n".join(problems[:20]))
    return failures
