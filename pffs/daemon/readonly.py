"""A read-only mount (``-o ro``): the namespace it serves, a private copy.

A read-only mount changes nothing in its store's namespace or blobs: the
kernel mounts it read-only (EROFS for every change a client asks) and the
handlers refuse changes too (``Operations.read_only``).  Reading still
writes SQLite rows now and then (a folded fork is unfolded when something
first looks into its ``pages/``), so the daemon serves a copy of
``namespace.db`` made when it mounts, in a folder of its own under
``$TMPDIR`` (default ``/tmp``), removed at unmount; a copy left by a killed
daemon is removed by the next read-only mount.  The copy is migrated to
this pffs's schema where the store's is older: a read-only mount of an old
store leaves it old.

What such a daemon still writes in the store folder: its lock (``lock``,
which names it), its log (``pffs.log``) and the engine socket
(``engine.sock``, removed at unmount); gc beside it takes ``gc.lock`` as
ever.  It takes no snapshot, keeps no reserve, replays no fsync journal
(it says how many it left), and cleans nothing in ``staging/``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sqlite3
import tempfile
import urllib.parse
from pathlib import Path

from pffs import namespace
from pffs.errors import PffsError
from pffs.store.storedir import StoreDir

log = logging.getLogger("pffs.daemon.mount")

PREFIX = "pffs-ro-"
_LEFT = re.compile(re.escape(PREFIX) + r"(\d+)-")


class PrivateNamespace:
    """A copy of a store's namespace.db, the daemon's alone (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder

    @property
    def db_path(self) -> Path:
        return self.folder / namespace.DB_NAME

    @classmethod
    def copy(cls, store: StoreDir) -> PrivateNamespace:
        """Copy *store*'s namespace (the caller holds the store's lock)."""
        src = store.db_path
        if not src.exists():
            raise PffsError(f"{store.root}: no pffs store here (a read-only mount needs one)")
        tmp = Path(tempfile.gettempdir())
        _remove_left_copies(tmp)
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmp))
        copy = cls(folder)
        try:
            # gc beside the mount commits under its lock held exclusively: with
            # it held here, no commit is under way while the database is read.
            with store.gc_lock.exclusive():
                _backup(src, copy.db_path)
        except BaseException:
            copy.remove()
            raise
        return copy

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _backup(src: Path, dest: Path) -> None:
    """SQLite's backup of *src* into *dest*, leaving *src*'s folder as it was.

    A read-only connection to a database in WAL mode makes its -wal and -shm
    files where they are missing, as they are after a clean unmount; then
    the database file holds every commit, and it is read as immutable.
    """
    wal = Path(f"{src}-wal")
    try:
        pending = wal.stat().st_size > 0
    except FileNotFoundError:
        pending = False
    query = "mode=ro" if pending else "immutable=1"
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(str(src))}?{query}", uri=True)
        try:
            out = sqlite3.connect(dest)
            try:
                conn.backup(out)
            finally:
                out.close()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise PffsError(f"{src}: cannot be read ({e}); pffs check tells what is wrong") from None


def _remove_left_copies(tmp: Path) -> None:
    """Copies left by read-only daemons of this user that are gone (killed)."""
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return
    for ent in entries:
        m = _LEFT.match(ent.name)
        if m is None or not ent.is_dir(follow_symlinks=False):
            continue
        try:
            if ent.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            log.info("removing %s, the namespace copy of a read-only mount that is gone", ent.path)
            shutil.rmtree(ent.path, ignore_errors=True)
        except OSError:
            continue
