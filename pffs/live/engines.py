"""An attached engine as the daemon sees it: requests, snapshots, page reads, page-in.

State lives on the trio thread (code between two awaits is atomic):

- ``entries``: one :class:`SessionEntry` per session name seen in the engine
  folder (a live session, or one being copied in), with the snapshots
  readers are bound to;
- ``snapshots``: pinned views of live sessions (see :meth:`LiveEngine.snapshot_for`);
- ``slots``: which snapshot pages sit in the shared staging buffer.

A snapshot is taken by the engine between steps: the session's token count
and block list, each block pinned by a reference so it is neither freed nor
reused.  KV of the tokens it covers never changes and slots past them are
zeroed in the page bytes, so its pages read the same bytes for as long as it
lives, while the sequence keeps decoding.  When manifest.json is first
needed, the daemon gathers every page once to compute the digests it lists;
pages that still sit in staging when read are served from there, others are
gathered again from the pinned blocks.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from .. import manifest as mf
from ..types import Digest, PageIndex, digest_of
from .channel import TrioChannel
from .incoming import IncomingSession, memfd_with
from .protocol import ProtocolError
from .slots import SlotCache

if TYPE_CHECKING:
    from .server import LiveEngines

log = logging.getLogger("pffs.live")

REQUEST_TIMEOUT = 30.0      # an engine that does not answer a read in this long: EIO
PAGE_IN_TIMEOUT = 600.0
LIST_TTL = 0.5              # how long a session listing is reused for lookups
SNAPSHOT_IDLE = 2.0         # an unused snapshot is released after this long
SNAPSHOT_REUSE = 1.0        # a snapshot taken by a stat is the next open's, within this long
MAX_SNAPSHOTS = 64          # per engine; past it, opening another answers EBUSY
BATCH_BYTES = 8 << 20       # pages per gather (digest pass, read-ahead)
INCOMING_LIMIT = 2 << 30    # bytes of sessions being copied into engines, all engines together


class EngineError(Exception):
    """A request the engine could not serve; ``errno`` is what the reader gets."""

    errno = errno.EIO


class EngineGone(EngineError):
    """The engine detached or crashed."""


class EngineRefused(EngineError):
    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err


@dataclass
class Registration:
    """What an engine told the daemon when it attached (checked by the server)."""

    name: str
    pid: int
    uid: int
    gid: int
    geometry: dict[str, Any]
    page_bytes: int
    slots: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Snapshot:
    engine: "LiveEngine"
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
    opened: bool = False     # manifest.json was opened on it
    released: bool = False


class SessionEntry:
    """A name in an engine folder: a live session, one being copied in, or both gone."""

    def __init__(self, engine: "LiveEngine", name: str, key: int):
        self.engine = engine
        self.name = name
        self.key = key
        self.bound: dict[int, Snapshot] = {}    # reader pid -> its snapshot
        self.latest: Snapshot | None = None
        self.incoming: IncomingSession | None = None
        self.lock = trio.Lock()                  # one snapshot taken at a time

    def busy(self) -> bool:
        return bool(self.incoming or self.latest or any(not s.released for s in self.bound.values()))


class _Pending:
    __slots__ = ("event", "reply")

    def __init__(self):
        self.event = trio.Event()
        self.reply: dict[str, Any] | None = None


def unwrap(eg: BaseExceptionGroup) -> BaseException:
    """The exception to raise for a nursery's group: an EngineError if it holds one."""
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            e = unwrap(e)
        if isinstance(e, EngineError):
            return e
    return eg


