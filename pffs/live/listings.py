"""Session listings and snapshots of an attached engine (see pffs.live.engines for the snapshot rules).

:class:`EngineSessions` is the part of :class:`pffs.live.engines.LiveEngine`
that knows the engine's session names and the snapshots readers are bound to;
it asks the engine through the LiveEngine's requests and hashes pages through
its page reads.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pffs import manifest as mf
from pffs.live.errors import EngineError, EngineGone, EngineRefused
from pffs.live.incoming import IncomingSession
from pffs.live.registry import LiveRegistry, Registration
from pffs.live.slots import SlotCache
from pffs.namespace import BlobRow
from pffs.types import Digest, PageIndex

log = logging.getLogger("pffs.live")

LIST_TTL = 0.5              # how long a session listing is reused for lookups
SNAPSHOT_IDLE = 2.0         # an unused snapshot is released after this long
SNAPSHOT_REUSE = 1.0        # a reader's snapshot used within this long is its next manifest.json open's and listing's
MAX_SNAPSHOTS = 64          # per engine; past it, opening another answers EBUSY


@dataclass(eq=False)
class Snapshot:
    engine: EngineSessions
    id: int
    session: str
    n_pages: int
    skeleton: mf.Manifest | None = None     # the manifest, page digests still placeholders
    manifest: bytes | None = None           # manifest.json, once every page was hashed
    digesting: trio.Event | None = None
    taken_ns: int = field(default_factory=time.time_ns)
    taken: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    refs: int = 0            # open files and folders reading it
    # (reader, what) of the readers that opened its manifest.json or listed its pages/ (snapshot_for)
    fresh_for: set[tuple[int, str]] = field(default_factory=set)
    released: bool = False
    # Pages stored as blobs for copies out of it (LiveView.page_blob): page
    # index -> its blob's row; storing[ix] is set once tried.
    blobs: dict[int, BlobRow] = field(default_factory=dict)
    storing: dict[int, trio.Event] = field(default_factory=dict)


class SessionEntry:
    """A name in an engine folder: a live session, one being copied in, or both gone."""

    def __init__(self, engine: EngineSessions, name: str, key: int):
        self.engine = engine
        self.name = name
        self.key = key
        self.bound: dict[int, Snapshot] = {}    # reader pid -> its snapshot
        self.latest: Snapshot | None = None
        self.incoming: IncomingSession | None = None
        # The files and folders of the copy the engine took last, by inode:
        # what of the live session each is (IncomingSession.live_names), for
        # names the kernel keeps until the invalidations of a take land.
        self.taken: dict[int, tuple[str, int | None]] = {}
        self.lock = trio.Lock()                  # one snapshot taken at a time
        self.seen_ns = time.time_ns()            # (its folder's time: LiveView._session_attr)
        # Until when the kernel may keep the attributes of pages 0..kept_pages-1 (keep_page_attrs)
        self.kept_until = 0.0
        self.kept_pages = 0
        self.forgetting: trio.Event | None = None

    def busy(self) -> bool:
        return bool(self.incoming or self.latest or any(not s.released for s in self.bound.values()))



class EngineSessions:
    """The sessions and snapshots half of a LiveEngine (which sets this state up)."""

    name: str
    alive: bool
    registry: LiveRegistry[Any, Any]      # (only its keys are dropped here)
    reg: Registration
    page_bytes: int
    attached_ns: int
    incoming_bytes: int
    slots: SlotCache
    entries: dict[str, SessionEntry]
    snapshots: dict[int, Snapshot]
    _names: list[str]
    _names_at: float
    _listing: trio.Event | None
    stores: bool            # the engine stores pages in the store itself (LiveEngine.store_pages)

    if TYPE_CHECKING:
        # Methods of the LiveEngine (pffs.live.engines) this half uses, and
        # those that users of a SessionEntry's engine call.
        async def request(self, op: str, *, timeout: float = ..., fds: Sequence[int] = (),
                          **args: Any) -> dict[str, Any]: ...
        async def _digests(self, snap: Snapshot) -> list[Digest]: ...
        def _spawn_release(self, snap_id: int) -> None: ...
        async def read(self, snap: Snapshot, ix: PageIndex, off: int, size: int) -> bytes: ...
        async def with_page(self, snap: Snapshot, ix: PageIndex, fn: Callable[[memoryview], Awaitable[Any]],
                            ahead: Sequence[PageIndex] = ()) -> Any: ...
        def gather_batch(self) -> int: ...
        def gather_soon(self, snap: Snapshot, ixs: Sequence[PageIndex]) -> None: ...
        async def store_pages(self, snap: Snapshot, ixs: list[PageIndex]) -> list[tuple[PageIndex, BlobRow]]: ...
        async def page_in(self, entry: SessionEntry) -> list[str]: ...
        async def load_blobs(self, entry: SessionEntry) -> list[str] | None: ...
        def warm(self, digest: str) -> None: ...
    # -- sessions ------------------------------------------------------------

    async def names(self, max_age: float = LIST_TTL) -> list[str]:
        """The engine's live session names, asking it when the last answer is older than *max_age*."""
        while True:
            if time.monotonic() - self._names_at <= max_age:
                return self._names
            if self._listing is not None:
                ev = self._listing
                await ev.wait()
                if not self.alive:
                    raise EngineGone(f"engine {self.name} is gone")
                max_age = max(max_age, 0.05)
                continue
            ev = self._listing = trio.Event()
            try:
                reply = await self.request("list")
                names = reply.get("sessions")
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise EngineError(f"engine {self.name} sent a bad session list")
                self._names = names
                self._names_at = time.monotonic()
                self._prune()
            finally:
                self._listing = None
                ev.set()
            return self._names

    def _prune(self) -> None:
        live = set(self._names)
        for name, e in list(self.entries.items()):
            if name not in live and not e.busy():
                del self.entries[name]
                self.registry.keys.pop(e.key, None)

    def note_session(self, name: str) -> None:
        """A session the daemon itself just added (a page-in): listed at once."""
        if name not in self._names:
            self._names = [*self._names, name]

    # -- snapshots -------------------------------------------------------------

    async def snapshot_for(self, entry: SessionEntry, pid: int, *, fresh: str = "") -> Snapshot:
        """The snapshot reader *pid* sees of *entry*.

        Opening manifest.json or listing pages/ (*fresh*: which of the two)
        takes a new one, unless the same reader used its snapshot within
        SNAPSHOT_REUSE seconds (a stat, a page it read or copied, the other
        of the two) and has not done this one on it yet.  So ``cp -r``,
        which lists pages/, copies the pages and then manifest.json, gets
        one snapshot taken when it starts, and its manifest lists the pages
        it copied; a process that reads manifest.json again gets a new one.
        Anything else (a stat, opening a page) uses the reader's snapshot,
        else the session's latest one while it is in use, else takes one.
        """
        if not fresh:
            s = self._usable(entry, pid)
            if s is not None:
                return self._bind(entry, pid, s)
        async with entry.lock:
            s = entry.bound.get(pid)
            if s is not None and s.released:
                s = None
            if fresh:
                if s is not None and ((pid, fresh) in s.fresh_for
                                      or time.monotonic() - s.last_used > SNAPSHOT_REUSE):
                    s = None
            else:
                s = self._usable(entry, pid)    # taken by another reader while we waited
            if s is None:
                s = await self._take(entry)
                await self._forget_kept(entry)
            if fresh:
                s.fresh_for.add((pid, fresh))
            return self._bind(entry, pid, s)

    def keep_page_attrs(self, entry: SessionEntry, snap: Snapshot, ttl: float) -> bool:
        """Whether the kernel may keep the attributes of *snap*'s pages for *ttl*
        seconds (noted if so): while it is the only snapshot of its session, every
        reader sees them (its time; a page's size is the engine's).  A new
        snapshot of the session has the kernel forget them before the request
        that took it is answered, and a release soon after (_forget_kept), so
        no reader sees another's.  (cp -r out of engines/ asked a GETATTR of
        each page three times.)"""
        if snap.released or self.registry.forget_pages is None or any(
                s is not snap and s.session == entry.name for s in self.snapshots.values()):
            return False
        entry.kept_until = time.monotonic() + ttl
        entry.kept_pages = max(entry.kept_pages, snap.n_pages)
        return True

    async def _forget_kept(self, entry: SessionEntry) -> None:
        if entry.kept_pages and self.registry.forget_pages is not None:
            n, entry.kept_pages = entry.kept_pages, 0
            if time.monotonic() < entry.kept_until:
                ev = entry.forgetting = trio.Event()
                try:
                    await self.registry.forget_pages(entry, n)
                finally:
                    ev.set()
                    if entry.forgetting is ev:
                        entry.forgetting = None
        elif entry.forgetting is not None:     # (a release's, under way)
            await entry.forgetting.wait()

    def _usable(self, entry: SessionEntry, pid: int) -> Snapshot | None:
        """The reader's own snapshot, else the session's latest while in use, else None."""
        s = entry.bound.get(pid)
        if s is not None and not s.released:
            return s
        latest = entry.latest
        if latest is not None and not latest.released and (
                latest.refs or time.monotonic() - latest.last_used < SNAPSHOT_IDLE):
            return latest
        return None

    def _bind(self, entry: SessionEntry, pid: int, s: Snapshot) -> Snapshot:
        old = entry.bound.get(pid)
        entry.bound[pid] = s
        if entry.latest is None or entry.latest.released or entry.latest.taken <= s.taken:
            entry.latest = s
        s.last_used = time.monotonic()
        if (old is not None and old is not s and not old.refs and old is not entry.latest
                and old not in entry.bound.values()):
            self.release(old)
        return s

    async def _take(self, entry: SessionEntry) -> Snapshot:
        # The session's snapshots no reader can use any more (none open, every
        # process bound to them gone: a cp -r that ended) go now, not once idle:
        # else the new one would not be the session's only one (keep_page_attrs).
        for old in [s for s in self.snapshots.values() if s.session == entry.name and not s.refs]:
            if not any(b is old and os.path.exists(f"/proc/{pid}") for pid, b in entry.bound.items()):
                self.release(old)
        if len(self.snapshots) >= MAX_SNAPSHOTS and not self._release_idlest():
            log.warning("engine %s: %d snapshots are being read; refusing another of %s",
                        self.name, len(self.snapshots), entry.name)
            raise EngineRefused(errno.EBUSY, "too many snapshots")
        reply = await self.request("snapshot", session=entry.name)
        self.registry.counts["snapshots"] += 1
        snap = Snapshot(self, int(reply["snap"]), entry.name, int(reply["n_pages"]))
        self.snapshots[snap.id] = snap
        self.slots.live_snaps.add(snap.id)
        try:
            snap.skeleton = mf.parse(reply["manifest"])
            if len(snap.skeleton.pages) != snap.n_pages:
                raise mf.ManifestError("pages", f"{len(snap.skeleton.pages)} listed, {snap.n_pages} pinned")
        except (mf.ManifestError, KeyError, TypeError) as e:
            log.error("engine %s sent an invalid manifest for %s: %s", self.name, entry.name, e)
            self.release(snap)
            raise EngineError("invalid manifest from the engine") from None
        return snap

    async def manifest_of(self, snap: Snapshot) -> bytes:
        """manifest.json of a snapshot: every page gathered once and hashed, the first time it is needed.

        Listing pages/ or reading one page needs none of this; a stat or a
        read of manifest.json does.
        """
        while snap.manifest is None:
            if snap.digesting is not None:
                await snap.digesting.wait()
                continue
            ev = snap.digesting = trio.Event()
            snap.refs += 1      # not released while its pages are being hashed
            try:
                pages = await self._digests(snap)
                m = snap.skeleton
                assert m is not None    # set by _take() before the snapshot is handed out
                m.pages = pages
                snap.manifest = m.to_json()
            finally:
                snap.refs -= 1
                snap.last_used = time.monotonic()
                snap.digesting = None
                ev.set()
        return snap.manifest

    def release(self, snap: Snapshot) -> None:
        """Unpin a snapshot in the engine and forget its pages."""
        if snap.released:
            return
        snap.released = True
        self.snapshots.pop(snap.id, None)
        self.slots.drop_snapshot(snap.id)
        entry = self.entries.get(snap.session)
        if entry is not None:
            for pid in [p for p, s in entry.bound.items() if s is snap]:
                del entry.bound[pid]
            if entry.latest is snap:
                entry.latest = None
            if entry.kept_pages:
                self.registry.spawn(self._forget_kept, entry)
        if self.alive:
            self._spawn_release(snap.id)

    def _release_idlest(self) -> bool:
        idle = [s for s in self.snapshots.values() if not s.refs]
        if not idle:
            return False
        self.release(min(idle, key=lambda s: s.last_used))
        return True

    def reap(self, now: float) -> None:
        """Release snapshots nobody has used for SNAPSHOT_IDLE seconds."""
        for snap in list(self.snapshots.values()):
            if not snap.refs and now - snap.last_used > SNAPSHOT_IDLE:
                self.release(snap)
