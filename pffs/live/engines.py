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
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from pffs.live.channel import TrioChannel
from pffs.live.errors import EngineError, EngineGone, EngineRefused, unwrap
from pffs.live.incoming import memfd_with
from pffs.live.listings import EngineSessions, SessionEntry, Snapshot
from pffs.live.protocol import ProtocolError
from pffs.live.registry import LiveRegistry, Registration
from pffs.live.slots import SlotCache
from pffs.namespace import BlobRow
from pffs.types import Digest, PageIndex, digest_of, is_digest

T = TypeVar("T")

if sys.version_info < (3, 11):  # a builtin from 3.11; trio brings the backport before it
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("pffs.live")

REQUEST_TIMEOUT = 30.0      # an engine that does not answer a read in this long: EIO
PAGE_IN_TIMEOUT = 600.0
BATCH_BYTES = 8 << 20       # pages per gather (digest pass, read-ahead)


class _Pending:
    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: dict[str, Any] | None = None


class LiveEngine(EngineSessions):
    def __init__(self, registry: Registry, reg: Registration, chan: TrioChannel,
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
        self._warm: list[str] = []    # blobs to tell the engine of (warm)
        # The engine stores a snapshot's pages in the mount's store itself
        # (store_pages), until it says it cannot.
        self.stores = bool(reg.info.get("stores"))

    def __repr__(self) -> str:
        return f"engine {self.name!r} (pid {self.reg.pid})"

    def entry(self, name: str) -> SessionEntry:
        """The entry of session *name* in the engine folder, made if it has none yet."""
        e = self.entries.get(name)
        if e is None:
            e = SessionEntry(self, name, 0)
            e.key = self.registry.new_key(e)
            self.entries[name] = e
        return e

    # -- requests ----------------------------------------------------------

    async def request(self, op: str, *, timeout: float = REQUEST_TIMEOUT, fds: Sequence[int] = (),
                      **args: Any) -> dict[str, Any]:
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
                    await self.chan.send({"op": "warm", "mount": self.registry.mountpoint, "blobs": blobs})
                except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                del self._warm[:len(blobs)]
            self._warm.clear()
        self.registry.spawn(send)

    def _spawn_release(self, snap_id: int) -> None:
        async def send() -> None:
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
                    nursery.start_soon(self._watch_pid, self._pidfd, nursery.cancel_scope)
                why, clean = await self._read_replies()
                nursery.cancel_scope.cancel()
            if self._exited:
                why, clean = "the process exited", False
        finally:
            self.detach(why, clean)

    _exited = False

    async def _watch_pid(self, pidfd: int, scope: trio.CancelScope) -> None:
        # The pidfd turns readable when the process exits: no waiting for a
        # socket another process may have inherited.
        await trio.lowlevel.wait_readable(pidfd)
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
            self.registry.changed(self.name, False)
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

    # -- page bytes --------------------------------------------------------------

    def gather_batch(self) -> int:
        """Pages one gather asks the engine for (digest pass, read-ahead, store-ahead)."""
        return max(1, min(self.slots.n // 4, BATCH_BYTES // self.page_bytes, 256))

    async def _gather(self, snap: Snapshot, ixs: list[PageIndex]) -> None:
        """One gather of (at most) the pages *ixs* into claimed slots."""
        if snap.released:
            raise EngineGone(f"snapshot of {snap.session} is gone")
        slots = await self.slots.claim_some(len(ixs))
        await self._gather_into(snap, ixs[:len(slots)], slots)

    def gather_soon(self, snap: Snapshot, ixs: Sequence[PageIndex]) -> None:
        """Have those of pages *ixs* neither in staging nor on their way gathered
        in the background, into slots free now (none waited for): the pages a
        copy out of the snapshot stores next are then in staging when their
        turn comes, instead of each batch's gather keeping every store waiting."""
        if snap.released or not self.alive:
            return
        todo = [ix for ix in ixs
                if (snap.id, ix) not in self.slots.slot_of and (snap.id, ix) not in self.slots.loading]
        slots = self.slots.claim(len(todo)) if todo else []
        if not slots:
            return
        # (claimed and marked loading before anything else runs: no page is gathered twice)
        gathering = self._gather_into(snap, todo[:len(slots)], slots)

        async def run() -> None:
            try:
                await gathering
            except Exception as e:  # (the engine went, the snapshot was released): gathered when asked
                log.debug("engine %s: pages gathered ahead of a copy: %s", self.name, e)
        self.registry.spawn(run)

    def _gather_into(self, snap: Snapshot, ixs: list[PageIndex], slots: list[int]) -> Awaitable[None]:
        """Mark pages *ixs* loading into claimed *slots*; the awaitable gathers them."""
        keys = [(snap.id, ix) for ix in ixs]
        ev = trio.Event()
        for k in keys:
            self.slots.loading[k] = ev
        return self._fill(snap, ixs, slots, keys, ev)

    async def _fill(self, snap: Snapshot, ixs: list[PageIndex], slots: list[int], keys: list, ev: trio.Event
                    ) -> None:
        ok = False
        try:
            await self.request("gather", snap=snap.id, pages=[[ix, s] for ix, s in zip(ixs, slots)])
            ok = True
            self.registry.counts["pages_gathered"] += len(ixs)
        finally:
            for k in keys:
                self.slots.loading.pop(k, None)
            if ok:
                self.slots.loaded(slots, keys)
            else:
                self.slots.unclaim(slots)
            ev.set()

    async def _ensure(self, snap: Snapshot, ixs: list[PageIndex], extra: Sequence[PageIndex] = ()) -> None:
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

    async def _hold(self, snap: Snapshot, ixs: list[PageIndex], extra: Sequence[PageIndex] = ()) -> list[int]:
        await self._ensure(snap, ixs, extra)
        held = []
        for ix in ixs:
            s = self.slots.ready_slot((snap.id, ix))
            assert s is not None    # _ensure() made every one READY, and nothing ran since
            held.append(s)
        for s in held:
            self.slots.hold(s)
        return held

    async def with_page(self, snap: Snapshot, ix: PageIndex, fn: Callable[[memoryview], Awaitable[T]],
                        ahead: Sequence[PageIndex] = ()) -> T:
        """``await fn(view)`` with page *ix* of a snapshot held in staging: *view*
        is its bytes in the shared memory, no copy, valid until fn returns.
        Pages *ahead* (those to come next) are gathered alongside when page *ix*
        must be: one request to the engine for several pages."""
        (s,) = await self._hold(snap, [ix], ahead)
        pb = self.page_bytes
        view = memoryview(self.shm)[s * pb:(s + 1) * pb]
        try:
            return await fn(view)
        finally:
            view.release()
            self.slots.unhold(s)

    async def store_pages(self, snap: Snapshot, ixs: list[PageIndex]) -> list[tuple[PageIndex, BlobRow]]:
        """Have the engine store pages *ixs* of a snapshot in the mount's store
        as blobs itself, as its page-out does (gathered, hashed, compressed
        and written on its own threads, no byte through the daemon): each
        page's blob row, for the daemon to adopt.  EngineRefused (and
        ``stores`` False from then on) where the engine cannot reach the store."""
        if snap.released:
            raise EngineGone(f"snapshot of {snap.session} is gone")
        self.registry.counts["store_requests"] += 1
        try:
            reply = await self.request("store", snap=snap.id, pages=ixs)
        except EngineRefused as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self.stores = False
                log.info("%r stores no pages itself (%s): the daemon stores them", self, e)
            raise
        out = []
        try:
            rows = reply["rows"]
            if len(rows) != len(ixs):
                raise ValueError(f"{len(rows)} rows for {len(ixs)} pages")
            for want, (ix, digest, raw, stored, codec) in zip(ixs, rows):
                if ix != want or not is_digest(digest) or raw != self.page_bytes or \
                        not isinstance(stored, int) or stored <= 0 or not isinstance(codec, str):
                    raise ValueError(f"row {[ix, digest, raw, stored, codec]!r} for page {want}")
                out.append((PageIndex(ix), BlobRow(digest, raw, stored, codec)))
        except (KeyError, TypeError, ValueError) as e:
            log.error("%r answered a store with rows it cannot have: %s", self, e)
            self.stores = False
            raise EngineError("invalid answer from the engine") from None
        self.registry.counts["pages_stored_by_engine"] += len(out)
        return out

    async def _hash(self, ixs: list[PageIndex], held: list[int], out: list) -> None:
        """Hash the held pages *ixs* into *out*, on as many threads as the
        hash limiter allows (a batch is a few pages; one thread hashed 1.5 GB/s
        where two cores can do twice that), then let go of them."""
        pb, shm = self.page_bytes, self.shm

        def work(part: range) -> None:
            view = memoryview(shm)
            try:
                for k in part:
                    out[ixs[k]] = digest_of(view[held[k] * pb:(held[k] + 1) * pb])
            finally:
                view.release()

        lim = self.registry.hash_limiter
        self.registry.counts["pages_hashed"] += len(ixs)
        n, ways = len(ixs), max(1, min(len(ixs), int(lim.total_tokens)))

        async def one(part: range) -> None:
            await trio.to_thread.run_sync(work, part, limiter=lim)
        try:
            async with trio.open_nursery() as nursery:
                for w in range(ways):
                    nursery.start_soon(one, range(w * n // ways, (w + 1) * n // ways))
        finally:
            for s in held:
                self.slots.unhold(s)

    async def _digests(self, snap: Snapshot) -> list[Digest]:
        """Gather every page of a snapshot once and hash it (hashing batch j
        while gathering j+1), but for pages already stored for a copy out of
        it (``snap.blobs``, hashed as they were stored): their blobs' names."""
        for ev in [ev for ix, ev in snap.storing.items() if ix not in snap.blobs]:
            await ev.wait()     # (being stored now: named in a moment)
        n, b = snap.n_pages, self.gather_batch()
        out: list = [None] * n
        for ix, row in snap.blobs.items():
            out[ix] = Digest(row.digest)
        todo = [PageIndex(ix) for ix in range(n) if out[ix] is None]
        prev: tuple[list[PageIndex], list[int]] | None = None
        try:
            for a in range(0, len(todo), b):
                ixs = todo[a:a + b]
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
            ahead = max(0, self.gather_batch() - 1)
            more = [PageIndex(j) for j in range(ix + 1, min(snap.n_pages, ix + 1 + ahead))]
            await self._ensure(snap, [ix], more)
            s = self.slots.ready_slot(key)
            assert s is not None    # _ensure() made it READY, and nothing ran since
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
                reply = await self.request("page_in", timeout=PAGE_IN_TIMEOUT, fds=[fd],
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
            reply = await self.request("load_blobs", timeout=PAGE_IN_TIMEOUT, fds=[fd],
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
        reply = await self.request("save", timeout=PAGE_IN_TIMEOUT, session=session, path=path)
        return int(reply.get("pages", 0))

    async def load(self, name: str, path: str) -> list[str]:
        """Have the engine page the session at *path* in as *name*; the sequence ids now live."""
        reply = await self.request("load", timeout=PAGE_IN_TIMEOUT, name=name, path=path)
        self.note_session(name)
        return [str(s) for s in reply.get("seqs", [])]

    def drop_incoming(self, entry: SessionEntry, taken: bool = False) -> None:
        """Forget a session being copied in, and the memory it held; *taken*:
        the engine has it (its files' inodes then name the live session's)."""
        inc, entry.incoming = entry.incoming, None
        if inc is not None:
            entry.taken = inc.live_names() if taken else {}
            self.registry.incoming_gone(self.key, entry.key, entry.name, list(inc.root.children))
            freed = inc.drop()
            self.incoming_bytes -= freed
            self.registry.incoming_bytes -= freed


#: The registry of live engines, typed with what it holds.
Registry = LiveRegistry[LiveEngine, SessionEntry]
