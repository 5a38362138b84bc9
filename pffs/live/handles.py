"""What both halves of the FUSE view of ``engines/`` share: open handles, the reader's process, errnos.

(:mod:`.view` answers attributes, lookups, listings and reads; :mod:`.writes`
takes sessions being copied in, and save/load.)
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from pyfuse3 import FUSEError

from pffs.live.errors import EngineError
from pffs.live.incoming import IncomingSession, Node
from pffs.live.listings import SessionEntry, Snapshot
from pffs.types import InodeNo, PageIndex


def _errors(fn):
    """Engine failures become the errno a reader or writer gets."""
    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        except EngineError as e:
            raise FUSEError(e.errno) from None
    return wrapper


@dataclass(eq=False)
class Handle:
    kind: str                      # "manifest", "page" or "file" (a file being copied in)
    entry: SessionEntry
    snap: Snapshot | None = None
    ix: PageIndex = PageIndex(0)
    node: Node | None = None
    inc: IncomingSession | None = None
    writable: bool = False


@dataclass(eq=False)
class DirHandle:
    ino: InodeNo
    snap: Snapshot | None = None


_TGID_TTL = 1.0
_tgids: dict[int, tuple[int, float]] = {}


def _pid(ctx) -> int:
    """The process (not thread) a request comes from: readers are told apart by it.

    FUSE gives the calling thread's id; threads of one reader (a page-in
    reading pages from worker threads) must see one snapshot.  The thread ->
    process map is cached for a second (a thread id is not reused sooner).
    """
    tid = getattr(ctx, "pid", 0) if ctx is not None else 0
    if tid <= 0:
        return 0
    now = time.monotonic()
    got = _tgids.get(tid)
    if got is not None and now - got[1] < _TGID_TTL:
        return got[0]
    tgid = tid
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    tgid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    if len(_tgids) > 4096:
        _tgids.clear()
    _tgids[tid] = (tgid, now)
    return tgid