class LiveEngine:
    def __init__(self, registry: "LiveEngines", reg: Registration, chan: TrioChannel,
                 shm: mmap.mmap, key: int):
        self.registry = registry
        self.reg = reg
        self.name = reg.name
        self.chan = chan
        self.shm = shm
        self.key = key
        self.page_bytes = reg.page_bytes
        self.slots = SlotCache(reg.slots)
        self.attached_ns = time.time_ns()
        self.alive = True
        self.entries: dict[str, SessionEntry] = {}
        self.snapshots: dict[int, Snapshot] = {}
        self.incoming_bytes = 0
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._names: list[str] = []
        self._names_at = float("-inf")
        self._listing: trio.Event | None = None
        self._pidfd: int | None = None

    def __repr__(self) -> str:
        return f"engine {self.name!r} (pid {self.reg.pid})"

    # -- requests ----------------------------------------------------------

    async def request(self, op: str, *, timeout: float = REQUEST_TIMEOUT, fds=(),
                      **args) -> dict[str, Any]:
        """Send a request and wait for its answer.

        EngineGone if the engine goes away first (at once, whatever the
        timeout), EngineRefused if it refuses, EngineError after *timeout*.
        """
        if not self.alive:
            raise EngineGone(f"engine {self.name} is gone")
        rid = self._next_id
        self._next_id += 1
        p = self._pending[rid] = _Pending()
        try:
            try:
                await self.chan.send({"op": op, "id": rid, **args}, fds)
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                raise EngineGone(f"engine {self.name} is gone") from None
            with trio.move_on_after(timeout):
                await p.event.wait()
        finally:
            del self._pending[rid]
        reply = p.reply
        if reply is None:
            if not self.alive:
                raise EngineGone(f"engine {self.name} is gone")
            log.error("%r did not answer %s within %.0f s", self, op, timeout)
            raise EngineError(f"engine {self.name} did not answer")
        if not reply.get("ok"):
            raise EngineRefused(int(reply.get("errno") or errno.EIO), str(reply.get("error") or "refused"))
        return reply

    def _spawn_release(self, snap_id: int) -> None:
        async def send():
            try:
                await self.chan.send({"op": "release", "snap": snap_id})
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                pass
        self.registry.spawn(send)

    # -- connection ----------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the engine leaves (or dies); then detach it."""
        why, clean = "the daemon is unmounting", True     # unless the connection ends first
        try:
            try:
                self._pidfd = os.pidfd_open(self.reg.pid) if self.reg.pid > 0 else None
            except OSError:
                self._pidfd = None
            async with trio.open_nursery() as nursery:
                if self._pidfd is not None:
                    nursery.start_soon(self._watch_pid, nursery.cancel_scope)
                why, clean = await self._read_replies()
                nursery.cancel_scope.cancel()
            if self._exited:
                why, clean = "the process exited", False
        finally:
            self.detach(why, clean)

    _exited = False

    async def _watch_pid(self, scope: trio.CancelScope) -> None:
        # The pidfd turns readable when the process exits: no waiting for a
        # socket another process may have inherited.
        await trio.lowlevel.wait_readable(self._pidfd)
        self._exited = True
        scope.cancel()

    async def _read_replies(self) -> tuple[str, bool]:
        while True:
            try:
                got = await self.chan.recv()
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError) as e:
                return f"connection error: {e}", False
            except ProtocolError as e:
                return f"protocol error: {e}", False
            if got is None:
                return "connection closed", False
            msg, fds = got
            for fd in fds:
                os.close(fd)
            if "re" in msg:
                p = self._pending.get(msg["re"])
                if p is not None:
                    p.reply = msg
                    p.event.set()
                elif msg.get("ok") and "snap" in msg:
                    # A snapshot whose request timed out: nobody will read it.
                    self._spawn_release(msg["snap"])
            elif msg.get("op") == "bye":
                return "detached", True
            else:
                log.warning("%r sent an unexpected message %r", self, str(msg.get("op"))[:40])

    def detach(self, why: str, clean: bool) -> None:
        """Forget the engine: readers in flight get EIO, its folder goes."""
        if not self.alive:
            return
        self.alive = False
        for p in self._pending.values():
            p.event.set()
        if self.registry.engines.get(self.name) is self:
            del self.registry.engines[self.name]
        self.registry.keys.pop(self.key, None)
        for entry in self.entries.values():
            self.registry.keys.pop(entry.key, None)
            if entry.incoming is not None:
                self.drop_incoming(entry)
        for snap in self.snapshots.values():
            snap.released = True
        self.snapshots.clear()
        self.chan.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        try:
            self.shm.close()
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

    def entry(self, name: str) -> SessionEntry:
        e = self.entries.get(name)
        if e is None:
            e = SessionEntry(self, name, 0)
            e.key = self.registry.new_key(e)
            self.entries[name] = e
        return e

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

    async def snapshot_for(self, entry: SessionEntry, pid: int, *, fresh: bool) -> Snapshot:
        """The snapshot reader *pid* sees of *entry*.

        Opening manifest.json (*fresh*) takes a new one, unless the same
        reader took one for a stat within SNAPSHOT_REUSE seconds and has
        not opened it yet.  Anything else (stat, listing pages/, opening a
        page) uses the reader's snapshot, else the session's latest one
        while it is in use, else takes one.
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
                if s is not None and (s.opened or time.monotonic() - s.taken > SNAPSHOT_REUSE):
                    s = None
            else:
                s = self._usable(entry, pid)    # taken by another reader while we waited
            if s is None:
                s = await self._take(entry)
            if fresh:
                s.opened = True
            return self._bind(entry, pid, s)

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
        if len(self.snapshots) >= MAX_SNAPSHOTS and not self._release_idlest():
            log.warning("engine %s: %d snapshots are being read; refusing another of %s",
                        self.name, len(self.snapshots), entry.name)
            raise EngineRefused(errno.EBUSY, "too many snapshots")
        reply = await self.request("snapshot", session=entry.name)
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

    # -- page bytes --------------------------------------------------------------

    def _batch(self) -> int:
        return max(1, min(self.slots.n // 4, BATCH_BYTES // self.page_bytes, 256))

    async def _gather(self, snap: Snapshot, ixs: list[PageIndex]) -> None:
        """One gather of (at most) the pages *ixs* into claimed slots."""
        if snap.released:
            raise EngineGone(f"snapshot of {snap.session} is gone")
        slots = await self.slots.claim_some(len(ixs))
        ixs = ixs[:len(slots)]
        keys = [(snap.id, ix) for ix in ixs]
        ev = trio.Event()
        for k in keys:
            self.slots.loading[k] = ev
        ok = False
        try:
            await self.request("gather", snap=snap.id, pages=[[ix, s] for ix, s in zip(ixs, slots)])
            ok = True
        finally:
            for k in keys:
                self.slots.loading.pop(k, None)
            if ok:
                self.slots.loaded(slots, keys)
            else:
                self.slots.unclaim(slots)
            ev.set()

    async def _ensure(self, snap: Snapshot, ixs: list[PageIndex], extra: list[PageIndex] = ()) -> None:
        """Pages *ixs* are READY when this returns (with *extra* gathered alongside if missing)."""
        slots = self.slots
        while True:
            missing, waits = [], []
            for ix in ixs:
                key = (snap.id, ix)
                if slots.ready_slot(key) is not None:
                    continue
                ev = slots.loading.get(key)
                if ev is not None:
                    waits.append(ev)
                else:
                    missing.append(ix)
            if missing:
                more = [ix for ix in extra if (snap.id, ix) not in slots.slot_of
                        and (snap.id, ix) not in slots.loading]
                await self._gather(snap, missing + more)
            elif waits:
                await waits[0].wait()
            else:
                return

    async def _hold(self, snap: Snapshot, ixs: list[PageIndex]) -> list[int]:
        await self._ensure(snap, ixs)
        held = [self.slots.ready_slot((snap.id, ix)) for ix in ixs]
        for s in held:
            self.slots.hold(s)
        return held

    async def _hash(self, ixs: list[PageIndex], held: list[int], out: list) -> None:
        pb, shm = self.page_bytes, self.shm

        def work() -> list[Digest]:
            view = memoryview(shm)
            try:
                return [digest_of(view[s * pb:(s + 1) * pb]) for s in held]
            finally:
                view.release()
        try:
            got = await trio.to_thread.run_sync(work, limiter=self.registry.hash_limiter)
            for ix, d in zip(ixs, got):
                out[ix] = d
        finally:
            for s in held:
                self.slots.unhold(s)

    async def _digests(self, snap: Snapshot) -> list[Digest]:
        """Gather every page of a snapshot once and hash it (hashing batch j while gathering j+1)."""
        n, b = snap.n_pages, self._batch()
        out: list = [None] * n
        prev = None
        try:
            for a in range(0, n, b):
                ixs = list(range(a, min(n, a + b)))
                async with trio.open_nursery() as nursery:
                    if prev is not None:
                        nursery.start_soon(self._hash, *prev, out)
                        prev = None
                    held = await self._hold(snap, ixs)
                prev = (ixs, held)
            if prev is not None:
                p, prev = prev, None
                await self._hash(*p, out)
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
        finally:
            if prev is not None:
                for s in prev[1]:
                    self.slots.unhold(s)
        return out

    async def read(self, snap: Snapshot, ix: PageIndex, off: int, size: int) -> bytes:
        """Bytes of page *ix* of a snapshot, from staging (gathered with the next pages if missing)."""
        pb = self.page_bytes
        end = min(pb, off + size)
        if off >= end:
            return b""
        key = (snap.id, ix)
        s = self.slots.ready_slot(key)
        if s is None:
            ahead = max(0, self._batch() - 1)
            await self._ensure(snap, [ix], list(range(ix + 1, min(snap.n_pages, ix + 1 + ahead))))
            s = self.slots.ready_slot(key)
        snap.last_used = time.monotonic()
        if not self.alive:
            raise EngineGone(f"engine {self.name} is gone")
        return self.shm[s * pb + off:s * pb + end]

    # -- page in -------------------------------------------------------------------

    async def page_in(self, entry: SessionEntry) -> list[str]:
        """Hand a complete incoming session to the engine; drop it either way.

        Returns the sequence ids now live; EngineRefused (with the errno the
        closing writer gets) or EngineGone otherwise.
        """
        inc = entry.incoming
        m = inc.manifest
        inc.state = "paging-in"
        try:
            nodes = inc.page_nodes()
            sizes = [n.size for n in nodes]
            data = [n.data for n in nodes]
            fd = await trio.to_thread.run_sync(memfd_with, data, m.page_bytes, inc.manifest_data)
            try:
                reply = await self.request("page_in", timeout=PAGE_IN_TIMEOUT, fds=[fd],
                                           name=entry.name, sizes=sizes, page_bytes=m.page_bytes,
                                           manifest_bytes=len(inc.manifest_data))
            finally:
                os.close(fd)
            self.note_session(entry.name)
            return [str(s) for s in reply.get("seqs", [])]
        finally:
            self.drop_incoming(entry)

    async def save(self, session: str, path: str) -> int:
        """Have the engine page live *session* out as a new session at *path*; its page count."""
        reply = await self.request("save", timeout=PAGE_IN_TIMEOUT, session=session, path=path)
        return int(reply.get("pages", 0))

    async def load(self, name: str, path: str) -> list[str]:
        """Have the engine page the session at *path* in as *name*; the sequence ids now live."""
        reply = await self.request("load", timeout=PAGE_IN_TIMEOUT, name=name, path=path)
        self.note_session(name)
        return [str(s) for s in reply.get("seqs", [])]

    def drop_incoming(self, entry: SessionEntry) -> None:
        """Forget a session being copied in, and the memory it held."""
        inc, entry.incoming = entry.incoming, None
        if inc is not None:
            freed = inc.drop()
            self.incoming_bytes -= freed
            self.registry.incoming_bytes -= freed
