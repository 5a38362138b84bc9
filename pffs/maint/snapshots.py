"""Snapshots of the namespace database: the store's only index, kept in copies."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

PREFIX = "namespace-"


def take_snapshot(conn: sqlite3.Connection, snap_dir: Path, keep: int = 3) -> Path:
    """Copy the live database consistently (SQLite backup API), fsynced, newest last."""
    snap_dir.mkdir(exist_ok=True)
    name = f"{PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 1_000_000_000:09d}.db"
    tmp = snap_dir / (".tmp-" + name)
    try:
        dest = sqlite3.connect(tmp)
        try:
            conn.backup(dest)
        finally:
            dest.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        # A full disk must not leave half a snapshot taking the room that is left.
        tmp.unlink(missing_ok=True)
        raise
    final = snap_dir / name
    os.rename(tmp, final)
    dfd = os.open(snap_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    for old in list_snapshots(snap_dir)[:-keep]:
        old.unlink()
    return final


def list_snapshots(snap_dir: Path) -> list[Path]:
    if not snap_dir.is_dir():
        return []
    return sorted(p for p in snap_dir.iterdir() if p.name.startswith(PREFIX) and p.suffix == ".db")
