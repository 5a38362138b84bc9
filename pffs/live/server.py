"""The engine socket: who may attach, under which name, with what staging buffer.

``STORE/engine.sock`` (mode 0600) is created when the daemon mounts and
removed at unmount.  A connecting process is checked by its credentials
(SO_PEERCRED): the daemon's own uid and root may attach, others are refused.
Then it registers: a free name, the geometry of its pages, and a memfd of
staging slots (sealed against shrinking, so the daemon never faults on it).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import socket
import stat
import time
from pathlib import Path

import trio

from pffs import manifest as mf
from pffs.live.channel import TrioChannel
from pffs.live.engines import LiveEngine, Registry
from pffs.live.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    ShortPath,
    close_fds,
    peer_credentials,
    valid_name,
)
from pffs.live.registry import Registration

log = logging.getLogger("pffs.live")

HANDSHAKE_TIMEOUT = 10.0
MAX_STAGING = 4 << 30
REAP_INTERVAL = 1.0


class LiveEngines:
    """The socket engines attach through: who may attach, registering them into the registry."""

    def __init__(self, socket_path: Path, sock: socket.socket, sock_ino: tuple[int, int], registry: Registry):
        self.socket_path = socket_path
        self.registry = registry
        self._sock = sock                   # listening (listen() made it)
        self._sock_ino = sock_ino           # (device, inode) of the socket file: see close()

    # -- socket ---------------------------------------------------------------

    @classmethod
    def listen(cls, socket_path: str | os.PathLike, registry: Registry) -> LiveEngines:
        """The socket, created (0600): bound under a temporary name, then renamed into place."""
        path = Path(socket_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        for p in (tmp, path):
            try:
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    os.unlink(p)    # left by a daemon that died; the store lock is ours
            except FileNotFoundError:
                pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with ShortPath(tmp) as address:
                sock.bind(address)
            os.chmod(tmp, 0o600)
            os.rename(tmp, path)
            sock.listen(16)
        except BaseException:
            sock.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        st = os.lstat(path)
        return cls(path, sock, (st.st_dev, st.st_ino), registry)

    def close(self) -> None:
        """Remove the socket (only if it is still the one this daemon made)."""
        self._sock.close()
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._sock_ino:
                os.unlink(self.socket_path)
        except OSError:
            pass

    async def serve(self) -> None:
        """Accept engines until cancelled (the daemon's nursery runs this)."""
        lsock = trio.socket.from_stdlib_socket(self._sock)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reaper)
                while True:
                    conn, _ = await lsock.accept()
                    nursery.start_soon(self._attach, conn, nursery)
        finally:
            lsock.close()
            for eng in list(self.registry.engines.values()):
                eng.detach("the daemon is unmounting", True)

    async def _reaper(self) -> None:
        while True:
            await trio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for eng in list(self.registry.engines.values()):
                eng.reap(now)

    # -- attaching ---------------------------------------------------------------

    async def _attach(self, sock: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        chan = TrioChannel(sock)
        engine = None
        try:
            engine = await self._register(chan, nursery)
        finally:
            if engine is None:
                chan.close()
        if engine is not None:
            await engine.run()

    async def _refuse(self, chan: TrioChannel, err: int, why: str, pid: int, uid: int) -> None:
        log.warning("engine socket: refused pid %d (uid %d): %s", pid, uid, why)
        try:
            await chan.send({"op": "registered", "ok": False, "errno": err, "error": why})
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def _register(self, chan: TrioChannel, nursery: trio.Nursery) -> LiveEngine | None:
        """The engine on *chan* registered (its work in the background going to
        *nursery*), or None where it was refused."""
        pid, uid, gid = peer_credentials(chan.sock)
        if uid not in (self.registry.uid, 0):
            await self._refuse(chan, errno.EACCES, f"only uid {self.registry.uid} (or root) may attach",
                               pid, uid)
            return None
        got = None
        with trio.move_on_after(HANDSHAKE_TIMEOUT):
            try:
                got = await chan.recv()
            except (OSError, ProtocolError) as e:
                log.warning("engine socket: pid %d: %s", pid, e)
                return None
        if got is None:
            log.warning("engine socket: pid %d connected but did not register", pid)
            return None
        msg, fds = got
        try:
            reg, shm = self._check(msg, fds, pid, uid, gid)
        except ProtocolError as e:
            close_fds(fds)
            await self._refuse(chan, errno.EINVAL, str(e), pid, uid)
            return None
        close_fds(fds)
        if reg.name in self.registry.engines:
            shm.close()
            other = self.registry.engines[reg.name]
            await self._refuse(chan, errno.EEXIST, f"the name {reg.name!r} is taken by pid {other.reg.pid}",
                               pid, uid)
            return None
        engine = LiveEngine(self.registry, reg, chan, shm, nursery)
        self.registry.add_engine(reg.name, engine)
        try:
            await chan.send({"op": "registered", "ok": True, "version": PROTOCOL_VERSION,
                             "live_path": f"engines/{reg.name}"})
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            engine.detach("it left during registration", True)
            return None
        g = reg.geometry
        log.info("engine %s attached (pid %d, uid %d): %d layers x %d heads x %d, %s, %d-token "
                 "pages of %d bytes, %d staging slots", reg.name, pid, uid, g["n_layers"],
                 g["n_heads"], g["head_dim"], g["dtype"], g["page_size_tokens"], reg.page_bytes,
                 reg.slots)
        return engine

    def _check(self, msg: dict, fds: list[int], pid: int, uid: int, gid: int
               ) -> tuple[Registration, mmap.mmap]:
        """A registration message's fields and staging memfd, or ProtocolError saying what is wrong."""
        if msg.get("op") != "register":
            raise ProtocolError("the first message must register")
        if msg.get("version") != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.get('version')!r}, this daemon speaks {PROTOCOL_VERSION}")
        name = msg.get("name")
        if not valid_name(name):
            raise ProtocolError(f"{str(name)[:60]!r} is not usable as a folder name")
        geo = msg.get("geometry")
        if not isinstance(geo, dict):
            raise ProtocolError("geometry missing")
        try:
            geometry = {k: geo[k] for k in ("page_size_tokens", "n_layers", "n_heads", "head_dim", "dtype")}
            pb = mf.page_bytes(**geometry)
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad geometry: {e}") from None
        if not all(isinstance(geometry[k], int) and geometry[k] > 0
                   for k in ("page_size_tokens", "n_layers", "n_heads", "head_dim")):
            raise ProtocolError("geometry fields must be positive integers")
        if msg.get("page_bytes") != pb:
            raise ProtocolError(f"page_bytes {msg.get('page_bytes')!r} does not match the geometry ({pb})")
        slots = msg.get("slots")
        if not isinstance(slots, int) or slots < 2:
            raise ProtocolError("at least two staging slots are needed")
        if len(fds) != 1:
            raise ProtocolError("the registration must carry one staging memfd")
        fd = fds[0]
        size = slots * pb
        if size > MAX_STAGING:
            raise ProtocolError(f"a staging buffer of {size} bytes exceeds {MAX_STAGING}")
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise ProtocolError(f"the staging descriptor is not a memfd: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise ProtocolError(f"the staging memfd holds {st.st_size} bytes, {slots} slots need {size}")
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ProtocolError("the staging memfd must be sealed against shrinking")
        shm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        info = {k: msg.get(k) for k in ("layout", "model", "kv", "engine", "num_blocks", "warms", "stores")}
        return Registration(name, pid, uid, gid, geometry, pb, slots, info), shm
