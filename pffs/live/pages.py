"""Page bytes of an engine's snapshots, through the staging slots it shares with the daemon.

A snapshot is taken by the engine between steps: the session's token count
and block list, each block pinned by a reference so it is neither freed nor
reused.  KV of the tokens it covers never changes and slots past them are
zeroed in the page bytes, so its pages read the same bytes for as long as it
lives, while the sequence keeps decoding.  A page is read by having the
engine gather it into a staging slot (:mod:`.slots`: which page sits where)
and reading the slot; pages still in staging when read again are served
from there.  State lives on the trio thread; worker threads hash a slot's
bytes only while it is held.
"""

from __future__ import annotations

import errno
import logging
import mmap
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from pffs import manifest as mf
from pffs.live.errors import EngineError, EngineGone, EngineRefused, unwrap
from pffs.live.link import EngineLink
from pffs.live.registry import LiveRegistry
from pffs.live.slots import SlotCache
from pffs.namespace import BlobRow
from pffs.types import Digest, PageIndex, digest_of, is_digest

T = TypeVar("T")

if sys.version_info < (3, 11):  # a builtin from 3.11; trio brings the backport before it
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("pffs.live")

BATCH_BYTES = 8 << 20       # pages per gather (digest pass, read-ahead)


@dataclass(eq=False)
class Snapshot:
    """A pinned view of a live session (pffs.live.engines.LiveEngine.snapshot_for)."""

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
    # Pages stored as blobs for copies out of it (pffs.live.copyout.CopyOut): page
    # index -> its blob's row; storing[ix] is set once tried.
    blobs: dict[int, BlobRow] = field(default_factory=dict)
    storing: dict[int, trio.Event] = field(default_factory=dict)


class EnginePages:
    """The pages of one engine's snapshots: gathered into its staging slots, read
    from there, hashed, or stored in the mount's store by the engine itself."""

    def __init__(self, link: EngineLink, shm: mmap.mmap, slots: int, page_bytes: int,
                 registry: LiveRegistry[Any, Any], nursery: trio.Nursery, *, stores: bool):
        self.link = link
        self.shm = shm
        self.slots = SlotCache(slots)
        self.page_bytes = page_bytes
        self.registry = registry            # (its counts and hash limiter)
        self.nursery = nursery              # (gathers ahead: the engine socket's)
        #: the engine stores a snapshot's pages in the mount's store itself
        #: (store_pages), until it says it cannot
        self.stores = stores

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
        if snap.released or not self.link.alive:
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
                log.debug("engine %s: pages gathered ahead of a copy: %s", self.link.name, e)
        self.nursery.start_soon(run)

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
            await self.link.request("gather", snap=snap.id, pages=[[ix, s] for ix, s in zip(ixs, slots)])
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
            reply = await self.link.request("store", snap=snap.id, pages=ixs)
        except EngineRefused as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self.stores = False
                log.info("%r stores no pages itself (%s): the daemon stores them", self.link, e)
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
            log.error("%r answered a store with rows it cannot have: %s", self.link, e)
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

    async def digests(self, snap: Snapshot) -> list[Digest]:
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
        if not self.link.alive:
            raise EngineGone(f"engine {self.link.name} is gone")
        return self.shm[s * pb + off:s * pb + end]

