"""Mount lifecycle: checks, store lock, pyfuse3 session, signals, clean unmount.

``pffs mount`` without ``-f`` starts this module as a detached process and
waits on a pipe until the mount is ready (or an error line arrives), so the
command returns 0 only once the filesystem answers.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from pffs import namespace
from pffs.daemon import heap
from pffs.daemon.mountpoint import check_mountpoint
from pffs.errors import PffsError
from pffs.fs.write_stage import journal_inode
from pffs.manifest import MAX_MANIFEST_BYTES
from pffs.names import FS_SUBTYPE
from pffs.namespace import prefix_index
from pffs.store.local import PutBatch
from pffs.store.storedir import StoreDir

if sys.version_info < (3, 11):  # a builtin from 3.11; trio brings the backport before it
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from pffs.bucket.lease import RemoteMount
    from pffs.daemon.handlers import Handlers
    from pffs.daemon.readonly import PrivateNamespace
    from pffs.fs.db import Database
    from pffs.live.server import LiveEngines
    from pffs.store.reserve import SpaceReserve

log = logging.getLogger("pffs.daemon.mount")

CHECKPOINT_INTERVAL = 30.0
SYNC_INTERVAL = 0.5
READ_AHEAD_KB = 1024


@dataclass
class MountOptions:
    allow_other: bool = False
    cache_size: int = 128 << 20
    max_size: int | None = None
    prefix_cache_size: int = 4 << 30  # bytes of pages the key-only prefix cache keeps (SPEC §7)
    codec: str | None = None
    verify: str | None = None  # what each read checks: crc32 (a local store's default) or sha256 (an S3 store's)
    staging_memory: int = 128 << 20
    snapshot_interval: float = 300.0
    snapshots_kept: int = 3
    sync: str = "batch"   # "batch": grouped blob fsyncs every SYNC_INTERVAL; "close": at every close
    reserve: int = 16 << 20  # disk space held back so deletions commit on a full disk (pffs.store.reserve)
    remote: dict = field(default_factory=dict)  # S3 client and lease options (pffs.store.s3.OPTIONS)
    read_only: bool = False  # -o ro: serves reads, changes nothing in the store (pffs.daemon.readonly)
    kernel_flags: list[str] = field(default_factory=list)  # of KERNEL_FLAGS, for the kernel's mount


# mount(8)'s flags that libfuse (3.14 on) hands the kernel's mount as given:
# mount.fuse3 adds dev and suid unless told nodev or nosuid (pffs mount alone:
# nodev,nosuid).
KERNEL_FLAGS = frozenset({"dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime", "dirsync"})
# Options that change nothing in pffs, taken so that an fstab line, systemd or
# habit (sshfs) may give them: mount(8)'s and systemd's own (auto, nofail,
# _netdev, user, ..., and x-* and comment=, below); what pffs always does
# (default_permissions); atime policies, as FUSE leaves atimes to pffs,
# which changes one only when told (touch -a).
IGNORED = frozenset({"defaults", "default_permissions", "auto", "noauto", "nofail", "_netdev", "user", "users",
                     "nouser", "owner", "group", "silent", "loud", "relatime", "norelatime", "strictatime",
                     "nostrictatime", "diratime", "nodiratime", "lazytime", "nolazytime"})
IGNORED_PREFIXES = ("x-", "comment=")


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise PffsError(f"bad size {text!r} (use e.g. 512M, 2G)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)])


def _s3_options() -> tuple[str, ...]:
    from pffs.store.s3 import OPTIONS
    return OPTIONS


def parse_options(opts: list[str]) -> MountOptions:
    """``-o`` options (each a comma-separated list): pffs's own, and those of
    mount(8) and fstab (KERNEL_FLAGS, IGNORED); PffsError naming one unknown."""
    o = MountOptions()
    for group in opts:
        for item in group.split(","):
            item = item.strip()
            if not item:
                continue
            key, _, val = item.partition("=")
            if key == "allow_other":
                o.allow_other = True
            elif key == "cache_size":
                o.cache_size = parse_size(val)
            elif key == "max_size":
                o.max_size = parse_size(val)
            elif key == "prefix_cache_size":
                o.prefix_cache_size = parse_size(val)
            elif key == "codec":
                from pffs.codec import parse_codec
                try:
                    parse_codec(val)
                except ValueError as e:
                    raise PffsError(str(e)) from None
                o.codec = val
            elif key == "verify":
                from pffs.store.local import VERIFY_MODES
                if val not in VERIFY_MODES:
                    raise PffsError(f"verify= takes {' or '.join(VERIFY_MODES)}")
                o.verify = val
            elif key == "staging_memory":
                o.staging_memory = parse_size(val)
            elif key == "sync" and "=" in item:
                if val not in ("batch", "close"):
                    raise PffsError("sync= takes batch or close")
                o.sync = val
            elif item in ("sync", "async"):
                # mount(8)'s: a close returns once its bytes are durable, or
                # (async, the default) within SYNC_INTERVAL.  Not the kernel's
                # flag, which would fsync at every write(2).
                o.sync = "close" if item == "sync" else "batch"
            elif item in ("ro", "rw"):
                o.read_only = item == "ro"
            elif item in KERNEL_FLAGS:
                o.kernel_flags.append(item)
            elif item in IGNORED or item.startswith(IGNORED_PREFIXES):
                pass
            elif key == "snapshot_interval":
                o.snapshot_interval = float(val)
            elif key == "reserve":
                o.reserve = parse_size(val)
            elif key in _s3_options():
                o.remote[key] = val
            else:
                raise PffsError(f"unknown mount option {key!r}")
    return o


def setup_logging(log_path: Path, foreground: bool) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s",
                            "%Y-%m-%d %H:%M:%S")
    fh = logging.FileHandler(log_path)
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if foreground:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    pyfuse_log = logging.getLogger("pyfuse3")
    pyfuse_log.setLevel(logging.INFO)
    pyfuse_log.addFilter(_abandoned_reply)


def _abandoned_reply(record: logging.LogRecord) -> bool:
    """A reply the kernel no longer waits for (ENOENT: the request was interrupted,
    or a release sent as its opener went away) is not an error of the filesystem."""
    if record.levelno >= logging.ERROR and "fuse_reply_* failed with No such file or directory" \
            in record.getMessage():
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True


def _connection_aborted(e: BaseException) -> bool:
    """Whether pyfuse3's session loop ended on ECONNABORTED from /dev/fuse (alone,
    or in exception groups)."""
    if isinstance(e, BaseExceptionGroup):
        return all(_connection_aborted(x) for x in e.exceptions)
    return isinstance(e, ConnectionAbortedError)


def snapshot_namespace(store: StoreDir, kept: int) -> None:
    """Copy the namespace database into snapshots/ (*kept* of them kept).

    From a connection of its own, in one read transaction (WAL): commits
    go on meanwhile; the copy is the database as of its start.
    """
    from pffs.maint.snapshots import take_snapshot
    try:
        conn = namespace.connect(store.db_path, readonly=True)
        try:
            take_snapshot(conn, store.snapshot_dir, kept)
        finally:
            conn.close()
    except (OSError, sqlite3.Error) as e:
        log.warning("namespace snapshot failed: %s", e)
    except Exception:
        log.exception("namespace snapshot failed")


class Daemon:
    """A mounted store: its parts, built whole by ``Daemon.open`` in the order
    they need one another, and its life: serving, periodic work, unmount."""

    def __init__(self, store: StoreDir, mountpoint: Path, opts: MountOptions, *, reserve: SpaceReserve,
                 db: Database, handlers: Handlers, live: LiveEngines, remote: RemoteMount | None,
                 journals: list[str], private: PrivateNamespace | None,
                 trim_heaps: Callable[[], None] | None):
        self.store = store
        self.mountpoint = mountpoint
        self.opts = opts
        self.reserve = reserve
        self.db = db
        self.handlers = handlers
        self.live = live              # the engine socket (engines/ is the handlers')
        self.remote = remote          # of an S3 store
        self.journals = journals      # fsynced bytes of the previous run, replayed before serving
        self.private = private        # a read-only mount's copy of the namespace (pffs.daemon.readonly)
        self.trim_heaps = trim_heaps  # (see heap.fix_malloc)

    @classmethod
    def open(cls, store: StoreDir, mountpoint: Path, opts: MountOptions, nursery: trio.Nursery, *,
             trim_heaps: Callable[[], None] | None = None) -> Daemon:
        """Check *mountpoint*, lock *store* and mount it there: every part built,
        each handed what it needs, its background work to run in *nursery*
        (opened first, by the caller).  PffsError, OSError or RuntimeError
        (pyfuse3.init) where the mount cannot be made.  *store* is the
        daemon's (``StoreDir(..., reserve=..., mounted=True)``)."""
        from pffs.store.reserve import free_bytes

        check_mountpoint(mountpoint)
        st = store
        ro = opts.read_only
        if ro and st.url is not None:
            raise PffsError("-o ro is for a local store (a mount of an S3 store keeps its lease in the bucket)")
        if not ro:
            st.create()
        # Each part that opens says in *undo* how it closes: a step that fails
        # closes, in reverse, what the steps before it opened.
        with contextlib.ExitStack() as undo:
            st.lock(f"pffs mount{' -o ro' if ro else ''} {mountpoint}")
            undo.callback(st.unlock)
            reserve = st.reserve
            if reserve is None:
                raise RuntimeError("a mount's store holds a reserve (StoreDir(..., reserve=...))")
            if not ro and opts.reserve > 0 and free_bytes(st.root) < opts.reserve // 4:
                reserve.release()  # mounting a full store: room to open the database and delete
            # A read-only mount serves a copy of the namespace (pffs.daemon.readonly).
            private = None
            if ro:
                from pffs.daemon.readonly import PrivateNamespace
                private = PrivateNamespace.copy(st)
                undo.callback(private.remove)
            db_root = st.root if private is None else private.folder
            daemon = cls._open(st, mountpoint, opts, nursery, undo, reserve=reserve, db_root=db_root,
                               private=private, trim_heaps=trim_heaps)
            undo.pop_all()      # built whole: Daemon.close closes it from now on
        return daemon

    @classmethod
    def _open(cls, st: StoreDir, mountpoint: Path, opts: MountOptions, nursery: trio.Nursery,
              undo: contextlib.ExitStack, *, reserve: SpaceReserve, db_root: Path,
              private: PrivateNamespace | None, trim_heaps: Callable[[], None] | None) -> Daemon:
        """Daemon.open's work once the store is locked; its namespace in *db_root*.
        What it opens, it closes through *undo* if a later step fails."""
        from pffs.daemon.handlers import build
        from pffs.fs import adoption as direct
        from pffs.fs.content import ContentStore, StoredBytes
        from pffs.fs.db import Database
        from pffs.fs.operations import SPIN, spin_us
        from pffs.live.server import LiveEngines

        ro = opts.read_only
        conn = namespace.open_db(db_root)
        try:
            with namespace.transaction(conn):
                n = namespace.cleanup_orphans(conn)
            if n:
                log.info("removed %d unlinked inodes left open by the previous run", n)
            if not prefix_index.is_built(conn):
                # (after a migration from schema 8: the keys need the manifests' bytes)
                with namespace.transaction(conn):
                    lists, keys = prefix_index.rebuild(conn, functools.partial(
                        namespace.read_file, conn, st.blobs, max_size=MAX_MANIFEST_BYTES))
                log.info("built the prefix index: %d keys of %d manifests", keys, lists)
            stored = namespace.stored_bytes(conn)
        finally:
            conn.close()
        # Spill files of the previous run: a journal file holds fsynced bytes
        # (replayed before serving); any other was never fsynced.
        journals = []
        for p in sorted(st.staging_dir.iterdir()) if st.staging_dir.is_dir() else ():
            if journal_inode(p.name) is not None:
                journals.append(str(p))
            elif not ro:
                p.unlink()
        if ro:
            if journals:
                log.warning("%d files fsynced by the previous run are not committed: a read-only mount "
                            "shows them as they were before; mount read-write once to commit them",
                            len(journals))
            journals = []
        else:
            for p in st.blobs.temp_files():
                p.unlink()
        db = Database(db_root / namespace.DB_NAME,
                      on_full=reserve.release if opts.reserve > 0 and not ro else None)
        undo.callback(db.close)
        if not ro:
            reserve.ensure()
        sync_on_close = opts.sync == "close" or st.url is not None
        pending = PutBatch()
        counted = StoredBytes(stored)
        threads = None
        cache_size = opts.cache_size
        remote = None
        blobs = st.blobs
        blobs.verify = opts.verify or ("sha256" if blobs.remote else "crc32")
        adopt: Callable[[Sequence[str]], Any]
        if blobs.remote:
            from pffs.bucket.lease import MEMORY_CACHE_MAX, attach
            # The registration in the bucket, before a request is served.
            remote = attach(st, db, cache_size=opts.cache_size, lease=opts.remote.get("lease"))
            undo.callback(remote.stop)      # (the registration then says "unmounted")
            adopt = remote.adopt
            # A close mostly waits on the network: as many at once as there are
            # upload threads (the CPU work in them is small).
            threads = max(2, os.cpu_count() or 2, blobs.threads)
            cache_size = min(cache_size, MEMORY_CACHE_MAX)
        else:
            # Pages an engine's bridge put beside the mount (pffs.fs.adoption).
            adopt = direct.LocalAdopter(db, blobs, counted, pending=None if sync_on_close else pending)
        content = ContentStore(blobs, st.staging_dir, db=db, threads=threads, max_size=opts.max_size,
                               sync_on_close=sync_on_close, pending=pending, stored=counted,
                               gc_lock=st.gc_lock, adopt=adopt, publisher=remote and remote.publisher)
        undo.callback(content.close)
        handlers = build(db, content, nursery=nursery, cache_size=cache_size,
                         staging_memory=opts.staging_memory, journal_fsync=st.url is None,
                         live_mount=str(mountpoint), socket_path=str(st.socket_path),
                         store_root=str(st.root),
                         store_json=direct.store_json(direct.store_info(st, opts.max_size, read_only=ro)),
                         read_only=ro, prefix_cache_size=opts.prefix_cache_size)
        undo.callback(handlers.stop)
        assert handlers.engines is not None     # (live_mount given)
        live = LiveEngines.listen(st.socket_path, handlers.engines.registry)
        undo.callback(live.close)
        fuse_opts = set(pyfuse3.default_options)
        fuse_opts |= {f"fsname=pffs:{st.root}", f"subtype={FS_SUBTYPE}", "default_permissions"}
        fuse_opts |= set(opts.kernel_flags)
        if ro:
            fuse_opts.add("ro")
        if opts.allow_other:
            fuse_opts.add("allow_other")
        pyfuse3.init(handlers.ops, str(mountpoint), fuse_opts)
        undo.callback(pyfuse3.close, unmount=True)
        if SPIN:
            pyfuse3.set_spin(spin_us() * 1000)
        log.info("mounted %s on %s%s (pid %d, reads verified by %s)", st.root, mountpoint,
                 " read-only" if ro else "", os.getpid(), blobs.verify)
        return cls(st, mountpoint, opts, reserve=reserve, db=db, handlers=handlers, live=live,
                   remote=remote, journals=journals, private=private, trim_heaps=trim_heaps)

    def _widen_readahead(self) -> None:
        """Let the kernel read ahead up to 1 MiB (a whole page file in one request).

        FUSE mounts start at 128 KiB; the knob is the mount's backing device in
        sysfs, writable by root only (others keep the default).
        """
        try:
            dev = os.stat(self.mountpoint).st_dev
            path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
            with open(path, "w") as f:
                f.write(str(READ_AHEAD_KB))
        except OSError as e:
            log.debug("read-ahead left at the default: %s", e)

    async def serve(self, nursery: trio.Nursery) -> None:
        """Serve FUSE requests, with the daemon's periodic work beside them in
        *nursery* (the one its parts were built with), until the kernel ends
        the session (an unmount, a signal); then cancel *nursery*."""
        nursery.start_soon(self.handlers.invalidate.run)
        nursery.start_soon(self._signals)
        if self.private is None:
            # (A read-only mount stores nothing: no blob to sync, no commit
            # to checkpoint or snapshot, no reserve to keep.)
            nursery.start_soon(self._periodic)
            nursery.start_soon(self._syncer)
        if self.trim_heaps is not None:
            nursery.start_soon(self._trim_heaps)
        # stat() of the mount needs the loop to answer: do it from a thread.
        nursery.start_soon(trio.to_thread.run_sync, self._widen_readahead)
        nursery.start_soon(self.live.serve)
        if self.journals:
            await self.handlers.files.replay_journals(self.journals)
        try:
            await pyfuse3.main()
        except BaseException as e:
            if not _connection_aborted(e):
                raise
            # The kernel ended the session (an abort through fusectl, or
            # one at unmount): what is staged is committed all the same.
            log.info("the kernel aborted the FUSE connection of %s: unmounting", self.mountpoint)
        nursery.cancel_scope.cancel()

    async def finish(self) -> None:
        """Once the nursery is done: commit what is staged, make the blobs durable."""
        # Unmounted, or unmounting: a SIGTERM from now on (systemd signalling
        # what is left of a mount unit's processes after its umount, or the
        # last round at shutdown) would only cut the commits and the snapshot
        # short.  (SIGKILL still ends a daemon that does not.)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        with trio.CancelScope(shield=True):
            await self.handlers.files.commit_all()
            await self.handlers.content.sync_pending()

    async def _syncer(self) -> None:
        """Blobs written by closes become durable within SYNC_INTERVAL, in groups."""
        while True:
            await trio.sleep(SYNC_INTERVAL)
            await self.handlers.content.sync_pending()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for sig in sigs:
                log.info("signal %d: unmounting", sig)
                pyfuse3.terminate()
                return

    async def _trim_heaps(self) -> None:
        assert self.trim_heaps is not None
        while True:
            await trio.sleep(heap.HEAP_TRIM_INTERVAL)
            await trio.to_thread.run_sync(self.trim_heaps)

    async def _periodic(self) -> None:
        content = self.handlers.content
        last_snapshot = time.monotonic()
        while True:
            await trio.sleep(CHECKPOINT_INTERVAL)
            # Blobs first: the checkpoint makes namespace rows durable.
            await content.sync_pending()
            try:
                await self.db.checkpoint()
                # gc frees blobs behind the daemon's back; a full disk may have
                # room again for the reserve.
                await trio.to_thread.run_sync(content.recounted, content.count_stored)
                await trio.to_thread.run_sync(self.reserve.ensure)
            except (OSError, sqlite3.Error) as e:
                log.warning("periodic checkpoint: %s", e)
            if time.monotonic() - last_snapshot >= self.opts.snapshot_interval:
                last_snapshot = time.monotonic()
                await trio.to_thread.run_sync(self.snapshot, limiter=self.db.limiter)

    def snapshot(self) -> None:
        """Copy the namespace database into snapshots/ (see snapshot_namespace)."""
        snapshot_namespace(self.store, self.opts.snapshots_kept)

    def close(self, unmount: bool) -> None:
        try:
            pyfuse3.close(unmount=unmount)
        except Exception:
            log.exception("closing the FUSE session")
        self.handlers.content.pending.sync()
        from pffs.fs.operations import TIMING
        for name, (n, total) in sorted((TIMING or {}).items(), key=lambda kv: -kv[1][1]):
            log.info("timing %-12s %8d calls %9.3f s %8.1f us/call", name, n, total, total / n * 1e6)
        if self.remote is not None:
            self.remote.stop()
        self.live.close()
        if self.private is None:
            self.snapshot()
        self.db.close()
        if self.private is not None:
            self.private.remove()
        self.store.unlock()
        log.info("unmounted %s", self.mountpoint)


