"""An attached engine as the daemon sees it: its folder's sessions, their snapshots, page-in.

An engine is made of parts: its connection (:class:`pffs.live.link.EngineLink`:
requests and answers) and its pages (:class:`pffs.live.pages.EnginePages`:
staging slots, reads, hashes).  Its own state lives on the trio thread (code
between two awaits is atomic):

- ``entries``: one :class:`SessionEntry` per session name seen in the engine
  folder (a live session, or one being copied in), with the snapshots
  readers are bound to;
- ``snapshots``: pinned views of live sessions (see :meth:`LiveEngine.snapshot_for`),
  whose pages read the same bytes for as long as they live
  (:mod:`pffs.live.pages`).

When manifest.json is first needed, the daemon gathers every page once to
compute the digests it lists; pages that still sit in staging when read are
served from there, others are gathered again from the pinned blocks.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time

import trio

from pffs import manifest as mf
from pffs.live.channel import TrioChannel
from pffs.live.errors import EngineError, EngineGone, EngineRefused
from pffs.live.incoming import IncomingSession, memfd_with
from pffs.live.link import GONE, EngineLink
from pffs.live.pages import EnginePages, Snapshot
from pffs.live.registry import LiveRegistry, Registration

log = logging.getLogger("pffs.live")

PAGE_IN_TIMEOUT = 600.0
LIST_TTL = 0.5              # how long a session listing is reused for lookups
SNAPSHOT_IDLE = 2.0         # an unused snapshot is released after this long
SNAPSHOT_REUSE = 1.0        # a reader's snapshot used within this long is its next manifest.json open's and listing's
MAX_SNAPSHOTS = 64          # per engine; past it, opening another answers EBUSY


class SessionEntry:
    """A name in an engine folder: a live session, one being copied in, or both gone."""

    def __init__(self, engine: LiveEngine, name: str):
        self.engine = engine
        self.name = name
        self.key = engine.registry.new_key(self)
        self.bound: dict[int, Snapshot] = {}    # reader pid -> its snapshot
        self.latest: Snapshot | None = None
        self.incoming: IncomingSession | None = None
        # The files and folders of the copy the engine took last, by inode:
        # what of the live session each is (IncomingSession.live_names), for
        # names the kernel keeps until the invalidations of a take land.
        self.taken: dict[int, tuple[str, int | None]] = {}
        self.lock = trio.Lock()                  # one snapshot taken at a time
        self.seen_ns = time.time_ns()            # (its folder's time: LiveAttrs.session)
        # Until when the kernel may keep the attributes of pages 0..kept_pages-1 (keep_page_attrs)
        self.kept_until = 0.0
        self.kept_pages = 0
        self.forgetting: trio.Event | None = None

    def busy(self) -> bool:
        return bool(self.incoming or self.latest or any(not s.released for s in self.bound.values()))


class LiveEngine:
    def __init__(self, registry: Registry, reg: Registration, chan: TrioChannel, shm: mmap.mmap,
                 nursery: trio.Nursery):
        self.registry = registry
        self.reg = reg
        self.name = reg.name
        self.nursery = nursery          # (work in the background: the engine socket's)
        self.link = EngineLink(reg.name, reg.pid, chan, nursery)
        self.pages = EnginePages(self.link, shm, reg.slots, reg.page_bytes, registry, nursery,
                                 stores=bool(reg.info.get("stores")))
        self.page_bytes = reg.page_bytes
        self.key = registry.new_key(self)
        self.attached_ns = time.time_ns()
        self.entries: dict[str, SessionEntry] = {}
        self.snapshots: dict[int, Snapshot] = {}
        self.incoming_bytes = 0
        self._names: list[str] = []
        self._names_at = float("-inf")
        self._listing: trio.Event | None = None
        self._warm: list[str] = []    # blobs to tell the engine of (warm)

    def __repr__(self) -> str:
        return f"engine {self.name!r} (pid {self.reg.pid})"

    @property
    def alive(self) -> bool:
        """Attached still (its connection open)."""
        return self.link.alive

    def entry(self, name: str) -> SessionEntry:
        """The entry of session *name* in the engine folder, made if it has none yet."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = SessionEntry(self, name)
        return e

    def warm(self, digest: str) -> None:
        """A page file being copied into this engine's folder holds blob *digest*:
        tell the engine, which decodes it ahead of the load (engine_bridge.attach.warm).
        No answer is awaited; digests told while one message is on its way go
        in the next."""
        if not self.alive or not self.reg.info.get("warms"):
            return
        self._warm.append(digest)
        if len(self._warm) > 1:
            return      # (a sender is on its way: it takes this one too)

        async def send() -> None:
            while self._warm and self.alive:
                blobs = list(self._warm)
                try:
                    await self.link.send({"op": "warm", "mount": self.registry.mountpoint, "blobs": blobs})
                except GONE:
                    break
                del self._warm[:len(blobs)]
            self._warm.clear()
        self.nursery.start_soon(send)

    # -- connection ----------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the engine leaves (or dies); then detach it."""
        why, clean = "the daemon is unmounting", True     # unless the connection ends first
        try:
            why, clean = await self.link.serve()
        finally:
            self.detach(why, clean)

    def detach(self, why: str, clean: bool) -> None:
        """Forget the engine: readers in flight get EIO, its folder goes."""
        if not self.alive:
            return
        self.link.close()
        self.registry.remove_engine(self.name, self)
        self.registry.keys.pop(self.key, None)
        for entry in self.entries.values():
            self.registry.keys.pop(entry.key, None)
            if entry.incoming is not None:
                self.drop_incoming(entry)
        for snap in self.snapshots.values():
            snap.released = True
        self.snapshots.clear()
        try:
            self.pages.shm.close()
        except BufferError:
            pass  # a worker thread still hashes from it; it goes with the last view
        if clean:
            log.info("engine %s (pid %d) detached", self.name, self.reg.pid)
        else:
            log.warning("engine %s (pid %d) went away (%s); its live sessions are gone",
                        self.name, self.reg.pid, why)

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
                reply = await self.link.request("list")
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
        if snap.released or not self.registry.cache.keeps or any(
                s is not snap and s.session == entry.name for s in self.snapshots.values()):
            return False
        entry.kept_until = time.monotonic() + ttl
        entry.kept_pages = max(entry.kept_pages, snap.n_pages)
        return True

    async def _forget_kept(self, entry: SessionEntry) -> None:
        if entry.kept_pages:    # (only where the kernel keeps them: keep_page_attrs)
            n, entry.kept_pages = entry.kept_pages, 0
            if time.monotonic() < entry.kept_until:
                ev = entry.forgetting = trio.Event()
                try:
                    await self.registry.cache.forget_pages(entry.key, n)
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
        reply = await self.link.request("snapshot", session=entry.name)
        self.registry.counts["snapshots"] += 1
        snap = Snapshot(int(reply["snap"]), entry.name, int(reply["n_pages"]))
        self.snapshots[snap.id] = snap
        self.pages.slots.live_snaps.add(snap.id)
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
                pages = await self.pages.digests(snap)
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
        self.pages.slots.drop_snapshot(snap.id)
        entry = self.entries.get(snap.session)
        if entry is not None:
            for pid in [p for p, s in entry.bound.items() if s is snap]:
                del entry.bound[pid]
            if entry.latest is snap:
                entry.latest = None
            if entry.kept_pages:
                self.nursery.start_soon(self._forget_kept, entry)
        if self.alive:
            self.link.send_soon({"op": "release", "snap": snap.id})

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

    # -- page in -------------------------------------------------------------------

    async def page_in(self, entry: SessionEntry) -> list[str]:
        """Hand a complete incoming session to the engine; drop it either way.

        Returns the sequence ids now live; EngineRefused (with the errno the
        closing writer gets) or EngineGone otherwise.
        """
        inc = entry.incoming
        # Called once complete() said so, nothing having run since: manifest.json is parsed.
        assert inc is not None and inc.manifest is not None and inc.manifest_data is not None
        m, manifest_data = inc.manifest, inc.manifest_data
        inc.state = "paging-in"
        taken = False
        try:
            nodes = inc.page_nodes()
            sizes = [n.size for n in nodes]
            data = [n.data for n in nodes]
            fd = await trio.to_thread.run_sync(memfd_with, data, m.page_bytes, manifest_data)
            try:
                reply = await self.link.request("page_in", timeout=PAGE_IN_TIMEOUT, fds=[fd],
                                           name=entry.name, sizes=sizes, page_bytes=m.page_bytes,
                                           manifest_bytes=len(manifest_data))
            finally:
                os.close(fd)
            self.note_session(entry.name)
            taken = True
            return [str(s) for s in reply.get("seqs", [])]
        finally:
            self.drop_incoming(entry, taken)

    async def load_blobs(self, entry: SessionEntry) -> list[str] | None:
        """Have the engine page in a complete incoming session whose every page
        the store holds (by name), reading them from the store itself; drop
        the session.  None, and nothing dropped, where the engine cannot read
        the store (then its bytes go in a memfd: page_in)."""
        inc = entry.incoming
        assert inc is not None and inc.manifest is not None and inc.manifest_data is not None
        manifest_data = inc.manifest_data
        sizes = [n.size for n in inc.page_nodes()]
        inc.state = "paging-in"
        fd = await trio.to_thread.run_sync(memfd_with, [], 0, manifest_data)
        try:
            reply = await self.link.request("load_blobs", timeout=PAGE_IN_TIMEOUT, fds=[fd],
                                       name=entry.name, mount=self.registry.mountpoint, sizes=sizes,
                                       manifest_bytes=len(manifest_data))
        except EngineRefused as e:
            # (ENOTSUP: it cannot reach the store; EINVAL "unknown request": an older agent.)
            if e.errno == errno.ENOTSUP or (e.errno == errno.EINVAL and "unknown request" in str(e)):
                log.info("engine %s cannot read the store (%s): the pages go to it in memory",
                         self.name, e)
                inc.state = "gathering"
                return None
            self.drop_incoming(entry)
            raise
        except BaseException:
            self.drop_incoming(entry)
            raise
        finally:
            os.close(fd)
        self.note_session(entry.name)
        self.drop_incoming(entry, taken=True)
        return [str(s) for s in reply.get("seqs", [])]

    async def save(self, session: str, path: str) -> int:
        """Have the engine page live *session* out as a new session at *path*; its page count."""
        reply = await self.link.request("save", timeout=PAGE_IN_TIMEOUT, session=session, path=path)
        return int(reply.get("pages", 0))

    async def load(self, name: str, path: str) -> list[str]:
        """Have the engine page the session at *path* in as *name*; the sequence ids now live."""
        reply = await self.link.request("load", timeout=PAGE_IN_TIMEOUT, name=name, path=path)
        self.note_session(name)
        return [str(s) for s in reply.get("seqs", [])]

    def drop_incoming(self, entry: SessionEntry, taken: bool = False) -> None:
        """Forget a session being copied in, and the memory it held; *taken*:
        the engine has it (its files' inodes then name the live session's)."""
        inc, entry.incoming = entry.incoming, None
        if inc is not None:
            entry.taken = inc.live_names() if taken else {}
            self.registry.cache.incoming_gone(self.key, entry.key, entry.name, list(inc.root.children))
            freed = inc.drop()
            self.incoming_bytes -= freed
            self.registry.incoming_bytes -= freed




#: The registry of live engines, typed with what it holds.
Registry = LiveRegistry[LiveEngine, SessionEntry]
