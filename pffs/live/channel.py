"""The daemon's end of a live-engine connection: protocol messages on a trio socket."""

from __future__ import annotations

import socket
from typing import Any

import trio

from pffs.live.protocol import (
    CMSG_SPACE,
    HEADER,
    MAX_MESSAGE,
    ProtocolError,
    close_fds,
    close_socket,
    decode,
    encode,
    fds_from_ancillary,
    rights,
)


class TrioChannel:
    """Message I/O that never blocks the event loop.

    Sends from several tasks are serialised by a lock (a message is written
    whole); one task receives.
    """

    def __init__(self, sock: trio.socket.SocketType):
        self.sock = sock
        self._send_lock = trio.Lock()

    async def send(self, msg: dict[str, Any], fds=()) -> None:
        data = memoryview(encode(msg))
        async with self._send_lock:
            n = await self.sock.sendmsg([data], rights(fds))
            while n < len(data):
                data = data[n:]
                n = await self.sock.send(data)

    async def _read(self, n: int, fds: list[int]) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk, anc, flags, _ = await self.sock.recvmsg(n - len(buf), CMSG_SPACE,
                                                           getattr(socket, "MSG_CMSG_CLOEXEC", 0))
            fds.extend(fds_from_ancillary(anc))
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("too many file descriptors with one message")
            if not chunk:
                if buf:
                    raise ProtocolError("connection closed inside a message")
                return None
            buf += chunk
        return bytes(buf)

    async def recv(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next message and the descriptors that came with it; None at end of stream."""
        fds: list[int] = []
        try:
            head = await self._read(HEADER.size, fds)
            if head is None:
                close_fds(fds)
                return None
            (n,) = HEADER.unpack(head)
            if n > MAX_MESSAGE:
                raise ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
            body = await self._read(n, fds)
            if body is None:
                raise ProtocolError("connection closed inside a message")
            return decode(body), fds
        except BaseException:
            close_fds(fds)
            raise

    def close(self) -> None:
        close_socket(self.sock)
