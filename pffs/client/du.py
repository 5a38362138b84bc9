"""``pffs du``: how much sessions and folders of a mounted pffs share, and what
removing them would give back, read from the mount's namespace.

Each PATH is looked up through the mount (one ``stat`` of it and of its
folder: its inode number and the entry naming it), then measured in the
mount's namespace (``pffs.namespace.usage``), which this process opens read
only beside the daemon: SQLite in WAL mode lets a reader take a consistent
snapshot without holding up the daemon's writer, and no page, and no name
below PATH, passes through FUSE.  (The daemon answers FUSE requests on one
thread; a walk of a large folder there would hold them all up.)
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pffs import namespace as ns
from pffs.client.fork import mount_root
from pffs.client.mounted import daemon_info
from pffs.errors import PffsError
from pffs.names import CONTROL_DIR, ENGINES_DIR
from pffs.namespace.usage import Place, PlaceMoved, Usage, usage_of


@dataclass
class Target:
    """A PATH as the user gave it, the mount holding it and its place in that mount's namespace."""

    path: str
    mount: str
    place: Place


def target(path: str) -> Target:
    """Where *path* is: a file or folder of a mounted pffs's namespace (else PffsError)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise PffsError(f"{path}: {e.strerror.lower() if e.strerror else e}") from None
    root = mount_root(real)
    if root is None or os.stat(root).st_dev != st.st_dev:
        raise PffsError(f"{path}: not in a mounted pffs")
    top = os.path.relpath(real, root).split(os.sep)[0]
    if top == ENGINES_DIR:
        raise PffsError(f"{path}: in {ENGINES_DIR}/, live engines' sessions: not stored (copy one out first)")
    if top == CONTROL_DIR:
        raise PffsError(f"{path}: in {CONTROL_DIR}/, which pffs makes up: not stored")
    if real == root:
        return Target(path, root, Place(ns.ROOT_INODE, None, None))
    parent = os.stat(os.path.dirname(real)).st_ino
    return Target(path, root, Place(st.st_ino, parent, os.fsencode(os.path.basename(real))))


def open_namespace(mount: str) -> sqlite3.Connection:
    """A read-only connection to the namespace of the store mounted at *mount*."""
    store = daemon_info(Path(mount)).get("store")
    if not store:
        raise PffsError(f"{mount}: the daemon does not name its store")
    db = Path(store) / ns.DB_NAME
    if not os.access(db, os.R_OK):
        raise PffsError(f"{mount}: cannot read its namespace {db} as uid {os.getuid()}"
                        " (pffs du reads it beside the daemon: run it as the mount's owner)")
    try:
        return ns.open_db(store, create_missing=False, readonly=True)
    except sqlite3.Error as e:
        raise PffsError(f"{mount}: cannot read its namespace {db}: {e}") from None


def _measure(conn: sqlite3.Connection, targets: list[Target]) -> Usage:
    try:
        return usage_of(conn, [t.place for t in targets])
    except PlaceMoved as e:
        moved = next(t for t in targets if t.place == e.place)
        raise PffsError(f"{moved.path}: changed while measured (renamed or removed); try again") from None


def du(paths: list[str]) -> tuple[list[tuple[str, Usage]], Usage | None]:
    """The figures of each of *paths*, and of all of them together when there are
    several in one mount (what removing them all gives back), else None."""
    targets = [target(p) for p in paths]
    by_mount: dict[str, list[Target]] = {}
    for t in targets:
        by_mount.setdefault(t.mount, []).append(t)
    figures: dict[int, Usage] = {}
    together = None
    for mount, group in by_mount.items():
        conn = open_namespace(mount)
        try:
            for t in group:
                figures[id(t)] = _measure(conn, [t])
            if len(targets) > 1 and len(by_mount) == 1:
                together = _measure(conn, group)
        finally:
            conn.close()
    return [(t.path, figures[id(t)]) for t in targets], together
