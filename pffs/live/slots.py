"""Which pages of which snapshot sit in which slot of an engine's shared staging buffer.

The daemon owns the slots: the engine writes a slot only when asked to (a
``gather``), and the daemon asks only for slots it has claimed.  So a READY
slot's bytes stay put until the daemon evicts it.  All state changes run on
the trio thread; code between two awaits is atomic.

A slot is FREE, LOADING (claimed, a gather in flight) or READY (holds page
``key = (snapshot id, page index)``).  READY slots nobody holds (``busy``
zero) are kept in LRU order and are what a claim evicts.  Worker threads
(hashing) read a slot only while holding it.
"""

from __future__ import annotations

from collections import OrderedDict

import trio

from pffs.types import PageIndex

FREE, LOADING, READY = range(3)

Key = tuple[int, PageIndex]     # (snapshot id, page index)


class SlotCache:
    def __init__(self, n: int):
        self.n = n
        self.key: list[Key | None] = [None] * n
        self.state = [FREE] * n
        self.busy = [0] * n
        self.slot_of: dict[Key, int] = {}
        self._free = list(range(n - 1, -1, -1))
        self._idle: OrderedDict[int, None] = OrderedDict()
        #: pages being gathered now -> an event set when that gather ends (either way)
        self.loading: dict[Key, trio.Event] = {}
        #: snapshots whose pages may be kept; pages of others are dropped when idle
        self.live_snaps: set[int] = set()
        self._avail = trio.Event()

    def ready_slot(self, key: Key) -> int | None:
        """The slot holding *key*, marked recently used; None if it is not there."""
        s = self.slot_of.get(key)
        if s is None or self.state[s] != READY:
            return None
        if s in self._idle:
            self._idle.move_to_end(s)
        return s

    def claim(self, k: int) -> list[int]:
        """Up to *k* slots for a gather: free ones first, then the least recently used."""
        out: list[int] = []
        while len(out) < k and self._free:
            out.append(self._free.pop())
        while len(out) < k and self._idle:
            s, _ = self._idle.popitem(last=False)
            key = self.key[s]
            if key is not None:     # always: idle slots are READY
                del self.slot_of[key]
            self.key[s] = None
            out.append(s)
        for s in out:
            self.state[s] = LOADING
        return out

    async def claim_some(self, k: int) -> list[int]:
        """At least one slot (up to *k*), waiting while every slot is held or loading."""
        while True:
            got = self.claim(k)
            if got:
                return got
            ev = self._avail
            await ev.wait()

    def loaded(self, slots: list[int], keys: list[Key]) -> None:
        for s, key in zip(slots, keys):
            if key[0] not in self.live_snaps:
                self._to_free(s)
                continue
            self.state[s] = READY
            self.key[s] = key
            self.slot_of[key] = s
            if not self.busy[s]:
                self._idle[s] = None
        self._signal()

    def unclaim(self, slots: list[int]) -> None:
        for s in slots:
            self._to_free(s)
        self._signal()

    def hold(self, s: int) -> None:
        self.busy[s] += 1
        self._idle.pop(s, None)

    def unhold(self, s: int) -> None:
        self.busy[s] -= 1
        if self.busy[s] == 0 and self.state[s] == READY:
            key = self.key[s]
            if key is None or key[0] not in self.live_snaps:
                if key is not None:
                    self.slot_of.pop(key, None)
                self._to_free(s)
            else:
                self._idle[s] = None
        self._signal()

    def drop_snapshot(self, snap_id: int) -> None:
        """Forget a released snapshot's pages (held ones go when let go)."""
        self.live_snaps.discard(snap_id)
        for key, s in [(k, s) for k, s in self.slot_of.items() if k[0] == snap_id]:
            if not self.busy[s]:
                del self.slot_of[key]
                self._idle.pop(s, None)
                self._to_free(s)
        self._signal()

    def _to_free(self, s: int) -> None:
        self.state[s] = FREE
        self.key[s] = None
        self._free.append(s)

    def _signal(self) -> None:
        self._avail.set()
        self._avail = trio.Event()
