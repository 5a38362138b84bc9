"""A store directory: blobs, namespace database, log, lock, sockets.

Layout (``--store DIR``, else ``$PFFS_STORE``, else ``~/.local/share/pffs``)::

    DIR/blobs/<2 hex>/<64 hex>   blob frames (pffs.store.local)
    DIR/namespace.db             SQLite namespace (pffs.namespace), WAL mode
    DIR/snapshots/               copies of namespace.db (newest last)
    DIR/staging/                 spill files of open files being written
    DIR/pffs.log                 daemon log
    DIR/lock                     flock held by the daemon (and by check/repair, offline gc)
    DIR/gc.lock, DIR/gc.intent   flocks that order gc against writers reusing blobs
    DIR/pins/                    blobs a writer outside the daemon relies on until its commit
    DIR/reserve                  space kept back for deletions on a full disk (pffs.store.reserve)
    DIR/damaged/                 corrupt blobs set aside by readers and ``pffs check --repair``
    DIR/engine.sock              live-engine socket while mounted
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import threading
from pathlib import Path
from typing import Iterator

from pffs import codec as codec_mod
from pffs.errors import PffsError
from pffs.names import SOCKET_NAME
from pffs.namespace import KnownBlobs
from pffs.store.local import DAMAGED_DIR, LocalBlobStore
from pffs.store.reserve import SpaceReserve

LOCK_NAME = "lock"
LOG_NAME = "pffs.log"
STAGING_DIR = "staging"
SNAPSHOT_DIR = "snapshots"
GC_LOCK_NAME = "gc.lock"
GC_INTENT_NAME = "gc.intent"
PINS_DIR = "pins"
RESERVE_NAME = "reserve"


class StoreBusy(PffsError):
    pass


def default_store_dir() -> Path:
    env = os.environ.get("PFFS_STORE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "pffs"


class StoreDir:
    """A store's folder and the blob store it opens.

    A mounting daemon's (*reserve*, *mounted*): it keeps *reserve* bytes back
    on the store's disk (``reserve``, pffs.store.reserve), which puts do not
    eat into (unless 0); and an S3 store asks the namespace whether it has a
    blob's row before a small upload (a HEAD may then spare it).
    """

    def __init__(self, root: str | os.PathLike | None = None, codec: str | None = None, *,
                 cache: str | os.PathLike | None = None, remote: dict | None = None,
                 reserve: int | None = None, mounted: bool = False):
        # An s3:// URL keeps blobs in a bucket and everything else in a local
        # cache folder (--cache, else one per URL); a folder bound to a URL
        # (its remote.json) opens that bucket again (pffs.store.s3).
        from pffs.store import s3
        self.url = s3.url_of(root)
        if self.url is not None:
            root = cache if cache is not None else s3.default_cache_dir(self.url)
        self.root = Path(root) if root is not None else default_store_dir()
        self.root = self.root.expanduser().absolute()
        codec = codec or codec_mod.DEFAULT_CODEC
        self.reserve = SpaceReserve(self.reserve_path, reserve) if reserve is not None else None
        held = self.reserve if reserve else None
        likely_stored = KnownBlobs(self.db_path) if mounted else None
        self.blobs: s3.S3BlobStore | LocalBlobStore = (
            s3.open_remote(self.root, self.url, remote, codec=codec, reserve=held, likely_stored=likely_stored)
            or LocalBlobStore(self.root, codec, reserve=held))
        if self.url is None and self.blobs.remote:
            self.url = self.blobs.url
        self._lock_fd: int | None = None

    @property
    def db_path(self) -> Path:
        return self.root / "namespace.db"

    @property
    def log_path(self) -> Path:
        return self.root / LOG_NAME

    @property
    def staging_dir(self) -> Path:
        return self.root / STAGING_DIR

    @property
    def snapshot_dir(self) -> Path:
        return self.root / SNAPSHOT_DIR

    @property
    def socket_path(self) -> Path:
        return self.root / SOCKET_NAME

    @property
    def reserve_path(self) -> Path:
        return self.root / RESERVE_NAME

    @property
    def damaged_dir(self) -> Path:
        return self.root / DAMAGED_DIR

    @property
    def gc_lock(self) -> "GcLock":
        return GcLock(self.root)

    def exists(self) -> bool:
        return self.db_path.exists()

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.blobs.create_dirs()
        self.staging_dir.mkdir(exist_ok=True)
        self.snapshot_dir.mkdir(exist_ok=True)
        (self.root / PINS_DIR).mkdir(exist_ok=True)

    def lock(self, what: str) -> None:
        """Take the store's exclusive lock (StoreBusy if another process has it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreBusy(f"store {self.root} is in use ({holder or 'another process'})") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{what} pid {os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def in_use(self) -> str | None:
        """Who holds the lock, or None if nobody does."""
        try:
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        finally:
            os.close(fd)
        return None


