"""Figures of a store (contract §4): what the namespace holds, read in aggregate."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass


@dataclass
class Stats:
    sessions: int
    files: int
    logical_bytes: int
    unique_blobs: int
    unique_bytes: int
    stored_bytes: int

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_json(self) -> dict:
        return {"sessions": self.sessions, "files": self.files,
                "logical_bytes": self.logical_bytes, "unique_blobs": self.unique_blobs,
                "unique_bytes": self.unique_bytes, "stored_bytes": self.stored_bytes,
                "dedup_ratio": round(self.dedup_ratio, 4),
                "compression_ratio": round(self.compression_ratio, 4)}


def stats(conn: sqlite3.Connection) -> Stats:
    """contract §4 figures. Files count links (a hard-linked file counts once per name)."""
    sessions = conn.execute(
        "SELECT COUNT(*) FROM manifests m CROSS JOIN dentries d ON d.inode = m.inode"
        " WHERE d.name = ?", (b"manifest.json",)).fetchone()[0]
    files, logical = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(i.size), 0) FROM dentries d JOIN inodes i ON i.id = d.inode"
        " WHERE (i.mode & 61440) = 32768").fetchone()
    folded, folded_bytes = conn.execute(
        "SELECT COALESCE(SUM(files), 0), COALESCE(SUM(bytes), 0) FROM folds").fetchone()
    files += folded
    logical += folded_bytes
    blobs, unique, stored = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(raw_size), 0), COALESCE(SUM(stored_size), 0) FROM blobs"
    ).fetchone()
    return Stats(sessions, files, logical, blobs, unique, stored)