async def mount_and_serve(store: StoreDir, mountpoint: Path, opts: MountOptions, *,
                          trim_heaps: Callable[[], None] | None, ready: Callable[[str], None]) -> None:
    """Mount *store* on *mountpoint* and serve it until it is unmounted: the
    nursery opened first, the daemon built whole in it (``Daemon.open``),
    ``ready("ok")`` said, requests served, staged bytes committed, unmounted.
    A mount that cannot be made says ``ready("error ...")`` and raises PffsError."""
    refused: BaseException | None = None
    daemon: Daemon | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                daemon = Daemon.open(store, mountpoint, opts, nursery, trim_heaps=trim_heaps)
            except (PffsError, OSError, RuntimeError) as e:
                refused = e     # (nothing runs in the nursery yet: it ends at once)
            else:
                ready("ok")
                await daemon.serve(nursery)
        if daemon is not None:
            await daemon.finish()
    except BaseException:
        if daemon is not None:
            log.exception("daemon main loop failed")
        raise
    finally:
        if daemon is not None:
            daemon.close(unmount=True)
    if refused is not None:
        log.error("mount %s failed: %s", mountpoint, refused)
        ready(f"error {refused}")
        store.unlock()
        raise PffsError(str(refused)) from None


def run(store_dir: str | None, mountpoint: str, opts: MountOptions, *, foreground: bool,
        ready_fd: int | None = None) -> int:
    trim_heaps = heap.fix_malloc()
    st = StoreDir(store_dir, opts.codec, remote=opts.remote, reserve=opts.reserve, mounted=True)
    mp = Path(mountpoint).absolute()

    def ready(msg: str) -> None:
        if ready_fd is not None:
            os.write(ready_fd, (msg + "\n").encode())
            os.close(ready_fd)

    try:
        st.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ready(f"error {st.root}: {e.strerror}")
        raise PffsError(f"{st.root}: {e.strerror}") from None
    setup_logging(st.log_path, foreground)
    # Worker threads (decoding, hashing) hold the GIL in short Python stretches
    # between C calls that release it: a short switch interval keeps the
    # FUSE loop's latency low while they run.
    sys.setswitchinterval(0.0005)
    faulthandler.enable(open(st.log_path, "a"))
    trio.run(functools.partial(mount_and_serve, st, mp, opts, trim_heaps=trim_heaps, ready=ready))
    return 0


def spawn(store_dir: str | None, mountpoint: str, raw_opts: list[str]) -> None:
    """Start a detached daemon and wait until its mount is ready (or it gives up)."""
    st = StoreDir(store_dir)
    try:
        st.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PffsError(f"{st.root}: {e.strerror}") from None
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "pffs.daemon.mount", "--store", str(st.root), "--ready-fd", str(w)]
    for o in raw_opts:
        cmd += ["-o", o]
    cmd.append(mountpoint)
    with open(st.log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, pass_fds=(w,), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=logf, env=heap.thp_environ())
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.readline().decode(errors="replace").strip()
    if text == "ok":
        return
    if text.startswith("error "):
        raise PffsError(text[6:])
    rc = proc.wait(30)
    raise PffsError(f"daemon exited with status {rc} before mounting (see {st.log_path})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pffs-daemon")
    ap.add_argument("--store")
    ap.add_argument("-o", action="append", default=[])
    ap.add_argument("--ready-fd", type=int)
    ap.add_argument("mountpoint")
    args = ap.parse_args(argv)
    try:
        opts = parse_options(args.o)
        return run(args.store, args.mountpoint, opts, foreground=False, ready_fd=args.ready_fd)
    except PffsError as e:
        print(f"pffs mount: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
