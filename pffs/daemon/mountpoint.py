"""The mount point: refused when it is missing or busy; a dead mount left by a killed daemon cleaned up."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from pathlib import Path

from pffs.errors import PffsError

log = logging.getLogger("pffs.daemon.mount")


def check_mountpoint(mp: Path) -> None:
    """Refuse a missing or busy mount point; clean up one left dead by a killed daemon.

    The probe is statfs: the kernel sends every one to the daemon, so a FUSE
    mount whose daemon is gone answers ENOTCONN at once, where a stat of the
    mount point is answered from the attribute cache for its timeout (10 s)."""
    try:
        os.statvfs(mp)
    except FileNotFoundError:
        raise PffsError(f"{mp}: mount point does not exist") from None
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise PffsError(f"{mp}: {e.strerror}") from None
        log.info("%s: cleaning up a mount left by a dead daemon", mp)
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    try:
        os.stat(mp)
    except OSError as e:
        raise PffsError(f"{mp}: {e.strerror}") from None
    if not mp.is_dir():
        raise PffsError(f"{mp}: mount point is not a directory")
    if os.path.ismount(mp):
        raise PffsError(f"{mp}: already a mount point")
    if any(os.scandir(mp)):
        raise PffsError(f"{mp}: mount point is not empty")