class _Closer:
    def __init__(self, fds: tuple[int, ...]):
        self.fds = fds

    def __del__(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


class GcLock:
    """Orders gc's sweep against writers that find a blob stored and name it.

    A writer holds the lock shared from "is this blob stored?" until the
    commit that names it; gc holds it exclusively while it re-checks and
    deletes.  So gc never removes a blob between a writer's existence check
    and its commit, and a writer never reuses a blob that gc is removing.
    ``gc.intent`` gives gc priority: writers pass through it shared before
    taking the lock, so a stream of overlapping writers cannot starve gc.

    flock belongs to an open file description, so threads of one process
    must not share one: each thread taking the lock shared keeps its own
    pair of descriptors (a writer's commit takes it once per file), and
    each exclusive section opens its own.  The two files are never removed.

    A writer that must let go of the lock before its commit (an engine's
    bridge, whose commit is a close through the mount: the daemon's commit
    thread passes through ``gc.intent``, which a waiting gc holds) *pins* its
    blobs instead (:meth:`pin`): it adds their digests to a pin file under
    ``pins/`` while it holds the lock shared, and keeps the file's flock
    until it has committed.  gc reads every pin file inside its exclusive
    section and keeps the pinned blobs; a pin file whose flock nobody holds
    (its writer died) is removed there.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._mine = threading.local()

    def _open(self, name: str) -> int:
        return os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _thread_fds(self) -> tuple[int, int]:
        fds = getattr(self._mine, "fds", None)
        if fds is None:
            fds = self._mine.fds = (self._open(GC_INTENT_NAME), self._open(GC_LOCK_NAME))
            # Closed with the thread's other locals when the thread ends.
            self._mine.closer = _Closer(fds)
        return fds

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        intent, fd = self._thread_fds()
        depth = getattr(self._mine, "depth", 0)
        if depth == 0:
            fcntl.flock(intent, fcntl.LOCK_SH)
            fcntl.flock(intent, fcntl.LOCK_UN)
            fcntl.flock(fd, fcntl.LOCK_SH)
        self._mine.depth = depth + 1
        try:
            yield
        finally:
            self._mine.depth = depth
            if depth == 0:
                fcntl.flock(fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def shared_if_free(self) -> Iterator[bool]:
        """``shared()`` that never waits, for the event loop: yields True with the
        lock held, or False (nothing held) where gc holds it or waits for it."""
        intent, fd = self._thread_fds()
        depth = getattr(self._mine, "depth", 0)
        if depth == 0:
            try:
                fcntl.flock(intent, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                held = False
            else:
                fcntl.flock(intent, fcntl.LOCK_UN)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    held = False
            if not held:
                yield False
                return
        self._mine.depth = depth + 1
        try:
            yield True
        finally:
            self._mine.depth = depth
            if depth == 0:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def hold_shared(self) -> "SharedHold":
        """The lock taken shared until ``release()``, on descriptors of its own
        (so any thread may release it)."""
        return SharedHold(self._open(GC_INTENT_NAME), self._open(GC_LOCK_NAME))

    def pin(self) -> "PinFile":
        """A new pin file of this process (see the class docstring)."""
        return PinFile(self.root / PINS_DIR)

    def pinned(self) -> set[str]:
        """Digests pinned by live writers; removes the pin files of dead ones.

        Called by gc inside its exclusive section, so no pin is being added.
        """
        out: set[str] = set()
        try:
            entries = list(os.scandir(self.root / PINS_DIR))
        except FileNotFoundError:
            return out
        for ent in entries:
            try:
                fd = os.open(ent.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    with os.fdopen(os.dup(fd), "r", encoding="ascii", errors="replace") as f:
                        out.update(line.strip() for line in f if line.strip())
                    continue
                os.unlink(ent.path)  # nobody holds it: its writer is gone
            finally:
                os.close(fd)
        return out

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        intent = self._open(GC_INTENT_NAME)
        try:
            fcntl.flock(intent, fcntl.LOCK_EX)
            fd = self._open(GC_LOCK_NAME)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)
        finally:
            os.close(intent)


class PinFile:
    """Digests one writer relies on until its commit: ``pins/<pid>-<random>``.

    The writer holds the file's flock for its whole life, so gc tells a live
    pin from one left by a killed writer.  Add digests only while holding
    the gc lock shared (``GcLock.shared``): then gc's exclusive section sees
    either the pin or a blob the writer has not yet looked for.
    """

    def __init__(self, folder: Path):
        folder.mkdir(exist_ok=True)
        self.path = folder / f"{os.getpid()}-{secrets.token_hex(6)}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                           0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._lock = threading.Lock()

    def add(self, digests) -> None:
        data = "".join(f"{d}\n" for d in digests).encode()
        with self._lock:
            if self._fd < 0:
                raise ValueError("pin file closed")
            os.write(self._fd, data)

    def close(self) -> None:
        """Unpin: the writer has committed (or given up)."""
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


class SharedHold:
    """The gc lock held shared by one writer (see GcLock.hold_shared)."""

    def __init__(self, intent: int, fd: int):
        try:
            fcntl.flock(intent, fcntl.LOCK_SH)
            fcntl.flock(intent, fcntl.LOCK_UN)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(intent)
            os.close(fd)
            raise
        os.close(intent)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
