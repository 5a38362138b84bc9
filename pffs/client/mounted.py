"""Session tools that work through a mounted pffs: fork, seal, and finding a mount's daemon."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from pffs.client.fork import fork, mount_root, place_manifest  # noqa: F401  (the session tools' API)
from pffs.errors import PffsError
from pffs.names import CONTROL_DIR, DIGEST_XATTR, MANIFEST_NAME, PAGES_DIR, VERSION_NAME
from pffs.types import Digest

# Imported where used: the manifest model, subprocess and hashlib (a quick
# command would pay for them all).


def pffs_root(path: Path) -> Path | None:
    """The mount point of the pffs holding *path*, or None."""
    root = mount_root(path)
    return None if root is None else Path(root)


def daemon_info(mountpoint: Path) -> dict[str, str]:
    try:
        text = (mountpoint / CONTROL_DIR / VERSION_NAME).read_text()
    except OSError as e:
        raise PffsError(f"{mountpoint}: not a mounted pffs ({e.strerror})") from None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        out[k] = v
    return out


def _alive(pid: int) -> bool:
    """Whether process *pid* still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def umount(mountpoint: str, timeout: float = 60.0) -> None:
    import signal
    import subprocess
    import sys
    import time
    mp = Path(mountpoint).absolute()
    try:
        os.stat(mp)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
            return
        raise PffsError(f"{mp}: {e.strerror}") from None
    if not os.path.ismount(mp):
        raise PffsError(f"{mp}: not mounted")
    pid = int(daemon_info(mp).get("pid", "0") or 0)
    r = subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True, text=True)
    if r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
        msg = msg.replace('fusermount3: ', '')
        if "busy" not in msg or not pid:
            raise PffsError(f"{mp}: {msg}")
        # In use (a shell's folder, an open file): the daemon detaches the mount
        # (what those clients still ask fails from then on), commits what was
        # written, and exits.
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError as e:
            raise PffsError(f"{mp}: {msg} (and the daemon {pid}: {e.strerror})") from None
        print(f"pffs umount: {mp}: busy; detached, its daemon {pid} stops", file=sys.stderr)
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    if pid:
        raise PffsError(f"daemon {pid} still running {timeout:.0f} s after unmount")


def file_digest(path: Path) -> Digest:
    """A file's digest: pffs's xattr when there is one, else sha256 of its bytes."""
    try:
        return Digest(os.getxattr(path, DIGEST_XATTR).decode())
    except OSError:
        import hashlib
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return Digest("sha256:" + h.hexdigest())


def seal(session: str) -> tuple[int, int]:
    """Rewrite SESSION/manifest.json from its current page files; returns (pages, changed)."""
    from pffs import manifest as mf
    s = Path(session)
    man = s / MANIFEST_NAME
    try:
        m = mf.parse(man.read_bytes())
    except FileNotFoundError:
        raise PffsError(f"{s}: not a session (no manifest.json)") from None
    except mf.ManifestError as e:
        raise PffsError(f"{man}: {e}") from None
    pdir = s / PAGES_DIR
    found: dict[int, Path] = {}
    if pdir.is_dir():
        for ent in os.scandir(pdir):
            ix = mf.parse_page_name(ent.name)
            if ix is not None and ent.is_file(follow_symlinks=False):
                found[ix] = Path(ent.path)
    n = max(found) + 1 if found else 0
    missing = [i for i in range(n) if i not in found]
    if missing:
        raise PffsError(f"{pdir}: page {mf.page_name(missing[0])} is missing (pages must run from 000000)")
    digests: list[Digest] = []
    for i in range(n):
        size = found[i].stat().st_size
        if size != m.page_bytes:
            raise PffsError(f"{found[i]}: {size} bytes, the geometry needs {m.page_bytes}")
        digests.append(file_digest(found[i]))
    for seq in m.logical_seqs:
        bad = [ix for ix in seq.page_ixs if ix >= n]
        if bad:
            raise PffsError(f"sequence {seq.id!r} uses page {mf.page_name(bad[0])}, which is gone")
    changed = sum(1 for i, dg in enumerate(digests) if i >= len(m.pages) or m.pages[i] != dg)
    changed += max(0, len(m.pages) - n)
    m.pages = digests
    tmp = s / f".manifest.json.seal-{os.getpid()}"
    tmp.write_bytes(m.to_json())
    try:
        os.rename(tmp, man)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PffsError(f"{man}: {e.strerror}") from None
    return n, changed
