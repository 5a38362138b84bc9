"""The daemon's end of an attached engine's connection: requests and their answers.

Every request carries an id, and the engine answers each (``re``) in any
order: :meth:`EngineLink.serve` reads the socket and hands each answer to
the request waiting for it, until the engine says ``bye``, the connection
ends or the engine's process exits.  State lives on the trio thread (code
between two awaits is atomic).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

import trio

from pffs.live.channel import TrioChannel
from pffs.live.errors import EngineError, EngineGone, EngineRefused
from pffs.live.protocol import ProtocolError

log = logging.getLogger("pffs.live")

REQUEST_TIMEOUT = 30.0      # an engine that does not answer a read in this long: EIO
# Errors of a connection that went away (a send to it fails with one of these).
GONE = (OSError, trio.ClosedResourceError, trio.BrokenResourceError)


class _Pending:
    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: dict[str, Any] | None = None


class EngineLink:
    """Requests to one engine over its connection, and messages sent without an answer."""

    def __init__(self, name: str, pid: int, chan: TrioChannel, nursery: trio.Nursery):
        self.name = name
        self.pid = pid
        self.chan = chan
        #: where messages sent without waiting go (the engine socket's nursery)
        self.nursery = nursery
        self.alive = True
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._pidfd: int | None = None
        self._exited = False

    def __repr__(self) -> str:
        return f"engine {self.name!r} (pid {self.pid})"

    async def request(self, op: str, *, timeout: float = REQUEST_TIMEOUT, fds: Sequence[int] = (),
                      **args: Any) -> dict[str, Any]:
        """Send a request and wait for its answer.

        EngineGone if the engine goes away first (at once, whatever the
        timeout), EngineRefused if it refuses, EngineError after *timeout*.
        """
        if not self.alive:
            raise EngineGone(f"engine {self.name} is gone")
        rid = self._next_id
        self._next_id += 1
        p = self._pending[rid] = _Pending()
        try:
            try:
                await self.chan.send({"op": op, "id": rid, **args}, fds)
            except GONE:
                raise EngineGone(f"engine {self.name} is gone") from None
            with trio.move_on_after(timeout):
                await p.event.wait()
        finally:
            del self._pending[rid]
        reply = p.reply
        if reply is None:
            if not self.alive:
                raise EngineGone(f"engine {self.name} is gone")
            log.error("%r did not answer %s within %.0f s", self, op, timeout)
            raise EngineError(f"engine {self.name} did not answer")
        if not reply.get("ok"):
            raise EngineRefused(int(reply.get("errno") or errno.EIO), str(reply.get("error") or "refused"))
        return reply

    async def send(self, msg: dict[str, Any]) -> None:
        """Send a message no answer is awaited for (GONE errors if the connection went)."""
        await self.chan.send(msg)

    def send_soon(self, msg: dict[str, Any]) -> None:
        """Send a message no answer is awaited for, in the background (lost if the connection went)."""
        async def send() -> None:
            try:
                await self.chan.send(msg)
            except GONE:
                pass
        self.nursery.start_soon(send)

    async def serve(self) -> tuple[str, bool]:
        """Hand answers to their requests until the connection ends (or the
        engine's process exits): why it ended, and whether that was clean."""
        why, clean = "the daemon is unmounting", True     # unless the connection ends first
        try:
            self._pidfd = os.pidfd_open(self.pid) if self.pid > 0 else None
        except OSError:
            self._pidfd = None
        async with trio.open_nursery() as nursery:
            if self._pidfd is not None:
                nursery.start_soon(self._watch_pid, self._pidfd, nursery.cancel_scope)
            why, clean = await self._read_replies()
            nursery.cancel_scope.cancel()
        if self._exited:
            why, clean = "the process exited", False
        return why, clean

    async def _watch_pid(self, pidfd: int, scope: trio.CancelScope) -> None:
        # The pidfd turns readable when the process exits: no waiting for a
        # socket another process may have inherited.
        await trio.lowlevel.wait_readable(pidfd)
        self._exited = True
        scope.cancel()

    async def _read_replies(self) -> tuple[str, bool]:
        while True:
            try:
                got = await self.chan.recv()
            except GONE as e:
                return f"connection error: {e}", False
            except ProtocolError as e:
                return f"protocol error: {e}", False
            if got is None:
                return "connection closed", False
            msg, fds = got
            for fd in fds:
                os.close(fd)
            if "re" in msg:
                p = self._pending.get(msg["re"])
                if p is not None:
                    p.reply = msg
                    p.event.set()
                elif msg.get("ok") and "snap" in msg:
                    # A snapshot whose request timed out: nobody will read it.
                    self.send_soon({"op": "release", "snap": msg["snap"]})
            elif msg.get("op") == "bye":
                return "detached", True
            else:
                log.warning("%r sent an unexpected message %r", self, str(msg.get("op"))[:40])

    def close(self) -> None:
        """No more requests: those waiting end (EngineGone), the connection closes."""
        self.alive = False
        for p in self._pending.values():
            p.event.set()
        self.chan.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
