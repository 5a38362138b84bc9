"""The attached engines as the rest of pffs.live sees them: by name, by inode key, and their budgets.

The socket server (:mod:`.server`) registers engines here; an engine
(:mod:`.engines`) forgets itself here when it detaches; the FUSE tree
(:mod:`.view`) finds engines and sessions here and charges the memory of
sessions being copied in against the limits here.  Of the rest of
pffs.live this module imports only the numbering (:mod:`.numbering`): it
is generic in the engine and entry types.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio

from pffs.live.numbering import KernelCache

Engine = TypeVar("Engine")      # pffs.live.engines.LiveEngine
Entry = TypeVar("Entry")        # pffs.live.engines.SessionEntry

INCOMING_LIMIT = 2 << 30    # bytes of sessions being copied into engines, all engines together


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


class LiveRegistry(Generic[Engine, Entry]):
    """Every attached engine, the inode keys of engines and sessions, and what they hold."""

    def __init__(self, cache: KernelCache, *, uid: int | None = None, gid: int | None = None,
                 mountpoint: str = ""):
        #: what the kernel may keep of engines/: told when an engine attaches or
        #: detaches, a session being copied in goes, or a live session's page
        #: attributes may be kept no longer
        self.cache = cache
        #: where the mount is, for engines asked to save to or load from a path in it
        self.mountpoint = mountpoint
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        #: name -> LiveEngine (pffs.live.engines)
        self.engines: dict[str, Engine] = {}
        #: inode key -> LiveEngine or SessionEntry (see pffs.live.numbering)
        self.keys: dict[int, Engine | Entry] = {}
        self._next_key = 1
        self.incoming_bytes = 0
        #: work done for live snapshots, in stats.json's ``live``: snapshots
        #: taken, pages gathered from engines, pages hashed for a manifest.json,
        #: pages stored as blobs for copies out of engines/ (and of those, the
        #: pages the engine stored itself, in how many ``store`` requests)
        self.counts = {"snapshots": 0, "pages_gathered": 0, "pages_hashed": 0, "pages_stored": 0,
                       "pages_stored_by_engine": 0, "store_requests": 0}
        self.hash_limiter = trio.CapacityLimiter(2)

    def new_key(self, obj: Engine | Entry) -> int:
        key = self._next_key
        self._next_key += 1
        self.keys[key] = obj
        return key

    def add_engine(self, name: str, engine: Engine) -> None:
        """Engine *name* attached: listed in engines/ from now on."""
        self.engines[name] = engine
        self.cache.engine_attached(name)

    def remove_engine(self, name: str, engine: Engine) -> None:
        """Engine *name* detached: its folder goes (if it is still this engine's)."""
        if self.engines.get(name) is engine:
            del self.engines[name]
            self.cache.engine_detached(name, not self.engines)
