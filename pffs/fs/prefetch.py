"""Reading ahead of sequential readers: which files a reader opens next, and
their blobs fetched and decoded on worker threads before it asks.

Page files are read in page order (page-in, shell globs, rsync) or in the
order the directory was listed (cp -r, tar); the committed content of the
files ahead is read from the namespace in one query per window, which the
reads then use too while the namespace has not changed.  On the trio thread.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import outcome

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.fs.blobcache import BlobReader
from pffs.fs.db import Database
from pffs.fs.workers import WorkerPool

PREFETCH_PAGES = 16  # files fetched ahead of a sequential reader: refilled half at a time
ALONE_FROM = 512 << 10  # blobs of this many bytes and more are fetched one a job (see Prefetch)
PREFETCH_WINDOW = 64   # page files whose content one query reads (see PageWindow)
LISTINGS_KEPT = 8           # directories whose listing order is remembered (see Listing)
LISTING_MAX = 1 << 16       # entries remembered of one listing (about 100 bytes each)


@dataclass
class PageWindow:
    """The committed content of a run of page files of one directory, read in
    one query at one namespace generation (``Database.generation``): the opens
    of a sequential reader (cp, tar, page-in) then need no query of their own
    to prefetch, nor their first read to find the blocks."""
    gen: int
    first: int                                   # page indexes [first, end) asked for
    end: int
    # page index -> (blobs, raw sizes; None where a blob's row is gone)
    pages: dict[int, tuple[list[str], list[int | None]]]
    files: dict[int, tuple[int, list[str]]]      # inode -> (size, blobs)


@dataclass
class Listing:
    """The order in which readdir listed a directory's entries: the order in
    which cp -r, tar and find-style readers open its files."""
    inos: list[int] = field(default_factory=list)
    pos: dict[int, int] = field(default_factory=dict)      # inode -> index in inos


@dataclass
class FileWindow:
    """The committed content of the files that follow one in a directory's
    listing, read in one query at one namespace generation."""
    gen: int
    first: int                                   # listing positions [first, end) asked for
    end: int
    files: dict[int, tuple[int, list[str], list[int | None]]]  # inode -> (size, blobs, raw sizes)


class Prefetch:
    def __init__(self, db: Database, reader: BlobReader):
        self.db = db
        self.reader = reader
        self.content = reader.content
        self.cache = reader.cache
        self._prefetched: dict[int, int] = {}  # directory inode -> last page index prefetched
        self._windows: dict[int, PageWindow] = {}  # directory inode -> pages around the reader
        # Readers that follow a directory's listing rather than its page order
        # (cp -r or tar of a session whose files were created out of order).
        self._listings: dict[int, Listing] = {}      # directory inode -> its last listing
        self._fwindows: dict[int, FileWindow] = {}   # directory inode -> files after the reader
        self._lprefetched: dict[int, int] = {}       # directory inode -> last position prefetched
        self._last_open: dict[int, int] = {}         # directory inode -> inode opened last
        # Where the kernel found each inode it holds (from lookups and readdir):
        # spares a query per open when deciding what to prefetch.
        self.where: dict[int, tuple[int, bytes]] = {}
        # Threads that fetch and decode blobs ahead of readers: a queue and one
        # callback a job, cheaper than a trio task and trio.to_thread each.
        self.workers = WorkerPool(max(1, (os.cpu_count() or 2)), "pffs-prefetch")
        # A small local blob is read and decoded in well under a millisecond,
        # so a refill's small blobs go as one job with one answer (waking the
        # loop once a blob costs more than it saves: docs/performance.md).  A
        # remote blob waits on the network, and a large one (a 2 MiB page:
        # 1.5 ms) would keep the reader waiting for the blobs batched with it:
        # one job each, answered at once.
        self._in_batches = not self.content.blobs.remote

    def stop(self) -> None:
        self.workers.stop()

    def forgot(self, ino: int) -> None:
        self.where.pop(ino, None)

    def listing(self, parent: int, start_id: int) -> Listing:
        """The listing a readdir of *parent* from *start_id* adds its entries to."""
        listing = self._listings.get(parent)
        if start_id == 0 or listing is None:
            if len(self._listings) >= LISTINGS_KEPT:
                self._listings.pop(next(iter(self._listings)))
            listing = self._listings[parent] = Listing()
        return listing

    def after_open(self, ino: int) -> None:
        """Opening a file: decode the files a sequential reader opens next in the background.

        Sequential readers (cp, rsync, tar, cat, page-in) then find them
        decoded in the cache, and decoding runs on the other cores.  Page
        files are read in page order (page-in, shell globs, rsync) or in the
        order the directory was listed (cp -r, tar): whichever the previous
        open in the same directory followed, the listing on a first open.
        """
        row = self.where.get(ino)
        if row is None:
            row = ns.first_entry(self.db.ro, ino)
            if row is None:
                return
        parent = row[0]
        ix = mf.parse_page_name(row[1])
        prev = self._last_open.get(parent)
        if len(self._last_open) > 1024:
            self._last_open.clear()
        self._last_open[parent] = ino
        listing = self._listings.get(parent)
        at = listing.pos.get(ino) if listing is not None else None
        if listing is not None and at is not None:
            if at > 0 and listing.inos[at - 1] == prev:
                self._prefetch_listed(parent, listing, at)
                return
            if ix is None:
                self._prefetch_listed(parent, listing, at)
                return
            # A first open: the listing, unless it names the pages in order anyway.
            if (prev is None or prev == ino) and at + 1 < len(listing.inos) \
                    and self.where.get(listing.inos[at + 1], (0, b""))[1] != mf.page_name(ix + 1).encode():
                self._prefetch_listed(parent, listing, at)
                return
        if ix is None:
            return
        w = self._window(parent, ix, ix + PREFETCH_PAGES + 1)
        self._prefetch_run(self._prefetched, parent, ix, w.pages.get)

    def _prefetch_listed(self, parent: int, listing: Listing, at: int) -> None:
        """Decode the files listed after position *at* of *parent* in the background."""
        w = self._file_window(parent, listing, at, at + PREFETCH_PAGES + 1)

        def content(j):
            if j >= len(listing.inos):
                return None
            f = w.files.get(listing.inos[j])
            return ((), ()) if f is None else (f[1], f[2])  # (None: a directory, or gone)
        self._prefetch_run(self._lprefetched, parent, at, content)

    def _prefetch_run(self, marks: dict[int, int], parent: int, at: int, content) -> None:
        """Prefetch the files at positions at+1 .. at+PREFETCH_PAGES of *parent*
        (``content(j)``: their blobs and sizes, None past the end), from where
        the previous call for this directory stopped (``marks``), once no more
        than half of them are on their way: a refill is a batch of blobs."""
        budget = self.cache.limit // 4
        mark = marks.get(parent, -1)
        if mark > at + PREFETCH_PAGES or mark < at:
            mark = at
        elif mark - at > PREFETCH_PAGES // 2:
            return  # enough on its way: refill once half of it is read
        if len(marks) > 1024:
            marks.clear()
        batch: list[str] = []
        alone: list[str] = []
        for j in range(mark + 1, at + PREFETCH_PAGES + 1):
            blobs = content(j)
            if blobs is None:
                break
            marks[parent] = j
            left = self._prefetch_blobs(blobs[0], blobs[1], budget, batch, alone)
            if left is None:
                break
            budget = left
        if not self._in_batches:
            alone, batch = alone + batch, []
        for d in alone:
            self.workers.submit(functools.partial(self.reader.prefetched, d), self.content.get, d)
        self.reader.prefetch_jobs += len(alone)
        if batch:
            # One job per prefetch thread, so a refill decodes on every core.
            k = max(1, min(self.workers.size, len(batch)))
            self.reader.prefetch_jobs += k
            for part in (batch[i::k] for i in range(k)):
                self.workers.submit(functools.partial(self._prefetched_all, part),
                                       self._fetch_all, part)

    def _prefetch_blobs(self, digests, sizes, budget: int, batch: list[str],
                        alone: list[str]) -> int | None:
        """Add to *batch* (small ones) or *alone* (ALONE_FROM bytes or more) the
        blobs neither cached nor on their way (marked as on their way); the
        budget left, or None once it is spent."""
        for d, size in zip(digests, sizes):
            size = size or 0   # (a blob row gone: the read will say why)
            if size > budget and d not in self.reader.loading \
                    and self.cache.get(d, count=False) is None:
                return None
            if self.reader.wanted(d):
                budget -= size
                (alone if size >= ALONE_FROM else batch).append(d)
        return budget

    def _fetch_all(self, digests: list[str]) -> list[tuple[str, outcome.Outcome]]:
        """In a prefetch thread: each blob of a refill, or why it could not be had."""
        return [(d, outcome.capture(self.content.get, d)) for d in digests]

    def _prefetched_all(self, digests: list[str], fetched: outcome.Outcome) -> None:
        """On the trio thread: the blobs of a refill (see BlobReader.prefetched)."""
        each = fetched.value if isinstance(fetched, outcome.Value) else [(d, fetched) for d in digests]
        for d, one in each:
            self.reader.prefetched(d, one)

    def _file_window(self, parent: int, listing: Listing, first: int, end: int) -> FileWindow:
        """Committed content of the files at listing positions [first, end) (and more)."""
        gen = self.db.generation  # before the query: a commit meanwhile makes it stale
        w = self._covering(self._fwindows, parent, first, end)
        if w is not None:
            return w
        end = min(max(end, first + PREFETCH_WINDOW), len(listing.inos))
        inos = listing.inos[first:end]
        w = FileWindow(gen, first, end, {})
        if not inos:
            return w
        for ino, size, blob, raw in ns.files_content(self.db.ro, inos):
            f = w.files.get(ino)
            if f is None:
                f = w.files[ino] = (size, [], [])
            if blob is not None:
                f[1].append(blob)
                f[2].append(raw)
        return self._keep(self._fwindows, parent, w)

    @staticmethod
    def _covering(windows: dict, parent: int, first: int, end: int):
        """The window of *parent* kept in *windows* if it covers [first, end).

        Prefetching takes it even after later commits: what it names is only
        a hint there (a file changed since has its blobs fetched by its own
        read), and a window read again at every open while another file is
        being written (cp -r within the mount) would keep the loop busy
        (docs/performance.md).  Reads take a window only at the current
        generation (``committed``)."""
        w = windows.get(parent)
        if w is not None and w.first <= first and end <= w.end:
            return w
        return None

    @staticmethod
    def _keep(windows: dict, parent: int, w):
        if len(windows) > 1024:
            windows.clear()
        windows[parent] = w
        return w

    def _window(self, parent: int, first: int, end: int) -> PageWindow:
        """Pages [first, end) of directory *parent* (and more after them), committed content."""
        gen = self.db.generation  # before the query: a commit meanwhile makes it stale
        w = self._covering(self._windows, parent, first, end)
        if w is not None:
            return w
        end = max(end, first + PREFETCH_WINDOW)
        names = [mf.page_name(i).encode() for i in range(first, end)]
        w = PageWindow(gen, first, end, {}, {})
        for name, ino, size, blob, raw in ns.named_files_content(self.db.ro, parent, names):
            ix = mf.parse_page_name(name)
            if ix is None:
                continue        # (never: each name asked for is a page's)
            f = w.files.get(ino)
            if f is None:
                f = w.files[ino] = (size, [])
            page = w.pages.setdefault(ix, ([], []))
            if blob is not None:
                f[1].append(blob)
                page[0].append(blob)
                page[1].append(raw)
        return self._keep(self._windows, parent, w)

    def committed(self, ino: int) -> tuple[int, list[str]]:
        """(size, blobs by block number) of what is committed for *ino*."""
        where = self.where.get(ino)
        if where is not None:
            w = self._windows.get(where[0])
            if w is not None and w.gen == self.db.generation:
                f = w.files.get(ino)
                if f is not None:
                    return f
            fw = self._fwindows.get(where[0])
            if fw is not None and fw.gen == self.db.generation:
                g = fw.files.get(ino)
                if g is not None:
                    return g[0], g[1]
        return ns.size_of(self.db.ro, ino), ns.blocks_of(self.db.ro, ino)
