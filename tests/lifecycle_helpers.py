"""Helpers for the store lifecycle tests: copies that know which closes returned, stats, gc."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

from mountutil import pffs, wait_for


def copy_file(src: Path, dst: Path) -> None:
    """Copy one file the way cp does (create, write, close); raises if any step fails."""
    data = src.read_bytes()
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    os.close(fd)  # the close commits: it may fail (ENOSPC, EINVAL) on its own


def session_files(src: Path) -> list[Path]:
    """A session folder's files, relative, in cp -r order (pages, then manifest.json last)."""
    out = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    out.sort(key=lambda p: p.name == "manifest.json")
    return out


def stats(mountpoint: Path) -> dict:
    return json.loads(pffs("stats", "--json", mountpoint).stdout)


def gc(store: Path, *args: str) -> str:
    return pffs("gc", "--store", store, "--grace", "0", *args).stdout


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr}"
    return r


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def count(mnt, query: str) -> int:
    """A count in the mounted store's namespace (read beside the daemon)."""
    c = sqlite3.connect(f"file:{mnt.store / 'namespace.db'}?mode=ro", uri=True)
    try:
        return c.execute(query).fetchone()[0]
    finally:
        c.close()


def rm_r(mnt, *paths) -> None:
    """rm -r through the mount, then wait for the kernel to let go of what it removed
    (an unlinked inode keeps its blobs until the kernel's forget)."""
    run("rm", "-r", *paths)
    wait_for(lambda: count(mnt, "SELECT COUNT(*) FROM inodes WHERE nlink = 0") == 0,
             what="the removed files to be forgotten")
