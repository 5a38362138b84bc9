"""The daemon's heap: glibc's malloc settings for page- and block-sized buffers.

Two things, both glibc's own switches:

- :func:`fix_malloc` (at the daemon's start): buffers under MMAP_FROM bytes
  (a 2 MiB page's bytes, frame and planes) come from two arenas' heaps, which
  keep MMAP_FROM bytes free atop them and are trimmed each second; larger
  ones (64 MiB blocks) are mapped and go back to the system when freed.
- :func:`thp_environ` (before the daemon's process starts, or by its
  re-exec): glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc 2.35+), so the
  mapped buffers are advised for transparent huge pages where the system
  leaves them to madvise (Debian's default).  A mapped buffer is faulted in
  and zeroed by the kernel at every use: 4 KiB at a time that ran at
  3.0 GB/s here, 2 MiB at a time at 16 GB/s, and a 64 MiB block's commit
  touches about 200 MiB of fresh buffers (its bytes, planes, their zstd
  frames, the joined frame).  fio's sequential 1 MiB writes into the mount:
  150-183 MiB/s without, 204-251 with (docs/performance.md).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False   # (typing.TYPE_CHECKING, without importing typing: the CLI imports this)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

#: Buffers of this many bytes and more are mapped (see fix_malloc).
MMAP_FROM = 4 << 20
#: Seconds between two trims of the heaps (see Daemon._trim_heaps).
HEAP_TRIM_INTERVAL = 1.0
#: glibc's tunable for transparent huge pages in malloc, as the daemon sets it.
HUGETLB = "glibc.malloc.hugetlb"


def fix_malloc() -> Callable[[], None] | None:
    """Page-sized buffers from glibc's heaps, block-sized ones mapped; returns
    what gives the heaps' free pages back (see Daemon._trim_heaps), or None.

    glibc raises its mmap threshold (up to 32 MiB) each time a mapped buffer
    is freed; the daemon's block-sized buffers (reads, decodes, commits on
    several threads) then stay in its heaps.  Under fsstress -n 500 -p 4 the
    daemon's peak RSS went from 1.14 GB to 0.73-0.84 GB with the threshold
    fixed.  Fixed at 1 MiB, every buffer of a 2 MiB page (its bytes, its
    frame, its planes) was a fresh mapping, its pages faulted in and zeroed
    each time, and one freed atop a heap went back at once: a cold read of
    512 MiB of such pages took 1.29 s, against 0.98 s with buffers under
    4 MiB from the heaps, 4 MiB kept free atop them; a page's encode ran at
    0.90-1.0 GB/s, against 1.24.  Two arenas, not glibc's eight a core,
    and the heaps trimmed each second bound what they keep (fsstress's peak
    RSS: docs/performance.md).
    """
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None  # (not glibc)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    mallopt(M_ARENA_MAX, 2)
    mallopt(M_MMAP_THRESHOLD, MMAP_FROM)
    mallopt(M_TRIM_THRESHOLD, MMAP_FROM)
    return lambda: malloc_trim(0)


def _glibc_has_hugetlb() -> bool:
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()   # e.g. "glibc 2.36"
        major, minor = (int(x) for x in version.split(".")[:2])
    except (ValueError, OSError, AttributeError):
        return False   # (not glibc)
    return name == "glibc" and (major, minor) >= (2, 35)


def thp_environ(environ: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """*environ* with glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES, or None
    when there is nothing to add: the tunable is set already (either way: a
    user's choice stands), or this glibc has no such tunable."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == HUGETLB for t in tunables.split(":")) or not _glibc_has_hugetlb():
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGETLB}=1" if tunables else f"{HUGETLB}=1"
    return env


def reexec_with_thp() -> None:
    """Run this process's command line again, same pid, with thp_environ's
    environment (glibc reads its tunables only at a process's start); returns
    only when there is nothing to add."""
    env = thp_environ()
    if env is not None and getattr(sys, "orig_argv", None) and sys.executable:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(sys.executable, sys.orig_argv, env)
        except OSError as e:   # (then the daemon runs without: slower, not wrong)
            print(f"pffs mount: could not run again with {HUGETLB}=1: {e}", file=sys.stderr)
