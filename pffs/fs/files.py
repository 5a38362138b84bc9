"""Open files of the namespace: handles, staged writes, and their commits.

A file changed through a handle is staged (``pffs.fs.write_stage.Staging``):
its bytes are kept in memory or a spill file until a flush, fsync or the
last close commits them (``ContentStore.store``: blobs first, then the
namespace rows, in one transaction).  ``InodeState.lock`` orders the writes
and the commit of one inode.  A reader of a file not being changed reads
its committed blobs through the blob cache.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyfuse3
import trio
from pyfuse3 import FileInfo, FUSEError, RequestContext

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.errors import StoreFull, StoreUnavailable
from pffs.fs.blobcache import BlobReader
from pffs.fs.content import ContentStore
from pffs.fs.copies import copy_pieces
from pffs.fs.db import Database
from pffs.fs.inodes import InodeState, InodeTable, Invalidator
from pffs.fs.prefetch import Prefetch
from pffs.fs.write_stage import MemoryBudget, Staging, journal_inode
from pffs.namespace import BLOCK_SIZE, BlobRow, FsError, StoredContent

log = logging.getLogger("pffs.fs")

MANIFEST = mf.MANIFEST_NAME.encode()
# Writes to (and reads of) a staged file on disk up to this size are done on
# the event loop: a pwrite into the page cache costs less than a hand-off.
SMALL_WRITE = 64 << 10
# What a file given blobs as content (see Files._fill_empty) holds: (size, blocks).
Filled = tuple[int, list[str]]
# pyfuse3 built with third_party/pyfuse3's patch: FileInfo.noflush (FOPEN_NOFLUSH).
NOFLUSH = hasattr(pyfuse3.FileInfo(), "noflush") and not os.environ.get("PFFS_STOCK_PYFUSE3")


@dataclass
class OpenFile:
    ino: int
    writable: bool
    uid: int
    gid: int
    # Read ahead of this reader at its first read (not at its open: a copy
    # with copy_file_range opens its source and never reads it).
    read_ahead: bool = False


@dataclass(eq=False)
class Files:
    db: Database
    content: ContentStore
    inodes: InodeTable
    reader: BlobReader
    prefetch: Prefetch
    invalidate: Invalidator
    # The daemon's, where a read ahead and write-behind run while it serves
    # (None: neither runs, as in handler tests without a daemon).
    nursery: trio.Nursery | None
    staging_memory: int = 128 << 20
    # fsync() of a staged file journals its bytes rather than committing them
    # (off for an S3 store: there, fsync uploads).
    journal_fsync: bool = True

    def __post_init__(self) -> None:
        self.budget = MemoryBudget(self.staging_memory)
        self.handles: dict[int, OpenFile] = {}
        self._next_fh = 1
        # Full blocks of a file being written are stored while it is written
        # (off where a commit uploads or syncs its blobs: S3, -o sync=close).
        self.write_behind = not self.content.sync_on_close
        self.behind_limiter = trio.CapacityLimiter(1)   # (the block budget allows one anyway)
        # Bytes copy_file_range gave by sharing blobs, and bytes it copied (stats.json).
        self.copies = {"shared_bytes": 0, "copied_bytes": 0}

    def created(self, ino: int, name: bytes, flags: int, ctx: RequestContext) -> int:
        """A handle of a file just created empty (its first write needs nothing
        from the namespace)."""
        fh = self.open_handle(ino, flags, ctx)
        st = self.inodes.states[ino]
        if st.staging is None:
            st.staging = Staging(self.budget, str(self.content.staging_dir))
            st.plain = name != MANIFEST
            st.blocks, st.size = [], 0  # what is committed: nothing
        return fh

    def open_handle(self, ino: int, flags: int, ctx: RequestContext) -> int:
        fh = self._next_fh
        self._next_fh += 1
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        self.handles[fh] = OpenFile(ino, writable, ctx.uid, ctx.gid)
        st = self.inodes.state(ino)
        st.opens += 1
        if writable:
            st.writers += 1
            st.writer_uid, st.writer_gid = ctx.uid, ctx.gid
        return fh

    async def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        # (The kernel sends opendir, never open, for a directory.)
        fh = self.open_handle(inode, flags, ctx)
        if self.nursery is not None and (flags & os.O_ACCMODE) != os.O_WRONLY:
            self.handles[fh].read_ahead = True
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
            # libfuse asks for atomic O_TRUNC: the truncation arrives here, and
            # is staged like a write (a refused manifest keeps its old bytes).
            st = self.inodes.states[inode]
            async with st.lock:
                stg = st.staging or await self._load_staging(inode, st, empty=True)
                if stg.size:
                    stg.truncate(0)
                else:
                    stg._changed()
                stg.mtime_ns = ns.now_ns()
        if NOFLUSH and (flags & os.O_ACCMODE) == os.O_RDONLY:
            # A reader's close commits nothing (see flush): no FLUSH request.
            return FileInfo(fh=fh, keep_cache=True, noflush=True)
        return FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        of = self.handles[fh]
        if of.read_ahead:
            of.read_ahead = False
            self.prefetch.after_open(of.ino)
        st = self.inodes.states.get(of.ino)
        if st is not None and st.staging is not None:
            async with st.lock:
                stg = st.staging
                if stg is not None:
                    end = min(off + size, stg.size)
                    if stg.unloaded_in(off, end):
                        return await self._read_staged(of.ino, stg, off, end)
                    if stg.in_memory or size <= SMALL_WRITE:
                        return stg.read(off, size)
                    return await trio.to_thread.run_sync(stg.read, off, size)
        if st is None or st.blocks is None:
            # Committed size and blocks, kept until the next commit of this inode.
            size_now, blocks = self.prefetch.committed(of.ino)
            if st is not None:
                st.blocks, st.size = blocks, size_now
        else:
            blocks, size_now = st.blocks, st.size
        end = min(off + size, size_now)
        if off >= end:
            return b""
        out = []
        for bn in range(off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
            data = await self.reader.blob(blocks[bn], of.ino)
            base = bn * BLOCK_SIZE
            # A view: the reply is written from the cached blob, no copy made here.
            out.append(memoryview(data)[max(off, base) - base:min(end, base + len(data)) - base])
        return out[0] if len(out) == 1 else b"".join(out)

    async def _read_staged(self, ino: int, stg: Staging, off: int, end: int) -> bytes:
        """Bytes [off, end) of a staged file some of whose blocks are not read in
        yet: those from the blob cache, the others from the spill file."""
        parts = []
        for bn in range(off // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
            base = bn * BLOCK_SIZE
            a, b = max(off, base), min(end, base + BLOCK_SIZE)
            if bn in stg.unloaded:
                parts.append((await self.reader.blob(stg.clean[bn], ino))[a - base:b - base])
            else:
                parts.append(await trio.to_thread.run_sync(stg.read, a, b - a))
        return b"".join(parts)

    async def _load_staging(self, ino: int, st: InodeState, empty: bool = False) -> Staging:
        """Stage a file for change, starting from its committed bytes (or none): a
        file of several blocks reads each in when it is first changed."""
        node = ns.get_inode(self.db.ro, ino)
        blocks = ns.blocks_of(self.db.ro, ino) if node.size and not empty else []
        if len(blocks) == 1:
            stg = Staging(self.budget, str(self.content.staging_dir), await self.reader.blob(blocks[0], ino))
        else:
            # A block at a time into the staging's spill file, never the whole
            # file in memory; blocks of zeros stay holes, read nor written.
            stg = Staging(self.budget, str(self.content.staging_dir), b"", fetch=self.content.get)
            zero = {}
            if blocks:
                await trio.to_thread.run_sync(stg.truncate, node.size)
                for n in {BLOCK_SIZE, node.size - (len(blocks) - 1) * BLOCK_SIZE}:
                    zero[n] = await trio.to_thread.run_sync(self.content.zero_digest, n)
            stg.clean = dict(enumerate(blocks))
            # (Read in when first changed, see Staging.unloaded.)
            stg.unloaded = {bn for bn, d in enumerate(blocks)
                            if d != zero[min(BLOCK_SIZE, node.size - bn * BLOCK_SIZE)]}
        stg.dirty = False
        st.staging = stg
        return stg

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        of = self.handles[fh]
        if not of.writable:
            raise FUSEError(errno.EBADF)
        self.size_ok(of.ino, off + len(buf), "write")
        st = self.inodes.states[of.ino]
        async with st.lock:
            stg = st.staging or await self._load_staging(of.ino, st)
            end = off + len(buf)
            if stg.unloaded:
                await self._read_in(of.ino, stg, min(off, stg.size), end, (off, end))
            was_in_memory = stg.in_memory
            if (stg.in_memory and not stg.spills(off, len(buf))) \
                    or (not stg.in_memory and len(buf) <= SMALL_WRITE):
                # A copy into memory, or a small one into the spill file's page
                # cache (a database's pages): not worth a thread's hand-off.
                stg.write(off, buf)
            else:
                await trio.to_thread.run_sync(stg.write, off, buf)
            stg.mtime_ns = ns.now_ns()
            if end >= BLOCK_SIZE and self.write_behind and not stg.in_memory \
                    and self.nursery is not None:
                # Blocks the write ends (and those before it when it moved the file
                # to disk) that one run of sequential writes wrote whole: a random
                # writer's blocks would be written again, and stored for nothing.
                lo = 0 if was_in_memory else off // BLOCK_SIZE
                lo = max(lo, -(-stg.run_start // BLOCK_SIZE))
                for bn in range(lo, min(end, stg.size) // BLOCK_SIZE):
                    if bn not in stg.clean and bn not in stg.inflight:
                        stg.inflight.add(bn)
                        stg.spoiled.discard(bn)
                        st.behind[bn] = trio.Event()
                        self.nursery.start_soon(self._write_behind, of.ino, st, stg, bn)
        return len(buf)

    async def _read_in(self, ino: int, stg: Staging, off: int, end: int,
                       whole: tuple[int, int] = (0, 0)) -> None:
        """Before bytes [off, end) of a staged file change: read in the blocks
        that hold them (Staging.unloaded), through the blob cache, but those the
        write's range *whole* covers entirely."""
        for bn in stg.to_read_in(off, end, whole):
            data = await self.reader.blob(stg.clean[bn], ino)
            if bn in stg.unloaded:
                await trio.to_thread.run_sync(stg.fill, bn, data)

    async def _write_behind(self, ino: int, st: InodeState, stg: Staging, bn: int) -> None:
        """A writer just wrote the last bytes of block *bn*: store it now, in a
        worker thread, while the writer goes on (a sequential writer's commit is
        then its last block only).  Its blob is named at the commit if no write
        touched the block meanwhile (``Staging.spoiled``)."""
        done = st.behind[bn]
        row = None
        fd = -1
        try:
            if stg.fd is None:
                return
            fd = os.dup(stg.fd)
            if stg.pins is None and self.content.gc_lock is not None:
                stg.pins = self.content.gc_lock.pin()
            row = await trio.to_thread.run_sync(self.content.store_block, stg, fd, bn,
                                                limiter=self.behind_limiter)
        except (OSError, StoreFull, ValueError) as e:
            # (The commit stores the block itself, and reports what fails then.)
            log.debug("write-behind of block %d of inode %d: %s", bn, ino, e)
        finally:
            if fd >= 0:
                os.close(fd)
            stg.inflight.discard(bn)
            del st.behind[bn]
            done.set()
        if row is not None and bn not in stg.spoiled and st.staging is stg \
                and (bn + 1) * BLOCK_SIZE <= stg.size:
            stg.clean[bn] = row.digest
            stg.early_rows[row.digest] = row
        stg.spoiled.discard(bn)

    def whole_blob(self, fh: int) -> tuple[str, int, None] | None:
        """(digest, size, None) of the blob that the committed file open as *fh*
        is, whole (one block, no change staged), else None."""
        of = self.handles.get(fh)
        if of is None:
            return None
        st = self.inodes.states.get(of.ino)
        if st is not None and st.staging is not None:
            return None     # (being written: its bytes are copied)
        if st is not None and st.blocks is not None:
            size, blocks = st.size, st.blocks
        else:
            size, blocks = self.prefetch.committed(of.ino)
        if len(blocks) != 1 or not 0 < size <= BLOCK_SIZE:
            return None
        return blocks[0], size, None

    async def take_blob(self, fh: int, digest: str, size: int, row: BlobRow | None) -> bool:
        """copy_file_range of a whole blob from another tree (a live engine's
        page) into the empty file open as *fh*: it holds the blob, if the store
        still does (checked under the gc lock); False where it cannot."""
        of = self.handles.get(fh)
        if of is None or not of.writable or not 0 < size <= BLOCK_SIZE:
            return False
        return await self._fill_empty(of.ino, functools.partial(self._give_blob, of.ino, digest, size, row)) \
            is not None

    async def _give_blob(self, ino: int, digest: str, size: int, row: BlobRow | None, staged_empty: bool,
                         t: int) -> Filled | None:
        """``ns.give_blob`` if the store holds the blob (``ContentStore.name_if_stored``):
        on the loop where that need not wait, else in a commit thread."""
        change = (ns.give_blob, ino, size, digest, row, staged_empty, t)
        done, got = self.content.name_if_stored_now(digest, functools.partial(self.db.try_small, *change))
        if done:
            return got or None
        got = await self.content.workers.call(self.content.name_if_stored, digest,
                                              functools.partial(self.db.run_in_transaction, *change))
        return got or None

    async def copy_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                         length: int) -> int:
        """``copy_file_range``: bytes copied.  A whole committed file copied into
        an empty one shares its blobs (nothing read, hashed or written); any
        other range is read and written here, in pieces."""
        src, dst = self.handles.get(fh_in), self.handles.get(fh_out)
        if src is None or dst is None or not dst.writable:
            raise FUSEError(errno.EBADF)
        src.read_ahead = False  # (a copy reads what it copies, nothing beyond)
        if length == 0:
            return 0
        if off_in == 0 and off_out == 0 and src.ino != dst.ino:
            n = await self._share_blobs(src.ino, dst.ino, length)
            if n is not None:
                self.copies["shared_bytes"] += n
                return n
        self.size_ok(dst.ino, off_out + length, "copy")
        done = await copy_pieces(self.read, fh_in, off_in, self.write, fh_out, off_out, length)
        self.copies["copied_bytes"] += done
        return done

    async def _share_blobs(self, src: int, dst: int, length: int) -> int | None:
        """Give empty file *dst* the committed blobs of all of *src*: its size,
        or None where that cannot be done (then the bytes are copied)."""
        await self.commit_staged(src)
        return await self._fill_empty(dst, functools.partial(self.db.write_small, ns.share_content,
                                                             src, dst, length))

    async def _fill_empty(self, ino: int, content: Callable[[bool, int], Awaitable[Filled | None]],
                          ) -> int | None:
        """Give empty file *ino* (created, or opened with O_TRUNC, or committed
        empty) blobs as content: ``await content(staged_empty, mtime_ns)`` runs
        the transaction and gives (size, blocks), or None where it cannot.
        The new size, or None (then the bytes are copied)."""
        st = self.inodes.states[ino]
        if self._named_manifest(ino, st):
            return None     # (a manifest.json is copied byte by byte, and checked at its close)
        async with st.lock:
            while st.behind:
                await next(iter(st.behind.values())).wait()
            stg = st.staging
            if stg is not None and stg.size:
                return None
            got = await content(stg is not None, ns.now_ns())
            if got is None:
                return None
            size, blocks = got
            if stg is not None:
                st.staging = None
                stg.close()
            st.blocks, st.size = blocks, size
        # (The kernel drops its cached pages of the range copied and takes the
        # new size from the reply itself: nothing to invalidate.)
        return size

    def size_ok(self, ino: int, size: int, op: str) -> None:
        if size > ns.MAX_FILE_SIZE:
            log.info("%s %s: %d bytes refused (the largest file is %d bytes)", op, self.inodes.path_of(ino),
                     size, ns.MAX_FILE_SIZE)
            raise FUSEError(errno.EFBIG)

    async def truncate(self, ino: int, size: int, ctx: RequestContext | OpenFile, grow: bool = False) -> None:
        """Stage the file at *size* bytes (*grow*: only where it is shorter, as fallocate)."""
        st = self.inodes.state(ino)
        st.opens += 1  # hold the state while we work
        try:
            async with st.lock:
                stg = st.staging or await self._load_staging(ino, st)
                if grow and size <= stg.size:
                    return
                # (The blocks cut or grown into; none past the new end.)
                await self._read_in(ino, stg, min(size, stg.size),
                                    min(max(size, stg.size), -(-size // BLOCK_SIZE) * BLOCK_SIZE))
                await trio.to_thread.run_sync(stg.truncate, size)
                stg.mtime_ns = ns.now_ns()
                if not st.writers:
                    # No handle open for writing will flush this: commit now.
                    st.writer_uid, st.writer_gid = ctx.uid, ctx.gid
                    await self.commit(ino, st)
        finally:
            st.opens -= 1
            await self._drop_state_if_idle(ino)

    async def commit(self, ino: int, st: InodeState, check_manifest: bool = True) -> None:
        """Hash, compress and store the staged bytes, then point the inode at them.

        Caller holds ``st.lock``.  A file named manifest.json must hold a valid
        manifest, else EINVAL and the staged bytes are dropped (the previous
        content stays).
        """
        while st.behind:    # blocks being stored by write-behind: their results first
            await next(iter(st.behind.values())).wait()
        stg = st.staging
        if stg is None or not stg.dirty:
            return
        is_manifest = check_manifest and self._named_manifest(ino, st)
        was_empty = st.blocks == []     # known committed content: none
        # The transaction, in the commit thread once the blobs are stored: a
        # file that took the name manifest.json after the check above (a
        # rename committed meanwhile) has its bytes checked there.
        then = functools.partial(self.db.run_in_transaction, ns.commit_file, ino, stg, was_empty,
                                 st.writer_uid, st.writer_gid)
        try:
            stored, created = await self.content.store(stg, parse_manifest=is_manifest, then=then)
        except StoreFull as e:
            stg.forget_early()     # (gc may take write-behind's blobs: room comes back sooner)
            raise StoreFull(f"{self.inodes.path_of(ino)}: {e}") from None  # the log line names the file
        except ns.LateManifest as e:
            stored = StoredContent(stg.size, "", [], [], manifest_error=e.error)
        if stored.manifest_error is not None:
            where = self.inodes.path_of(ino)
            log.warning("close %s: refused manifest: %s", where, stored.manifest_error)
            stg.close()
            st.staging = None
            self.invalidate.inode(ino, False)
            raise FUSEError(errno.EINVAL)
        st.blocks, st.size = stored.blocks, stored.size
        stg.dirty = False
        stg.unsynced = 0
        self.invalidate.announce(created)

    async def _drop_state_if_idle(self, ino: int) -> None:
        st = self.inodes.states.get(ino)
        if st is None or st.opens > 0:
            return
        if st.staging is not None:
            if st.staging.dirty:
                await self._commit_or_say(ino, st, "release")
            if st.opens > 0:
                return
            if st.staging is not None:
                stg = st.staging
                st.staging = None  # a release waiting on the lock finds nothing left to commit
                if stg.journaled and not stg.dirty:
                    # Its fsynced bytes are committed: that commit is made durable
                    # before the journal file goes.
                    await self.content.sync_pending()
                    await self.db.sync_wal()
                stg.close()
                if st.opens > 0:
                    return      # (opened again meanwhile)
        if self.inodes.states.get(ino) is st:  # (such a waiter may come second)
            del self.inodes.states[ino]
            await self.inodes.maybe_delete(ino)

    async def flush(self, fh: int) -> None:
        await self._flush(self.handles[fh])

    async def _flush(self, of: OpenFile, any_handle: bool = False) -> None:
        st = self.inodes.states.get(of.ino)
        # A reader's close neither commits nor fails on a writer's staged bytes
        # (say, left by a close that failed); fsync of any handle does commit.
        if (of.writable or any_handle) and st is not None and st.staging is not None \
                and st.staging.dirty:
            async with st.lock:
                await self.commit(of.ino, st)

    async def fsync(self, fh: int, datasync: bool) -> None:
        of = self.handles[fh]
        st = self.inodes.states.get(of.ino)
        if st is not None and st.staging is not None and st.staging.dirty and self.journal_fsync:
            async with st.lock:
                stg = st.staging
                if stg is not None and stg.dirty and not stg.unloaded \
                        and (stg.journaled or stg.journal_pays()) \
                        and not self._named_manifest(of.ino, st):
                    # Durable, not committed: the staged bytes go to a journal file
                    # (flushed), at the cost of what changed since the last fsync; the
                    # close commits them. A manifest.json is committed (and checked) now.
                    await trio.to_thread.run_sync(stg.journal, of.ino)
        if not (st is not None and st.staging is not None and st.staging.journaled):
            await self._flush(of, True)
        await self.content.sync_pending()
        await self.db.sync_wal()

    # -- what the namespace's handlers ask of an inode's staged state ------------

    def size_and_mtime(self, node: ns.Inode) -> tuple[int, int]:
        """The size and mtime a stat of *node* shows: its staged bytes' while it
        is being written."""
        size, mtime = node.size, node.mtime_ns
        st = self.inodes.states.get(node.id)
        if st is not None and st.staging is not None:
            size = st.staging.size
            if st.staging.mtime_ns is not None:
                mtime = st.staging.mtime_ns
        return size, mtime

    def set_mtime(self, ino: int, mtime_ns: int) -> None:
        """An explicit mtime of *ino* (setattr): it wins over the time of the staged writes."""
        st = self.inodes.states.get(ino)
        if st is not None and st.staging is not None:
            st.staging.mtime_ns = mtime_ns

    def named_anew(self, ino: int) -> None:
        """*ino* may take another name (a rename, a link): from now on no commit
        of it skips looking up its names (see InodeState.plain)."""
        st = self.inodes.states.get(ino)
        if st is not None:
            st.plain = False

    async def commit_staged(self, ino: int, check_manifest: bool = True) -> bool:
        """Commit what is staged of *ino* and not committed yet (a file about to
        be read whole: its digest asked for, a manifest checked or forked):
        whether there was such a change."""
        st = self.inodes.states.get(ino)
        if st is None or st.staging is None or not st.staging.dirty:
            return False
        async with st.lock:
            await self.commit(ino, st, check_manifest=check_manifest)
        return True

    def _named_manifest(self, ino: int, st: InodeState) -> bool:
        return not st.plain and any(n == MANIFEST for _, n in ns.names_of(self.db.ro, ino))

    async def replay_journals(self, paths: list[str]) -> None:
        """At mount, before serving: commit the bytes that fsync() left in journal
        files (``staging/fsynced-<inode>-…``) of a daemon that ended without
        committing them (killed, or the machine went down)."""
        for path in paths:
            ino = journal_inode(os.path.basename(path))
            node = None
            try:
                node = ns.get_inode(self.db.ro, ino) if ino is not None else None
            except FsError:
                pass
            if ino is None or node is None or not stat.S_ISREG(node.mode) or not ns.names_of(self.db.ro, ino):
                log.info("fsynced bytes of inode %s dropped: the file is gone (%s)", ino, path)
                os.unlink(path)
                continue
            st = self.inodes.state(ino)
            st.opens += 1
            try:
                st.staging = Staging.adopt(self.budget, path)
                size = st.staging.size
                st.writer_uid, st.writer_gid = node.uid, node.gid
                async with st.lock:
                    try:
                        await self.commit(ino, st)
                    except (FUSEError, StoreFull, StoreUnavailable) as e:
                        why = os.strerror(e.errno) if isinstance(e, FUSEError) else str(e)
                        log.warning("fsynced bytes of %s not committed (%s): %s kept for the next "
                                    "mount", self.inodes.path_of(ino), why, path)
                        if st.staging is not None:
                            st.staging.path = None      # (the file stays)
                            st.staging.close()
                            st.staging = None
                        continue
                log.info("committed the fsynced bytes of %s (%d bytes) left by the previous run",
                         self.inodes.path_of(ino), size)
            finally:
                st.opens -= 1
                await self._drop_state_if_idle(ino)

    async def release(self, fh: int) -> None:
        of = self.handles.pop(fh)
        st = self.inodes.states.get(of.ino)
        if st is None:
            return
        st.opens -= 1
        st.writers -= of.writable
        await self._drop_state_if_idle(of.ino)

    async def commit_all(self) -> None:
        """Commit every staged change (at unmount)."""
        for ino, st in list(self.inodes.states.items()):
            if st.staging is not None and st.staging.dirty:
                await self._commit_or_say(ino, st, "unmount")

    async def _commit_or_say(self, ino: int, st: InodeState, when: str) -> None:
        """Commit with no caller left to answer: a failure is one log line."""
        async with st.lock:
            try:
                await self.commit(ino, st)
            except FUSEError as e:
                log.warning("%s %s: staged changes dropped (%s)", when, self.inodes.path_of(ino),
                            os.strerror(e.errno))
            except (StoreFull, StoreUnavailable) as e:
                log.warning("%s %s: staged changes dropped (%s)", when, self.inodes.path_of(ino), e)
