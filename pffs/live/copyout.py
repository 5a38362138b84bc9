"""Copies out of ``MNT/engines/``: live pages stored as blobs of the mount's store ahead of the copy.

``cp -r engines/E/S DST`` copies S's pages one file at a time (pages/
first, in inode order: pffs.live.numbering) and manifest.json last.  Each
page a copy asks for, and COPY_AHEAD after it, is stored as a blob while
cp moves on, by STORE_AT_ONCE tasks taking the pages in the order the copy
asks for them; the copy then names the blob (copy_file_range, no byte
moved), and manifest.json lists the digests without hashing a page again.
Where the engine can reach the store (``EnginePages.stores``) it stores
the pages itself, in batches, and the daemon adopts the blobs.
"""

from __future__ import annotations

import collections
import functools
import logging

import trio

from pffs.live.errors import EngineRefused
from pffs.live.handles import Handle, LiveStore
from pffs.live.pages import EnginePages, Snapshot
from pffs.namespace import BlobRow
from pffs.types import PageIndex

log = logging.getLogger("pffs.live")

# Pages of a live snapshot stored as blobs ahead of a copy out of it (page_blob),
# and how many are read and stored at once (each holds a page in memory).
COPY_AHEAD = 16
STORE_AT_ONCE = 4
# Where the engine stores the pages itself: pages a request (queued in whole batches), and
# requests at once (the engine's threads take both's pages: none waits between the two).
ENGINE_STORE_BATCH = 8
ENGINE_STORES_AT_ONCE = 2


class CopyOut:
    """Pages of live snapshots stored ahead of the copies out of them."""

    def __init__(self, store: LiveStore, counts: dict[str, int], nursery: trio.Nursery):
        self.store = store
        self.counts = counts            # (LiveRegistry.counts: pages_stored)
        self.nursery = nursery          # (the daemon's: the tasks storing pages run there)
        # Pages queued to be stored (_store_ahead), and the tasks storing them.
        self._store_queue: collections.deque[tuple[EnginePages, Snapshot, int]] = collections.deque()
        self._store_runners = 0

    async def page_blob(self, h: Handle) -> tuple[str, int, BlobRow] | None:
        """copy_file_range out of a live session (cp -r of it): for a page, the
        page stored as a blob of the mount's store, for the copy to name (None
        where that failed: the bytes are copied).  COPY_AHEAD pages ahead are
        stored meanwhile (every page once its manifest.json is copied), in
        parallel though cp copies one file at a time.  cp copies pages/ first
        (inode order): manifest.json, copied last, lists their digests."""
        snap = h.snap
        if h.kind not in ("page", "manifest") or snap is None or snap.released:
            return None
        pages = h.entry.engine.pages
        if h.kind == "manifest":
            self._store_ahead(pages, snap, range(snap.n_pages))
            return None     # (its bytes are copied, and checked where they land)
        # Whole batches where the engine stores them (else a request a page, once cp moved on)
        b = ENGINE_STORE_BATCH if self._engine_stores_them(pages) else 1
        self._store_ahead(pages, snap, range(h.ix, min(snap.n_pages, -(-(h.ix + COPY_AHEAD) // b) * b)))
        await snap.storing[h.ix].wait()
        row = snap.blobs.get(h.ix)
        return None if row is None else (row.digest, row.raw_size, row)

    def _engine_stores_them(self, pages: EnginePages) -> bool:
        """Whether the engine stores these pages itself (and the daemon adopts them)."""
        return self.store.adopt_blobs is not None and pages.stores

    def _store_ahead(self, pages: EnginePages, snap: Snapshot, ixs: range) -> None:
        """Queue pages *ixs* to be stored, in order: tasks take them first come
        first served, so the page a copy asks for next is among the first
        stored (a task a page stored them from the last page back)."""
        for j in ixs:
            if j not in snap.storing:
                snap.storing[j] = trio.Event()
                self._store_queue.append((pages, snap, j))
        at_once = ENGINE_STORES_AT_ONCE if self._engine_stores_them(pages) else STORE_AT_ONCE
        while self._store_runners < min(at_once, len(self._store_queue)):
            self._store_runners += 1
            self.nursery.start_soon(self._store_runner)

    async def _store_runner(self) -> None:
        try:
            while self._store_queue:
                pages, snap, ix = self._store_queue.popleft()
                if self._engine_stores_them(pages):
                    ixs = [ix]
                    while self._store_queue and len(ixs) < ENGINE_STORE_BATCH \
                            and self._store_queue[0][1] is snap:
                        ixs.append(self._store_queue.popleft()[2])
                    await self._engine_stores(pages, snap, ixs)
                else:
                    await self._store_page(pages, snap, ix, snap.storing[ix])
        finally:
            self._store_runners -= 1

    async def _engine_stores(self, pages: EnginePages, snap: Snapshot, ixs: list[int]) -> None:
        """Pages *ixs* stored by the engine itself, straight into the store as its
        page-out writes them (gathered, hashed and compressed on its threads, no
        byte through staging or this process), then adopted; stored here from
        staging instead where the engine cannot reach the store."""
        assert self.store.adopt_blobs is not None
        left = set(ixs)
        try:
            rows = await pages.store_pages(snap, [PageIndex(ix) for ix in ixs])
            await self.store.adopt_blobs([row.digest for _, row in rows])
            for j, row in rows:
                snap.blobs[j] = row
                self.counts["pages_stored"] += 1
                snap.storing[j].set()
                left.discard(j)
        except EngineRefused as e:
            if not pages.stores:      # (it cannot reach the store: this process stores them)
                for k in ixs:
                    left.discard(k)
                    await self._store_page(pages, snap, k, snap.storing[k])
            else:
                log.debug("engines/%s/%s: pages not stored ahead of their copy: %s", pages.link.name,
                          snap.session, e)
        except Exception as e:  # (the engine went, the store is full): the copies move the bytes
            log.debug("engines/%s/%s: pages not stored ahead of their copy: %s", pages.link.name,
                      snap.session, e)
        finally:
            for k in left:
                snap.storing[k].set()

    async def _store_page(self, pages: EnginePages, snap: Snapshot, ix: int, done: trio.Event) -> None:
        try:
            # Hashed and compressed where the engine gathered it (no copy); not
            # hashed again where manifest.json listed it already (a snapshot's
            # pages read the same bytes for as long as it lives).  The pages
            # queued next are gathered with it, a batch a request to the engine.
            digest = snap.skeleton.pages[ix] if snap.manifest is not None and snap.skeleton else None
            # The batch after is asked for meanwhile, so that it is in staging
            # when its turn comes (else every store waits on each batch's gather).
            b = pages.gather_batch()
            ahead = [PageIndex(j) for j in range(ix + 1, min(snap.n_pages, ix + 2 * b))
                     if j in snap.storing and j not in snap.blobs]
            pages.gather_soon(snap, [PageIndex(ix), *ahead[:b - 1]])
            pages.gather_soon(snap, ahead[b - 1:])
            snap.blobs[ix] = await pages.with_page(
                snap, PageIndex(ix), functools.partial(self.store.store_blob, digest=digest), ahead[:b - 1])
            self.counts["pages_stored"] += 1
        except Exception as e:  # (the engine went, the store is full): the copy moves the bytes, and says why
            log.debug("engines/%s/%s: page %d not stored ahead of its copy: %s", pages.link.name,
                      snap.session, ix, e)
        finally:
            done.set()
