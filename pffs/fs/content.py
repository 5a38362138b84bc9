"""Where file bytes become blobs: hashing, compressing and storing staged content.

All of it runs in worker threads bounded by ``limiter`` (hashlib, zstd and
numpy release the GIL), never on the event loop.  Blobs are fsynced in
groups: by the commit itself with ``sync_on_close``, else by the daemon's
syncer within ``SYNC_INTERVAL`` and by every fsync(), always before the WAL
fsync that makes the namespace rows naming them durable against power loss.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import pyfuse3
import trio

from pffs import codec as codec_mod
from pffs import manifest as mf
from pffs import namespace as ns
from pffs.errors import StoreFull
from pffs.fs.db import Database
from pffs.fs.workers import WorkerPool
from pffs.fs.write_stage import Staging
from pffs.namespace import BLOCK_SIZE, EMPTY_DIGEST, AcceptedManifest, BlobRow, StoredContent
from pffs.store.base import BlobBatch, BlobStore
from pffs.store.local import PutBatch
from pffs.store.storedir import GcLock
from pffs.types import Digest, digest_of

# Blocks compressed beside their hashing (see ContentStore._hash_and_put):
# page-sized ones; smaller ones are not worth the hand-off, and large blocks
# keep to the block budget's one buffer each.
SPECULATE_MIN = 64 << 10
SPECULATE_MAX = 8 << 20


class StoredBytes:
    """Bytes of the blobs the store holds, for max_size: added to by commit
    threads (and by the adoption of blobs a client put itself), set by a
    recount from the namespace (gc frees behind the daemon's back); always
    under one lock."""

    def __init__(self, n: int = 0):
        self.value = n
        self._added = 0        # bytes add() has counted since the start
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """*nbytes* more blob bytes stored (from any thread)."""
        with self._lock:
            self.value += nbytes
            self._added += nbytes

    def recounted(self, recount: Callable[[], int]) -> int:
        """Set the count from *recount()* (the namespace's sum; from a worker thread).

        Bytes added while it counted are kept on top: their rows may not be
        committed yet, and a count lost would let writes past max_size (one
        counted twice only says no a little early, until the next recount).
        """
        with self._lock:
            before = self._added
        total = recount()
        with self._lock:
            self.value = total + (self._added - before)
            return self.value


class BlockBudget:
    """Bytes of large blocks that worker threads decode, hash or encode at once.

    Each such job holds a few buffers of its block's size (the bytes, the
    planes, the frame), so four at once (two commits, two write-behinds, reads)
    would hold over a gigabyte for 64 MiB blocks.  A job on a block of
    LARGE_BLOCK bytes or more waits here until the blocks in work leave room
    for its own (one alone always goes); smaller ones (page files) never wait.
    """

    LARGE_BLOCK = 8 << 20

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int):
        if n < self.LARGE_BLOCK:
            yield
            return
        with self._cv:
            while self.used and self.used + n > self.limit:
                self._cv.wait()
            self.used += n
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cv:
                self.used -= n
                self._cv.notify_all()


class ContentStore:
    """The blobs of the files of one namespace (*db*; None: blobs only, as some
    tests make them, with nothing recounted nor accepted from a namespace)."""

    def __init__(self, blobs: BlobStore, staging_dir: str | os.PathLike, *, db: Database | None = None,
                 threads: int | None = None, max_size: int | None = None,
                 sync_on_close: bool = False, pending: PutBatch | None = None,
                 stored: StoredBytes | None = None, gc_lock: GcLock | None = None,
                 adopt: Callable[[Sequence[str]], Any] | None = None,
                 publisher: Any = None):
        self.blobs = blobs
        self.db = db
        self.staging_dir = Path(staging_dir)
        self.limiter = trio.CapacityLimiter(threads or max(2, os.cpu_count() or 2))
        self.sync_limiter = trio.CapacityLimiter(1)
        # Commits of closed files: hashing, compression, blob writes, the namespace row.
        self.width = threads or max(2, os.cpu_count() or 2)
        self.workers = WorkerPool(self.width, "pffs-commit")
        # Compressions of page-sized blocks beside their commit's hashing.
        self.encoders = ThreadPoolExecutor(self.width, thread_name_prefix="pffs-encode")
        self.max_size = max_size
        # Stored bytes, for max_size (shared with the adoption of blobs a
        # client put itself: pffs.fs.adoption.LocalAdopter).
        self.stored = stored if stored is not None else StoredBytes()
        self._inodes: tuple[int | None, int] | None = None   # (db data_version, inode count) for statfs
        self._zero_digests: dict[int, str] = {}
        # With sync_on_close every commit fsyncs its own blobs before the
        # namespace commit.  Otherwise blobs join ``pending`` and the daemon's
        # syncer (or a user's fsync) makes them durable in groups.
        self.sync_on_close = sync_on_close
        self.pending = pending if pending is not None else PutBatch()
        # The store's gc lock, held shared from a blob's existence check to the
        # commit naming it (see pffs.maint.gc).
        self.gc_lock = gc_lock
        # Files given a stored blob by name (a copy out of engines/): on the
        # event loop, or by a commit thread (name_if_stored_now; in stats.json).
        self.named = {"on_loop": 0, "by_thread": 0}
        # adopt(pages) gives the page digests a manifest lists that the
        # namespace does not know yet a blob row each when the store holds them
        # (a local store: blob files an engine's bridge put beside the mount,
        # pffs.fs.adoption; an S3 store: the bucket's, pffs.bucket.lease), so that forks
        # find them.  From a bucket (``blobs.remote``) a fork's pages are
        # adopted at the manifest's close even for bytes accepted before.
        self.adopt = adopt
        # publisher.publish(space, [(key, digest)]): index entries this mount records,
        # shared with every mount of its bucket (pffs.bucket.shared_index.Publisher,
        # its ``counts`` in stats.json; None: a local store).
        self.publisher = publisher
        self.block_budget = BlockBudget(BLOCK_SIZE)

    def close(self) -> None:
        """Stop the commit and encode threads (a daemon whose start-up failed)."""
        self.workers.stop()
        self.encoders.shutdown()

    async def sync_pending(self) -> None:
        """Make every blob written so far durable (grouped fsyncs)."""
        if len(self.pending):
            await trio.to_thread.run_sync(self.pending.sync, limiter=self.sync_limiter)

    async def store(self, stg: Staging, *, parse_manifest: bool, then=None):
        """Store the staged bytes; then, in the same worker thread, ``then(stored)``.

        Returns (stored, result of then); *then* is skipped for a refused manifest.
        """
        return await self.workers.call(self._store_then, stg, parse_manifest, then)

    def _store_then(self, stg: Staging, parse_manifest: bool, then):
        with self.gc_lock.shared() if self.gc_lock is not None else contextlib.nullcontext():
            stored = self._store_sync(stg, parse_manifest)
            if then is None or stored.manifest_error is not None:
                return stored, None
            m = stored.manifest
            if m is not None and self.adopt is not None \
                    and (self.blobs.remote or not isinstance(m, AcceptedManifest)):
                # (Bytes accepted before on a local store: their pages were adopted then.)
                self.adopt(m.pages)
            done = then(stored)
            if self.publisher is not None and isinstance(m, mf.Manifest):
                # (A manifest parsed here, named now: its keys to every mount of the bucket;
                # bytes accepted before, a fork's, published theirs then.)
                keys = ns.manifest_keys(m)
                if keys is not None:
                    self.publisher.publish(keys[0], [(k, m.pages[ix]) for ix, k in keys[1]])
            return stored, done

    def _accepted(self, digest: str) -> int | None:
        """From a commit thread: the page count of a manifest already accepted
        with bytes of *digest* (a fork's source), or None (then they are parsed)."""
        if self.db is None:
            return None
        with self.db.writing() as conn:
            return ns.recorded_count(conn, digest)

    def _pages_of(self, stg: Staging, digest: str) -> Sequence[str]:
        """The pages of staged manifest bytes accepted before: from the namespace, or parsed."""
        pages = None
        if self.db is not None:
            with self.db.writing() as conn:
                pages = ns.recorded_pages(conn, digest)
        if pages is not None:
            return pages
        return mf.parse(stg.read(0, stg.size)).pages

    @property
    def stored_bytes(self) -> int:
        return self.stored.value

    def add_stored(self, nbytes: int) -> None:
        """*nbytes* more blob bytes stored (from any thread)."""
        self.stored.add(nbytes)

    def recounted(self, recount: Callable[[], int]) -> int:
        """Stored bytes set from *recount()* (see StoredBytes.recounted)."""
        return self.stored.recounted(recount)

    def count_stored(self) -> int:
        """From a worker thread: the stored bytes of every blob the namespace indexes."""
        assert self.db is not None
        with self.db.writing() as conn:
            return ns.stored_bytes(conn)

    def _room_for(self, nbytes: int) -> bool:
        """Whether *nbytes* more stay within max_size (recounted before saying no)."""
        limit = self.max_size
        if limit is None or self.stored_bytes + nbytes <= limit:
            return True
        if self.db is not None:
            self.recounted(self.count_stored)
        return self.stored_bytes + nbytes <= limit

    def _store_sync(self, stg: Staging, parse_manifest: bool) -> StoredContent:
        size = stg.size
        manifest: mf.Manifest | AcceptedManifest | None = None
        first = None  # digest of block 0, when computed early
        if parse_manifest:
            try:
                if size > mf.MAX_MANIFEST_BYTES:
                    raise mf.ManifestError("manifest", f"{size} bytes exceed the "
                                           f"{mf.MAX_MANIFEST_BYTES}-byte cap")
                if self.db is not None and 0 < size <= BLOCK_SIZE:
                    # A fork copies a manifest byte for byte: its checks passed already.
                    first = digest_of(stg.view(0))
                    n = self._accepted(first)
                    if n is not None:
                        manifest = AcceptedManifest(n, functools.partial(self._pages_of, stg, first))
                if manifest is None:
                    manifest = mf.parse(stg.read(0, size))
            except mf.ManifestError as e:
                return StoredContent(size, "", [], [], manifest_error=e)
        nblocks = -(-size // BLOCK_SIZE)
        batch: BlobBatch = self.blobs.batch() if self.sync_on_close else self.pending
        blocks: list[str] = []
        rows: list[BlobRow] = []
        zeros: dict[int, str] = {}    # holes met in this commit: length -> stored zero blob
        for bn in range(nblocks):
            n = min(BLOCK_SIZE, size - bn * BLOCK_SIZE)
            if nblocks > 1:
                # A file of several blocks re-commits only what changed: a block
                # still as committed is named again (this file's rows hold its
                # blob until this commit replaces them), a hole is the zero blob.
                d = stg.clean.get(bn)
                if d is not None:
                    blocks.append(d)
                    row = stg.early_rows.get(d)
                    if row is not None:
                        rows.append(row)    # (stored by write-behind: new to the namespace)
                    continue
                if stg.is_hole(bn):
                    if n not in zeros:
                        zeros[n] = self._put(bytes(n), self.zero_digest(n), batch, rows)
                    blocks.append(zeros[n])
                    continue
            with self.block_budget.hold(n):
                data = stg.view(bn)
                if bn == 0 and first is not None:
                    blocks.append(self._put(data, first, batch, rows))
                else:
                    blocks.append(self._hash_and_put(data, batch, rows))
                del data
        if self.sync_on_close:
            batch.sync()
        digest: str | None
        if nblocks == 0:
            digest = EMPTY_DIGEST
        elif nblocks == 1:
            digest = blocks[0]
        else:
            digest = None   # (sha256 of every byte: reckoned when user.pffs.digest asks)
        return StoredContent(size, digest, blocks, rows, manifest=manifest)

    def store_block(self, stg: Staging, fd: int, bn: int) -> BlobRow:
        """Write-behind, in a worker thread: store block *bn* of a staged file now
        (*fd*: the spill file's, duplicated for this call), pinned until the
        file's commit names it.  Returns the blob's row."""
        # (The gc lock first, the budget inside it, as in a commit: a gc waiting
        # for the commits in its way never waits on a job that waits on it.)
        with self.gc_lock.shared() if self.gc_lock is not None else contextlib.nullcontext(), \
                self.block_budget.hold(BLOCK_SIZE):
            data = os.pread(fd, BLOCK_SIZE, bn * BLOCK_SIZE)
            if len(data) < BLOCK_SIZE:
                data += bytes(BLOCK_SIZE - len(data))   # (a hole at the end)
            rows: list[BlobRow] = []
            d = self._hash_and_put(data, self.pending, rows, new=True)
            if stg.pins is not None:
                stg.pins.add([d])
            return rows[0]

    def get(self, digest: Digest) -> bytes | memoryview:
        """A blob's bytes, decoded and verified (a large one within the block budget;
        a large page in a read-only view: BlobStore.get_view)."""
        return self.blobs.get_view(digest, hold=self.block_budget.hold)

    def set_aside(self, digest: Digest, why: str) -> None:
        """In a worker thread: blob *digest*, which a read found damaged, moved
        out of the way (BlobStore.set_aside), so the next write of its bytes
        stores it afresh instead of keeping the damaged frame."""
        self.blobs.set_aside(digest, why)

    def store_bytes(self, data, digest: str | None = None) -> BlobRow:
        """In a commit thread: store *data* as one blob now (a page a copy will
        name next: see name_if_stored); its row.  *digest*: the bytes' sha256
        where the caller knows it already (a live snapshot's manifest lists it)."""
        with self.gc_lock.shared() if self.gc_lock is not None else contextlib.nullcontext():
            batch: BlobBatch = self.blobs.batch() if self.sync_on_close else self.pending
            rows: list[BlobRow] = []
            if digest is None:
                self._hash_and_put(data, batch, rows)
            else:
                self._put(data, digest, batch, rows)
            if self.sync_on_close:
                batch.sync()
            return rows[0]

    @property
    def can_adopt_stored(self) -> bool:
        """Whether blobs an engine put in the store itself can be given rows
        (adopt_stored): a store folder on this host, with an adopter."""
        return self.adopt is not None and not self.blobs.remote

    def adopt_stored(self, digests: Sequence[str]) -> None:
        """In a commit thread: blobs a live engine put in the (local) store
        itself, a snapshot's pages for a copy out of engines/, given rows and
        made durable with the daemon's own (see pffs.fs.adoption.LocalAdopter);
        a copy then names them (name_if_stored), or copies the bytes where
        one is gone by then."""
        assert self.adopt is not None
        with self.gc_lock.shared() if self.gc_lock is not None else contextlib.nullcontext():
            self.adopt(digests)

    def name_if_stored(self, digest: str, then: Callable[[], Any]) -> Any:
        """In a commit thread: ``then()`` (the transaction naming *digest*) if the
        store holds the blob, else False; the gc lock is held shared across both,
        so no gc takes the blob between."""
        with self.gc_lock.shared() if self.gc_lock is not None else contextlib.nullcontext():
            if not self.blobs.contains(Digest(digest)):
                return False
            self.named["by_thread"] += 1
            return then()

    def name_if_stored_now(self, digest: str, then: Callable[[], tuple[bool, Any]]) -> tuple[bool, Any]:
        """``name_if_stored`` on the event loop, where it waits for nothing: *then*
        gives (done, result) as ``Database.try_small`` does.  (True, its result
        or False), or (False, None) where it cannot be done there (the store is
        remote, gc holds or wants its lock, the write connection is taken):
        then a commit thread does it.  Saves a copy out of ``engines/`` a
        hand-off to a thread and back a file (docs/performance.md)."""
        if self.blobs.remote:
            return False, None
        gc = self.gc_lock.shared_if_free() if self.gc_lock is not None else contextlib.nullcontext(True)
        with gc as held:
            if not held:
                return False, None
            if not self.blobs.contains(Digest(digest)):
                return True, False
            done, result = then()
        if done:
            self.named["on_loop"] += 1
        return done, result

    def _hash_and_put(self, data, batch: BlobBatch, rows: list[BlobRow], *, new: bool = False) -> str:
        """Store one block's bytes under their digest; returns it.

        A page-sized block is compressed on a helper thread while this one
        hashes it, so a commit takes the longer of the two rather than their
        sum (a page file's close waits for its commit); the frame is used
        only if the blob is new.  A large block has its two planes compressed
        at once, one on an encoder thread (codec.encode), once its hash says
        the blob is new; or, when the caller says it likely is (*new*: a
        sequential writer's block), while an encoder thread hashes it.
        """
        n = memoryview(data).nbytes
        if n > SPECULATE_MAX:
            encode = functools.partial(codec_mod.encode_parts, data, self.blobs.codec, pool=self.encoders)
            if not new:
                return self._put(data, digest_of(data), batch, rows, frame=encode)
            digest = self.encoders.submit(digest_of, data)
            try:
                frame = encode()
            finally:
                d = digest.result()
            return self._put(data, d, batch, rows, frame=frame)
        if n < SPECULATE_MIN:
            return self._put(data, digest_of(data), batch, rows)
        fut = self.encoders.submit(codec_mod.encode_parts, data, self.blobs.codec)
        try:
            return self._put(data, digest_of(data), batch, rows, frame=fut.result)
        finally:
            fut.cancel()
            wait([fut])     # (the staged bytes are not read once the commit goes on)

    def _put(self, data, d: str, batch: BlobBatch, rows: list[BlobRow], frame=None) -> str:
        """Store one block's bytes under *d* (its row joins *rows*); returns *d*."""
        if self.max_size is not None and not self.blobs.contains(Digest(d)) \
                and not self._room_for(len(data)):
            raise StoreFull(f"store limit of {self.max_size} bytes reached")
        r = self.blobs.put(data, Digest(d), batch=batch, frame=frame)
        if not r.existed:
            self.add_stored(r.stored_size)
        rows.append(BlobRow(d, len(data), r.stored_size, r.codec))
        return d

    def zero_digest(self, n: int) -> str:
        """The digest of *n* zero bytes (reckoned once a length; a hole's)."""
        d = self._zero_digests.get(n)
        if d is None:
            d = self._zero_digests[n] = digest_of(bytes(n))
        return d

    def statfs(self, conn, generation: int | None = None) -> pyfuse3.StatvfsData:
        """The mount's statfs; *generation* (the database's data_version) lets the
        inode count, a pass over a table, be kept until something commits."""
        s = os.statvfs(self.blobs.root)
        frsize = 4096
        total = s.f_blocks * s.f_frsize
        free = s.f_bavail * s.f_frsize
        if self.max_size is not None:
            total = min(total, self.max_size)
            free = max(0, min(free, self.max_size - self.stored_bytes))
        if generation is None or self._inodes is None or self._inodes[0] != generation:
            self._inodes = (generation, ns.inode_count(conn))
        n_inodes = self._inodes[1]
        out = pyfuse3.StatvfsData()
        out.f_bsize = 1 << 20
        out.f_frsize = frsize
        out.f_blocks = total // frsize
        out.f_bfree = free // frsize
        out.f_bavail = free // frsize
        out.f_files = n_inodes + s.f_favail
        out.f_ffree = s.f_favail
        out.f_favail = s.f_favail
        out.f_namemax = 255
        return out
