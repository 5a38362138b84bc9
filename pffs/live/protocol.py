"""The live-engine wire protocol: length-prefixed JSON messages over a Unix socket.

Only the standard library: the engine-side agent (engine_bridge.attach.agent) and
the daemon (pffs.live.server) both use it.  A message is a 4-byte
little-endian length and that many bytes of UTF-8 JSON (an object).  File
descriptors ride along as SCM_RIGHTS ancillary data on the message's first
bytes; page bytes never cross the socket, they sit in shared memory (memfd)
whose descriptor is passed once.

Conversation (agent A, daemon D)::

    A -> D  {"op": "register", "name", "pid", "geometry", "page_bytes", "dtype",
             "layout", "model", "kv", "engine", "slots"}  + fd: staging memfd
    D -> A  {"op": "registered", "ok": true, "path"} | {"ok": false, "errno", "error"}
    then D sends requests {"op", "id", ...}; A answers {"re": id, "ok": true, ...}
    or {"re": id, "ok": false, "errno", "error"}; A may send {"op": "bye"} and close.

Requests (D -> A):

- ``list``: the live session names -> ``{"sessions": [name, ...]}``.
- ``snapshot {session}``: pin the session's blocks -> ``{"snap", "manifest",
  "n_pages"}`` (the manifest with placeholder digests).
- ``gather {snap, pages: [[page_ix, slot], ...]}``: write those pages of a
  snapshot into staging slots (slot k = bytes k*page_bytes ..).
- ``store {snap, pages: [page_ix, ...]}`` (engines registered with
  ``"stores": true``): write those pages of a snapshot into the mount's
  local store as blobs, as a page-out does -> ``{"rows": [[page_ix, digest,
  raw_size, stored_size, codec], ...]}``; EOPNOTSUPP where the engine
  cannot use the store (the daemon then gathers and stores them itself).
- ``release {snap}``: unpin a snapshot (no answer).
- ``page_in {name, manifest, sizes}`` + fd: a memfd holding page i at
  i*page_bytes (``sizes[i]`` its file size); page it in as session *name*
  -> ``{"seqs": [...]}``.
- ``save {session, path}``: page the live session out as a new session at
  *path* (absolute, in the mount), the engine's bridge moving the bytes
  -> ``{"pages": n}``.
- ``load {name, path}``: page the session at *path* in as session *name*
  -> ``{"seqs": [...]}``.
"""

from __future__ import annotations

import array
import errno
import json
import os
import socket
import struct
import threading
from typing import Any, Protocol, TypeGuard

HEADER = struct.Struct("<I")
MAX_MESSAGE = 64 << 20      # a manifest with token ids stays far below this
MAX_FDS = 4
PROTOCOL_VERSION = 1
CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
# sun_path holds 108 bytes; longer socket paths are reached through /proc/self/fd.
_SUN_PATH_MAX = 100


class ProtocolError(Exception):
    """A peer sent something that is not a message of this protocol."""


class Refused(Exception):
    """The other side refused a request; ``errno`` says why, as a filesystem would."""

    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err


def valid_name(name: object) -> TypeGuard[str]:
    """Whether *name* can be an engine's or a session's folder name."""
    if not isinstance(name, str) or not name or name in (".", ".."):
        return False
    raw = name.encode("utf-8", "surrogateescape")
    return len(raw) <= 255 and b"/" not in raw and b"\0" not in raw and name.isprintable()


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    return msg


def fds_from_ancillary(ancdata) -> list[int]:
    """The descriptors of SCM_RIGHTS ancillary data (whole ints only)."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


def rights(fds) -> list:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", list(fds)))] if fds else []


class _Closable(Protocol):
    """A socket, the standard library's or trio's: what close_socket() needs of it."""

    def shutdown(self, how: int, /) -> None: ...
    def close(self) -> None: ...


class _HasSockopt(Protocol):
    """A socket, the standard library's or trio's: what peer_credentials() needs of it."""

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


def close_socket(sock: _Closable) -> None:
    """Shut down both directions (waking a reader blocked on it), then close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def peer_credentials(sock: _HasSockopt) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected *sock* (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class ShortPath:
    """A path usable as an AF_UNIX address whatever its length.

    Past the ``sun_path`` limit the folder is opened (O_PATH) and the
    address goes through ``/proc/self/fd/N/``; close() drops that descriptor.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self._fd = None
        if len(os.fsencode(path)) <= _SUN_PATH_MAX:
            self.address = path
        else:
            folder, name = os.path.split(os.path.abspath(path))
            self._fd = os.open(folder, os.O_PATH | os.O_CLOEXEC)
            self.address = f"/proc/self/fd/{self._fd}/{name}"

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> str:
        return self.address

    def __exit__(self, *exc) -> None:
        self.close()


class Channel:
    """Blocking message I/O on a connected Unix socket (the agent's side).

    ``send`` may be called from several threads at once (a lock keeps
    messages whole); ``recv`` from one thread only.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: dict[str, Any], fds=()) -> None:
        data = memoryview(encode(msg))
        with self._send_lock:
            # The descriptors travel with the first bytes; the rest follows.
            n = self.sock.sendmsg([data], rights(fds))
            if n < len(data):
                self.sock.sendall(data[n:])

    def _read(self, n: int, fds: list[int]) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk, anc, flags, _ = self.sock.recvmsg(n - len(buf), CMSG_SPACE,
                                                     getattr(socket, "MSG_CMSG_CLOEXEC", 0))
            fds.extend(fds_from_ancillary(anc))
            if flags & socket.MSG_CTRUNC:
                close_fds(fds)
                raise ProtocolError("too many file descriptors with one message")
            if not chunk:
                if buf:
                    raise ProtocolError("connection closed inside a message")
                return None
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next message and its descriptors, or None at end of stream."""
        fds: list[int] = []
        head = self._read(HEADER.size, fds)
        if head is None:
            close_fds(fds)
            return None
        (n,) = HEADER.unpack(head)
        if n > MAX_MESSAGE:
            close_fds(fds)
            raise ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
        body = self._read(n, fds)
        if body is None:
            close_fds(fds)
            raise ProtocolError("connection closed inside a message")
        try:
            return decode(body), fds
        except ProtocolError:
            close_fds(fds)
            raise

    def close(self) -> None:
        close_socket(self.sock)


def connect(path: str | os.PathLike, timeout: float | None = 10.0) -> socket.socket:
    """A socket connected to the daemon's engine socket at *path*.

    *path* may be the socket in the store folder or a mount's
    ``.pffs/engine.sock`` link to it.  PermissionError when the socket's mode
    keeps this user out; FileNotFoundError / ConnectionRefusedError when no
    daemon listens.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        with ShortPath(path) as address:
            sock.connect(address)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def register(chan: Channel, info: dict[str, Any], memfd: int, timeout: float = 30.0) -> dict[str, Any]:
    """Send the registration and wait for the daemon's answer (Refused if refused)."""
    try:
        chan.send({"op": "register", "version": PROTOCOL_VERSION, **info}, [memfd])
    except (BrokenPipeError, ConnectionResetError):
        pass    # refused before it read this: the answer is waiting
    chan.sock.settimeout(timeout)
    try:
        got = chan.recv()
    finally:
        chan.sock.settimeout(None)
    if got is None:
        raise Refused(errno.ECONNRESET, "the daemon closed the connection during registration")
    reply, fds = got
    close_fds(fds)
    if not reply.get("ok"):
        raise Refused(int(reply.get("errno") or errno.EPERM), str(reply.get("error") or "refused"))
    return reply
