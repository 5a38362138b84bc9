"""The numbers of ``MNT/engines/``, and what the kernel may keep of it.

Inode numbers (pffs.fs.routing.INODES: the ENGINES range): key 0 is
``engines/``; each engine and each session name gets a key of its own, and
key *k* owns ``LIVE_BASE + k * SPAN`` and up::

    +0              the folder (engines/NAME or engines/NAME/SESSION)
    +1, +2          a live session's pages/ and manifest.json (in that order:
                    ``cp -r`` copies a folder's entries by inode number, so it
                    copies the pages, storing each as it goes, before the
                    manifest, which then names what was stored without
                    hashing a page again)
    +3 ...          files and folders of a session being copied in (once the
                    engine took it, the live files they were: SessionEntry.taken)
    +PAGE_OFFSET+i  pages/NNNNNN (page i) of a live session

Keys are never reused while the daemon runs, so a re-attached engine gets
new inodes.  What the kernel may keep (each told where it changes, by
:class:`KernelCache`): ``engines/`` and ``engines/NAME`` (invalidated when an
engine attaches or detaches); the files and folders of a session being
copied in (invalidated when it goes); a live session's folder, its
``pages/`` and its page names for LIST_TTL, as long as the daemon keeps its
own list of the engine's sessions.  The attributes of a live session's
files are never kept, and every file is opened with direct_io.  Which
snapshot a reader sees is decided by its process
(pffs.live.engines.LiveEngine.snapshot_for).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pffs.fs.routing import LIVE_BASE, LIVE_END, LIVE_HANDLES
from pffs.namespace import ROOT_INODE
from pffs.types import InodeNo

if TYPE_CHECKING:
    from pffs.fs.inodes import Invalidator

SPAN = 1 << 25
PAGE_OFFSET = 1 << 24
ENGINES_INO = InodeNo(LIVE_BASE)
PAGES_J, MANIFEST_J = 1, 2
# File and folder handles are two number spaces (pffs.fs.routing.FILE_HANDLES, DIR_HANDLES).
FH_BASE = DH_BASE = LIVE_HANDLES
ENGINES_NAME = b"engines"
ROOT_COOKIE = 1 << 62               # readdir cookie of engines/ in the root, past every row id
# Seconds the kernel may keep engines/ and engines/NAME (invalidated at every
# attach and detach: see KernelCache).
ENGINE_DIRS_TIMEOUT = 300.0


def owns(ino: int) -> bool:
    """Whether inode *ino* is one of engines/."""
    return LIVE_BASE <= ino < LIVE_END


def base(key: int) -> InodeNo:
    """The first inode number of key *key* (its folder)."""
    return InodeNo(LIVE_BASE + key * SPAN)


class KernelCache:
    """Whether the kernel may keep anything of engines/, and having it forget
    what changed: the registry's engines and the sessions being copied in.

    Without an Invalidator (no mount: unit tests) the kernel keeps nothing
    and nothing is sent.
    """

    def __init__(self, invalidate: Invalidator | None):
        self.invalidate = invalidate

    @property
    def keeps(self) -> bool:
        """Whether attributes and names of engines/ may be kept (timeouts past 0)."""
        return self.invalidate is not None

    def engine_attached(self, name: str) -> None:
        if self.invalidate is not None:
            self.invalidate.inode(ENGINES_INO, True)     # (its link count)

    def engine_detached(self, name: str, last: bool) -> None:
        """Engine *name* went (*last*: no engine is left, so engines/ goes too)."""
        if self.invalidate is None:
            return
        self.invalidate.inode(ENGINES_INO, True)     # (its link count)
        self.invalidate.entry(ENGINES_INO, os.fsencode(name))
        if last:
            self.invalidate.entry(ROOT_INODE, ENGINES_NAME)

    def incoming_gone(self, engine_key: int, key: int, name: str, children: list[bytes]) -> None:
        """A session being copied in went (loaded, removed or failed): its folder
        *name* (key *key*, names *children* in it) in the engine of *engine_key*."""
        if self.invalidate is None:
            return
        folder = base(key)
        self.invalidate.inode(folder, True)    # (now a live session's folder, or gone)
        for child in children:
            self.invalidate.entry(folder, child)
        self.invalidate.entry(base(engine_key), os.fsencode(name))

    async def forget_pages(self, key: int, n: int) -> None:
        """The kernel forgets the attributes of pages 0..n-1 of the live session of
        key *key* (returns once it has: see LiveEngine.keep_page_attrs)."""
        if self.invalidate is not None:
            first = base(key) + PAGE_OFFSET
            await self.invalidate.attrs_now(range(first, first + n))

    async def settled(self) -> None:
        """Return once the kernel was sent every invalidation queued so far."""
        if self.invalidate is not None:
            await self.invalidate.settled()
