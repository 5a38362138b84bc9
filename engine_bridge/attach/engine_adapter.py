"""What an engine gives the agent to be attached (:class:`EngineAdapter`), and
the lock it steps under (:class:`StepLock`).  Each engine's adapter lives in
that engine's folder (engine_bridge.reference.reference_live,
engine_bridge.transformers.transformers_live)."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Protocol, Sequence

from engine_bridge.core.bridge import Bridge, SeqBlocks
from engine_bridge.core.pool import BlockId
from engine_bridge.transport.session_io import SessionSource


class StepLock:
    """A first-come, first-served lock the engine holds across each step.

    The agent takes it between steps to pin or unpin blocks, list sequences
    and page sessions in; being FIFO, a busy engine loop that takes it again
    at once cannot starve the agent (a plain Lock gives no such promise).
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> "StepLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class EngineAdapter(Protocol):
    """What the agent needs from an engine.

    ``lock`` is held by the engine across every step and every other change
    to its sequences, blocks or allocator; the agent calls ``sequences``,
    ``pin``, ``unpin`` and ``page_in`` only while holding it.  ``pin`` adds a
    reference to blocks so they are neither freed nor reused until
    ``unpin``; an engine that writes into a sequence's partly filled last
    block may do so while it is pinned (only slots past the pinned fill
    change, and those are zeroed in the page bytes), or copy it on write.
    """

    bridge: Bridge
    lock: AbstractContextManager

    def sequences(self) -> list[SeqBlocks]: ...

    def pin(self, blocks: Sequence[BlockId]) -> None: ...

    def unpin(self, blocks: Sequence[BlockId]) -> None: ...

    def page_in(self, source: SessionSource) -> list[str]: ...
