"""Session tools that work through a mounted pffs: fork, seal, and finding a mount's daemon."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import PffsError
from .layout import MANIFEST_NAME, PAGES_DIR
from .types import Digest

# Imported where used: ``pffs fork`` runs in about the time Python takes to
# start, and the manifest model, subprocess and hashlib would add a third.

DIGEST_XATTR = "user.pffs.digest"
ENTRIES_XATTR = "user.pffs.entries"
FORK_XATTR = "user.pffs.fork"
SAVE_XATTR = "user.pffs.save"
LOAD_XATTR = "user.pffs.load"
ENGINES = "engines"


def pffs_root(path: Path) -> Path | None:
    """The mount point of the pffs holding *path*, or None."""
    p = path.absolute()
    while True:
        if os.path.ismount(p):
            return p if (p / ".pffs" / "version").exists() else None
        if p.parent == p:
            return None
        p = p.parent


def daemon_info(mountpoint: Path) -> dict[str, str]:
    try:
        text = (mountpoint / ".pffs" / "version").read_text()
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


def fork(src: str, dst: str) -> int:
    """Metadata-only fork: DST gets SRC's manifest and, at once, every page (no bytes moved).

    Returns the number of pages that appeared. Both must be on the same pffs.
    The daemon validates the manifest as it takes its name; only a refusal
    is parsed here, to say why.
    """
    s, d = Path(src), Path(dst)
    man = s / MANIFEST_NAME
    live_dst = _live_target(d)
    if live_dst is not None:
        return _load_into(s, *live_dst)
    if d.exists() or d.is_symlink():
        raise PffsError(f"{d}: already exists")
    rs, rd = pffs_root(s), pffs_root(d.parent)
    rel_s = Path(os.path.relpath(os.path.realpath(s), os.path.realpath(rs))) if rs is not None else None
    # (A live session's manifest.json is made on demand, every page hashed: not looked at here.)
    live_src = rel_s is not None and rel_s.parts[:1] == (ENGINES,) and len(rel_s.parts) == 3
    if not (s.is_dir() if live_src else man.is_file()):
        raise PffsError(f"{s}: not a session (no manifest.json)")
    if rs is None or rd is None or rs != rd:
        raise PffsError("fork needs SRC and DST on the same mounted pffs")
    if live_src:
        # A live request: its engine pages it out to DST itself.
        rel_d = os.path.relpath(os.path.realpath(d.parent), os.path.realpath(rd)) + "/" + d.name
        try:
            os.setxattr(s, SAVE_XATTR, os.fsencode(rel_d))
        except OSError as e:
            raise PffsError(f"{s}: the engine could not save it as {d}: {e.strerror}") from None
        return int(os.getxattr(d / PAGES_DIR, ENTRIES_XATTR))
    # The daemon clones the manifest it holds; if it will not (another
    # version, an S3 store, a manifest it has not accepted, a path it cannot
    # follow as given), the bytes are copied, and their close says why.
    rel = os.fsencode(os.path.relpath(os.path.realpath(man), os.path.realpath(rs)))
    try:
        _make_session(d, lambda: os.setxattr(d, FORK_XATTR, rel))
        return int(os.getxattr(d / PAGES_DIR, ENTRIES_XATTR))
    except PffsError:
        pass
    data = man.read_bytes()
    try:
        place_manifest(d, data)
    except PffsError:
        from . import manifest as mf
        try:
            mf.parse(data)
        except mf.ManifestError as e:
            raise PffsError(f"{man}: {e}") from None
        raise
    # The number of page files, without listing them (10,000 names cost a
    # tenth of a second through FUSE).
    return int(os.getxattr(d / PAGES_DIR, ENTRIES_XATTR))


def _live_target(d: Path) -> tuple[Path, Path, str] | None:
    """(mount root, engines/E folder, session name) when *d* is ``engines/E`` or
    ``engines/E/NAME`` of a mounted pffs, else None."""
    for folder, name in ((d, ""), (d.parent, d.name)):
        if not folder.is_dir():
            continue
        root = pffs_root(folder)
        if root is None:
            continue
        rel = Path(os.path.relpath(os.path.realpath(folder), os.path.realpath(root)))
        if rel.parts[:1] == (ENGINES,) and len(rel.parts) == 2:
            return root, folder, name
    return None


def _load_into(s: Path, root: Path, engine_dir: Path, name: str) -> int:
    """``pffs fork SRC engines/E[/NAME]``: engine E pages SRC in itself; its page count."""
    import json
    man = s / MANIFEST_NAME
    if not man.is_file():
        raise PffsError(f"{s}: not a session (no manifest.json)")
    rel = os.path.relpath(os.path.realpath(s), os.path.realpath(root))
    if rel.startswith(".."):
        raise PffsError("fork needs SRC and DST on the same mounted pffs")
    name = name or s.name
    try:
        os.setxattr(engine_dir, LOAD_XATTR, json.dumps({"session": rel, "name": name}).encode())
    except OSError as e:
        raise PffsError(f"{engine_dir}/{name}: the engine refused {s}: {e.strerror}") from None
    try:
        return len(json.loads(man.read_bytes()).get("pages", []))
    except (OSError, ValueError):
        return 0


def place_manifest(d: Path, data: bytes) -> None:
    """Make session folder *d* with an empty ``pages/``, then write its manifest.json.

    The close of the manifest validates it and, on a pffs mount, makes every
    listed page whose blob is stored appear (the metadata-only fork).  On any
    failure *d* is removed again.
    """
    def write():
        fd = os.open(d / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    _make_session(d, write)


def _make_session(d: Path, give_manifest) -> None:
    """Make folder *d* and an empty ``d/pages/``, then ``give_manifest()``; on an
    OSError after *d* exists, *d* is removed again and PffsError says why."""
    d.mkdir()
    try:
        (d / PAGES_DIR).mkdir()
        give_manifest()
    except OSError as e:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
        raise PffsError(f"{d}: {e.strerror}") from None


def seal(session: str) -> tuple[int, int]:
    """Rewrite SESSION/manifest.json from its current page files; returns (pages, changed)."""
    from . import manifest as mf
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
