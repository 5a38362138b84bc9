"""The attached engines as the rest of pffs.live sees them: by name, by inode key, and their budgets.

The socket server (:mod:`.server`) registers engines here; an engine
(:mod:`.engines`) forgets itself here when it detaches; the FUSE view
(:mod:`.view`) finds engines and sessions here and charges the memory of
sessions being copied in against the limits here.  This module imports
nothing else of pffs.live: it is generic in the engine and entry types.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio

Engine = TypeVar("Engine")      # pffs.live.engines.LiveEngine
Entry = TypeVar("Entry")        # pffs.live.listings.SessionEntry

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

    def __init__(self, uid: int | None = None, gid: int | None = None, mountpoint: str = ""):
        #: where the mount is, for engines asked to save to or load from a path in it
        self.mountpoint = mountpoint
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        #: name -> LiveEngine (pffs.live.engines)
        self.engines: dict[str, Engine] = {}
        #: inode key -> LiveEngine or SessionEntry (see pffs.live.view for the numbering)
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
        #: the socket server's nursery while it serves (pffs.live.server)
        self.nursery: trio.Nursery | None = None
        #: called with an engine's name when it attaches (True) or detaches
        #: (False), after self.engines changed (pffs.live.view: what the
        #: kernel cached of engines/ goes)
        self.changed: Callable[[str, bool], None] = lambda name, attached: None
        #: called with (engine key, session key, session name, names in its
        #: folder) when a session being copied in goes: loaded, removed or
        #: failed (pffs.live.view: what the kernel cached of its folders goes)
        self.incoming_gone: Callable[[int, int, str, list[bytes]], None] = lambda *a: None
        #: awaited with (session, n) when the kernel may keep the attributes of
        #: pages 0..n-1 of a live session no longer (pffs.live.view: it
        #: forgets them; see pffs.live.listings.EngineSessions.keep_page_attrs)
        self.forget_pages: Callable[[Entry, int], Awaitable[None]] | None = None

    def new_key(self, obj: Engine | Entry) -> int:
        key = self._next_key
        self._next_key += 1
        self.keys[key] = obj
        return key

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        if self.nursery is not None:
            self.nursery.start_soon(fn, *args)
