"""``pffs prune``: remove old sessions under a folder of a mounted pffs, then gc.

A session is a directory holding a manifest.json (contract §3); its age is the
mtime of that manifest.json.  Sessions may sit in plain folders at any depth;
pffs never looks inside a session for more sessions, and never touches the
live ``engines/`` view at the mount's root.  After the removals, gc runs on
the mount's store (named by ``MNT/.pffs/version``), so the bytes go too.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pffs import manifest as mf
from pffs.client.mounted import daemon_info, pffs_root
from pffs.errors import PffsError
from pffs.names import ENGINES_DIR


@dataclass
class Session:
    path: Path
    mtime: float


def find_sessions(top: Path, mount_root: Path) -> Iterator[Session]:
    """Every session at or below *top* (iterative: folders may nest deeply)."""
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            st = os.stat(d / mf.MANIFEST_NAME, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except NotADirectoryError:
            continue
        if st is not None and stat.S_ISREG(st.st_mode):
            yield Session(d, st.st_mtime)
            continue
        try:
            entries = list(os.scandir(d))
        except OSError as e:
            raise PffsError(f"{d}: {e.strerror}") from None
        for ent in entries:
            if ent.is_dir(follow_symlinks=False):
                p = Path(ent.path)
                if d == mount_root and ent.name == ENGINES_DIR:
                    continue  # live engine sessions are not files to prune
                stack.append(p)


def choose(sessions: list[Session], keep_last: int | None, older_than: float | None,
           now: float | None = None) -> list[Session]:
    """The sessions to remove, oldest first."""
    ordered = sorted(sessions, key=lambda s: (s.mtime, str(s.path)))
    if keep_last is not None:
        return ordered[:max(0, len(ordered) - keep_last)]
    if older_than is None:
        raise TypeError("choose() needs keep_last or older_than")
    now = time.time() if now is None else now
    return [s for s in ordered if now - s.mtime > older_than]


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}"
    return f"{seconds:.0f}s"


def remove_tree(path: Path) -> None:
    """rm -r through the mount (rm handles any depth and reports one line on failure)."""
    r = subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or [f"rm exited {r.returncode}"])[-1]
        raise PffsError(msg)


def prune(top: str, *, keep_last: int | None = None, older_than: float | None = None,
          dry_run: bool = False, out=print) -> tuple[list[Session], Path]:
    """Remove the chosen sessions below *top*; returns them and the mount's store directory."""
    if (keep_last is None) == (older_than is None):
        raise PffsError("give exactly one of --keep-last N and --older-than AGE")
    if keep_last is not None and keep_last < 0:
        raise PffsError("--keep-last takes a number >= 0")
    t = Path(top).absolute()
    if not t.is_dir():
        raise PffsError(f"{t}: not a directory")
    root = pffs_root(t)
    if root is None:
        raise PffsError(f"{t}: not inside a mounted pffs")
    store = daemon_info(root).get("store")
    if not store:
        raise PffsError(f"{root}: the daemon does not name its store")
    sessions = list(find_sessions(t, root))
    doomed = choose(sessions, keep_last, older_than)
    now = time.time()
    for s in doomed:
        out(f"{'would remove' if dry_run else 'removing'} {s.path} (manifest.json {_age(now - s.mtime)} old)")
        if not dry_run:
            remove_tree(s.path)
    out(f"{len(doomed)} of {len(sessions)} sessions {'would be ' if dry_run else ''}removed")
    return doomed, Path(store)
