"""Database access for the daemon: reads on the trio thread, writes in one worker.

Reads (lookups, getattr, readdir) are short indexed queries on ``ro``, which
only the thread that made the Database (the event loop's) may use: it
refuses any other.  Every change is a function of ``pffs.namespace`` run in
one transaction on the write connection, reached only under ``rw_lock``
(``writing``): by the writer thread (``write``: changes in the order they were
asked for, each atomic with respect to every other), by the event loop itself
for a change of a few rows when nothing else is writing (``write_small``), or
by a commit thread for the file it has just stored (``run_in_transaction``).
See docs/concurrency.md.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from typing import Any, Callable, Iterator

import trio

from pffs import namespace
from pffs.errors import StoreFull
from pffs.fs.workers import WorkerPool


class Database:
    """The namespace of a mount: made on the event loop's thread, whose it is.

    *on_full*, called when a commit finds the disk full, says whether it made
    room (the store's reserve given up: pffs.store.reserve); the commit is
    then tried once more.
    """

    def __init__(self, path: str | os.PathLike, *, on_full: Callable[[], bool] | None = None):
        self.path = str(path)
        self._loop_thread = threading.get_ident()
        self._ro = namespace.connect(self.path)
        self._rw = namespace.connect(self.path)
        # Checkpoints are run by the daemon's periodic task, not by a commit
        # that happens to cross the threshold on the event loop.
        namespace.no_autocheckpoint(self._rw)
        namespace.no_autocheckpoint(self._ro)
        self.limiter = trio.CapacityLimiter(1)
        # Held by whichever worker thread uses the write connection: the writer
        # thread, or a commit thread committing the file it has just stored.
        self.rw_lock = threading.Lock()
        # One thread: changes run one at a time, in the order they were asked for.
        self.writer = WorkerPool(1, "pffs-db-writer")
        self.on_full = on_full
        # Bumped after every committed change: what was read from ``ro`` at
        # an earlier generation may be stale (see pffs.fs.prefetch.PageWindow).
        self.generation = 0
        self._synced = -1       # the generation that sync_wal last made durable
        self._writes = 0        # writes handed to the writer thread and not yet answered
        # The write connection's busy timeout: 0 for a change on the loop
        # (write_small), namespace.BUSY_TIMEOUT_MS for the threads; set only
        # where it changes (two PRAGMAs around each change on the loop cost
        # 17-32 us of a create's 150), under rw_lock as every use of the
        # connection is.
        self._rw_waits = True
        # Changes made where they were asked (write_small) and handed to the
        # writer thread (in stats.json); busy timeout switches.
        self.counts = {"on_loop": 0, "by_writer": 0, "timeout_switches": 0}

    @property
    def ro(self) -> sqlite3.Connection:
        """The read connection, of the event loop's thread only."""
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError("the namespace's read connection is the event loop's")
        return self._ro

    @ro.setter
    def ro(self, conn: sqlite3.Connection) -> None:
        self._ro = conn

    @contextlib.contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """From a worker thread: the write connection, under ``rw_lock`` (the
        event loop's changes go through ``write_small``, which never waits
        for the lock: this refuses the loop's thread)."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("the namespace's write connection is taken from worker threads,"
                               " never on the event loop")
        with self.rw_lock:
            self._rw_wait(True)
            yield self._rw

    def _rw_wait(self, waits: bool) -> None:
        """Under rw_lock: the write connection waits for another process's lock
        (up to namespace.BUSY_TIMEOUT_MS), or never."""
        if waits != self._rw_waits:
            namespace.set_busy_timeout(self._rw, namespace.BUSY_TIMEOUT_MS if waits else 0)
            self._rw_waits = waits
            self.counts["timeout_switches"] += 1

    def data_version(self) -> int:
        """Changes whenever any connection, of this process or another (gc), has
        committed since ``ro`` last looked (SQLite's PRAGMA data_version; O(1))."""
        return namespace.data_version(self.ro)

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(rw_conn, *args)`` in one transaction in the writer thread."""
        self._writes += 1
        self.counts["by_writer"] += 1
        try:
            return await self.writer.call(self._run, fn, args)
        finally:   # (a queued call is not cancellable: this runs once it is answered)
            self._writes -= 1

    async def write_small(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``write`` for a change of a few indexed rows (a new name, a file given
        another's blocks): run at once on the loop when no write is queued or
        running and the write connection is free, which saves two thread
        hand-offs (about a third of a ``create``).  It never waits there: a
        lock held by another process (busy), or a full disk, sends it to the
        writer thread, as does any write still in flight (changes stay in the
        order they were asked for)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        done, result = self.try_small(fn, *args)
        if done:
            return result
        return await self.write(fn, *args)

    def try_small(self, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """On the loop: ``fn(rw_conn, *args)`` in one transaction if it can run now
        without waiting (as in ``write_small``): (True, its result), or (False,
        None) with nothing changed."""
        if self._writes == 0 and self.rw_lock.acquire(blocking=False):
            try:
                done, result = self._try_now(fn, args)
            finally:
                self.rw_lock.release()
            if done:
                self.counts["on_loop"] += 1
            return done, result
        return False, None

    def _try_now(self, fn, args) -> tuple[bool, Any]:
        """``fn`` in one transaction that waits for no lock: (True, its result),
        or (False, None) where it would have to wait or the disk is full (then
        nothing was changed)."""
        self._rw_wait(False)
        try:
            return True, self._transaction(fn, args)
        except sqlite3.OperationalError as e:
            if (getattr(e, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_BUSY \
                    or namespace.is_disk_full(e):
                return False, None
            raise

    def _run(self, fn, args):
        with self.rw_lock:
            self._rw_wait(True)
            try:
                return self._transaction(fn, args)
            except sqlite3.OperationalError as e:
                # Disk full: give up the store's reserve (pffs.store.reserve) and
                # try once more, so that deletions commit on a full disk.
                if not namespace.is_disk_full(e):
                    raise
                if self.on_full is None or not self.on_full():
                    raise StoreFull(f"namespace commit: {e}") from None
            try:
                return self._transaction(fn, args)
            except sqlite3.OperationalError as e:
                if namespace.is_disk_full(e):
                    raise StoreFull(f"namespace commit: {e}") from None
                raise

    def _transaction(self, fn, args):
        try:
            with namespace.transaction(self._rw):
                return fn(self._rw, *args)
        finally:
            self.generation += 1  # (also after a rollback: harmless)

    def run_in_transaction(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From a worker thread: ``fn(rw_conn, *args)`` in one transaction."""
        return self._run(fn, args)

    def checkpoint_sync(self, mode: str = "PASSIVE") -> None:
        with self.writing() as conn:
            namespace.checkpoint(conn, mode)

    async def checkpoint(self, mode: str = "PASSIVE") -> None:
        await trio.to_thread.run_sync(self.checkpoint_sync, mode, limiter=self.limiter)

    def sync_wal_sync(self) -> None:
        """Make every commit so far durable (fsync of the WAL file)."""
        for suffix in ("-wal", ""):
            try:
                fd = os.open(self.path + suffix, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def sync_wal(self) -> None:
        """Make every commit of this daemon so far durable; nothing to do when
        none came since the last time (an fsync() that journaled only)."""
        gen = self.generation
        if gen == self._synced:
            return
        await trio.to_thread.run_sync(self.sync_wal_sync, limiter=self.limiter)
        self._synced = max(self._synced, gen)

    def close(self) -> None:
        self.writer.stop()
        try:
            namespace.set_busy_timeout(self._rw, namespace.BUSY_TIMEOUT_MS)
            namespace.checkpoint(self._rw, "TRUNCATE")
        except sqlite3.Error:
            pass
        self._ro.close()
        self._rw.close()
