"""What the daemon holds in memory about the namespace's inodes, on the trio
thread only (code between two awaits is atomic with respect to other handlers):

- ``lookups``: the kernel's lookup count per inode; an unlinked inode is
  deleted when its count reaches zero and nothing has it open.
- ``states``: per inode with open handles or staged writes: the staging
  buffer, the committed block list, and a lock that orders writes and the
  commit of that inode.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyfuse3
import trio

from pffs import namespace as ns
from pffs.fs.db import Database
from pffs.fs.write_stage import Staging

log = logging.getLogger("pffs.fs")

# Inodes at most deleted in one transaction on the loop (InodeTable.maybe_delete).
SMALL_BATCH = 32


@dataclass
class InodeState:
    lock: trio.Lock = field(default_factory=trio.Lock)
    opens: int = 0
    writers: int = 0                    # handles open for writing
    staging: Staging | None = None
    blocks: list[str] | None = None     # committed blob digests, by block number
    size: int = 0                       # committed size (valid while blocks is not None)
    writer_uid: int = 0
    writer_gid: int = 0
    # Created under a name other than manifest.json and given no other name
    # since (rename and link clear it): a commit need not look up its names.
    plain: bool = False
    behind: dict[int, trio.Event] = field(default_factory=dict)   # write-behind jobs, by block


class InodeTable:
    """Lookup counts and open state of the namespace's inodes, and the rule
    that deletes an unlinked inode once nothing holds it."""

    def __init__(self, db: Database):
        self.db = db
        self.lookups: dict[int, int] = {}
        self.states: dict[int, InodeState] = {}
        self._said_negative = False          # a forget found a lookup count going below 0
        # Unlinked inodes let go of, waiting for the deletion in the writer to
        # end (maybe_delete), and the event set once they are deleted.
        self._doomed: list[int] = []
        self._deleting = False
        self._deleted = trio.Event()

    def looked_up(self, ino: int, n: int = 1) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + n

    def forgot(self, ino: int, n: int) -> bool:
        """The kernel dropped *n* lookups: whether it holds none now."""
        left = self.lookups.get(ino, 0) - n
        if left > 0:
            self.lookups[ino] = left
            return False
        if left < 0 and not self._said_negative:
            # Said once: a count pffs lost is a bug, and an unlinked inode may
            # then go early.
            self._said_negative = True
            log.warning("forget of inode %d: the kernel forgot %d lookups, pffs counted %d",
                        ino, n, self.lookups.get(ino, 0))
        self.lookups.pop(ino, None)
        return True

    def in_use(self, ino: int) -> bool:
        return ino in self.lookups or ino in self.states

    def state(self, ino: int) -> InodeState:
        st = self.states.get(ino)
        if st is None:
            st = self.states[ino] = InodeState()
        return st

    def dirty(self) -> set[int]:
        """Inodes whose staged bytes are not committed."""
        return {ino for ino, st in self.states.items() if st.staging is not None and st.staging.dirty}

    def path_of(self, ino: int) -> str:
        return ns.path_of(self.db.ro, ino)

    async def maybe_delete(self, ino: int) -> None:
        """Delete an unlinked inode once the kernel and every handle let go of it
        (returns once it is deleted).

        A deletion of a few rows (ns.deletes_little: a page file) runs on the
        loop where nothing else writes (Database.write_small), others in the
        writer thread; inodes let go of while one runs there are deleted
        together in the next transaction, not a transaction and two thread
        hand-offs each (``rm -r``: the kernel's FORGET of each file it
        unlinked)."""
        if self.in_use(ino):
            return
        if ns.nlink_of(self.db.ro, ino) != 0:
            return
        deleted = self._deleted
        self._doomed.append(ino)
        if self._deleting:
            await deleted.wait()
            return
        self._deleting = True
        try:
            while self._doomed:
                batch, self._doomed = self._doomed, []
                deleted, self._deleted = self._deleted, trio.Event()
                small = len(batch) <= SMALL_BATCH and all(ns.deletes_little(self.db.ro, i) for i in batch)
                try:
                    # (The writer asks in_use, which reads loop state that only
                    # the loop changes: a lookup since the check above keeps
                    # the inode.)
                    await (self.db.write_small if small else self.db.write)(ns.delete_unlinked, batch,
                                                                            self.in_use)
                except Exception:       # (the names are gone: the next mount deletes them)
                    log.exception("deleting unlinked inodes %s", batch[:8])
                finally:
                    deleted.set()
        finally:
            # (Cancelled at unmount: those still doomed are the next mount's
            # cleanup_orphans'; their waiters wait no more.)
            self._deleting = False
            self._doomed = []
            self._deleted.set()
            self._deleted = trio.Event()


def _notify(notify, ino: int, arg) -> None:
    """One kernel cache invalidation (in a worker thread); ENOENT (an inode
    or name the kernel does not hold) and ENOTCONN (unmounted) are no news."""
    try:
        notify(ino, arg)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTCONN):
            log.debug("%s of inode %d (%r): %s", notify.__name__, ino, arg, e)


# Seconds a handler waits for the invalidations queued before it (Invalidator.settled).
SETTLE_TIMEOUT = 10.0


class Invalidator:
    """Kernel cache invalidations, sent from a worker thread, never from a handler
    (which may wait for them: settled)."""

    def __init__(self, paths: InodeTable):
        self._paths = paths
        self._send, self._recv = trio.open_memory_channel(10000)

    async def run(self) -> None:
        async for notify, ino, arg in self._recv:
            if notify is None:
                arg.set()       # (settled(): what was queued before it has been sent)
                continue
            await trio.to_thread.run_sync(_notify, notify, ino, arg)

    async def settled(self, timeout: float = SETTLE_TIMEOUT) -> bool:
        """Return once the kernel has been sent every invalidation queued so far
        (False if that took over *timeout* seconds).  For a handler whose
        reply must not let the kernel answer from what they invalidate; only
        where the request holds no folder's lock (a close: an entry
        invalidation takes its folder's)."""
        done = trio.Event()
        with trio.move_on_after(timeout):
            try:
                await self._send.send((None, 0, done))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False    # (unmounting: nothing is sent any more)
            await done.wait()
        return done.is_set()

    def inode(self, ino: int, attr_only: bool) -> None:
        """Have the kernel forget what it cached of *ino* (its attributes only, or its pages too)."""
        self._queue(pyfuse3.invalidate_inode, ino, attr_only)

    async def attrs_now(self, inos: Sequence[int]) -> None:
        """Have the kernel forget the attributes of *inos*, and return once it
        has (from a worker thread, as the queued ones: an attributes-only
        invalidation takes no lock a request holds)."""
        def forget() -> None:
            for ino in inos:
                _notify(pyfuse3.invalidate_inode, ino, True)
        await trio.to_thread.run_sync(forget)

    def entry(self, parent: int, name: bytes) -> None:
        """Have the kernel forget the name *name* in folder *parent*."""
        self._queue(pyfuse3.invalidate_entry, parent, name)

    def _queue(self, notify, ino: int, arg) -> None:
        try:
            self._send.send_nowait((notify, ino, arg))
        except trio.WouldBlock:
            log.debug("invalidation queue full, dropping %s of inode %d", notify.__name__, ino)

    def announce(self, created) -> None:
        """Tell the kernel about page files that appeared by themselves (forks).

        The kernel never caches a negative entry from an ENOENT reply (it
        revalidates it), so only the directories' attributes need invalidating.
        """
        dirs = {pdir for pdir, _n in created}
        for d in dirs:
            self.inode(d, True)
        if created:
            log.info("metadata-only fork: %d page files appeared in %s", sum(n for _d, n in created),
                     ", ".join(self._paths.path_of(d) for d in dirs))
