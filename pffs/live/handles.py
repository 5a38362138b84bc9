"""What the parts of the FUSE side of ``engines/`` share: open handles, the
reader's process, errnos, and what they ask of the mount's store.

(:mod:`.view` is the tree that answers the requests; :mod:`.attrs` says what
an inode is; :mod:`.copyin` takes sessions being copied in; :mod:`.copyout`
stores live pages ahead of copies out.)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import pyfuse3
from pyfuse3 import FUSEError

from pffs.live.engines import SessionEntry
from pffs.live.errors import EngineError
from pffs.live.incoming import IncomingSession, Node
from pffs.live.pages import Snapshot
from pffs.namespace import BlobRow
from pffs.types import InodeNo, PageIndex

P = ParamSpec("P")
R = TypeVar("R")


def engine_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Engine failures become the errno a reader or writer gets."""
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
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


@dataclass(frozen=True)
class LiveStore:
    """What ``engines/`` asks of the mount's store (pffs.daemon.handlers.build makes it)."""

    #: the bytes of a blob: a page named by its blob in a session being copied
    #: in, when something reads or changes them before the engine takes it
    fetch_blob: Callable[[str], Awaitable[bytes | memoryview]]
    #: a blob made of some bytes, ``(data, digest=None)``, and its row: a live
    #: page copied out of engines/, stored ahead of the copy
    store_blob: Callable[..., Awaitable[BlobRow]]
    #: blobs an engine put in the store itself, given rows (a local store
    #: only; else None)
    adopt_blobs: Callable[[list[str]], Awaitable[Any]] | None = None


_TGID_TTL = 1.0
_tgids: dict[int, tuple[int, float]] = {}


def reader_pid(ctx: pyfuse3.RequestContext | None) -> int:
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
