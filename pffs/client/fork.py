"""``pffs fork``: the metadata-only fork of a session, and a live engine's
page-out (out of ``engines/``) or page-in (into it), all asked of the daemon.

Forks are what scripts run by the thousand and what restores a KV cache, so
this module needs only ``os``: ``pffs fork`` takes about the time Python
takes to start (``re``, ``typing``, ``json``, ``pathlib`` and ``argparse``
would each add a fifth of that again).
"""

from __future__ import annotations

import os

from pffs.errors import PffsError
from pffs.names import (
    CONTROL_DIR,
    ENGINES_DIR,
    ENTRIES_XATTR,
    FORK_XATTR,
    LOAD_XATTR,
    MANIFEST_NAME,
    PAGES_DIR,
    SAVE_XATTR,
    VERSION_NAME,
)


def mount_root(path: str | os.PathLike) -> str | None:
    """The mount point of the pffs holding *path*, or None."""
    p = os.path.abspath(path)
    while True:
        if os.path.ismount(p):
            return p if os.path.exists(os.path.join(p, CONTROL_DIR, VERSION_NAME)) else None
        up = os.path.dirname(p)
        if up == p:
            return None
        p = up


def _rel(path: str, root: str) -> str:
    return os.path.relpath(os.path.realpath(path), os.path.realpath(root))


def _count(pages_dir: str) -> int:
    # The number of page files, without listing them (10,000 names cost a
    # tenth of a second through FUSE).
    return int(os.getxattr(pages_dir, ENTRIES_XATTR))


def fork(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Metadata-only fork: DST gets SRC's manifest and, at once, every page (no bytes moved).

    Returns the number of pages that appeared. Both must be on the same pffs.
    The daemon validates the manifest as it takes its name; only a refusal
    is parsed here, to say why.  Out of ``engines/E/S`` the engine pages its
    live session out to DST itself; into ``engines/E[/NAME]`` it pages SRC in.
    """
    s, d = os.path.abspath(src), os.path.abspath(dst)
    man = os.path.join(s, MANIFEST_NAME)
    live_dst = _live_target(d)
    if live_dst is not None:
        return _load_into(src, *live_dst)
    if os.path.lexists(d):
        raise PffsError(f"{dst}: already exists")
    rs, rd = mount_root(s), mount_root(os.path.dirname(d))
    rel_s = _rel(s, rs).split(os.sep) if rs is not None else []
    # (A live session's manifest.json is made on demand, every page hashed: not looked at here.)
    live_src = rel_s[:1] == [ENGINES_DIR] and len(rel_s) == 3
    if not (os.path.isdir(s) if live_src else os.path.isfile(man)):
        raise PffsError(f"{src}: not a session (no manifest.json)")
    if rs is None or rd is None or rs != rd:
        raise PffsError("fork needs SRC and DST on the same mounted pffs")
    pages = os.path.join(d, PAGES_DIR)
    if live_src:
        # A live request: its engine pages it out to DST itself.
        rel_d = _rel(os.path.dirname(d), rd) + "/" + os.path.basename(d)
        try:
            os.setxattr(s, SAVE_XATTR, os.fsencode(rel_d))
        except OSError as e:
            raise PffsError(f"{src}: the engine could not save it as {dst}: {e.strerror}") from None
        return _count(pages)
    # The daemon clones the manifest it holds; if it will not (another
    # version, an S3 store, a manifest it has not accepted, a path it cannot
    # follow as given), the bytes are copied, and their close says why.
    rel = os.fsencode(_rel(man, rs))
    try:
        _make_session(d, lambda: os.setxattr(d, FORK_XATTR, rel))
        return _count(pages)
    except PffsError:
        pass
    with open(man, "rb") as f:
        data = f.read()
    try:
        place_manifest(d, data)
    except PffsError:
        from pffs import manifest as mf
        try:
            mf.parse(data)
        except mf.ManifestError as e:
            raise PffsError(f"{man}: {e}") from None
        raise
    return _count(pages)


def _live_target(d: str) -> tuple[str, str, str] | None:
    """(mount root, engines/E folder, session name) when *d* is ``engines/E`` or
    ``engines/E/NAME`` of a mounted pffs, else None."""
    for folder, name in ((d, ""), (os.path.dirname(d), os.path.basename(d))):
        if not os.path.isdir(folder):
            continue
        root = mount_root(folder)
        if root is None:
            continue
        rel = _rel(folder, root).split(os.sep)
        if rel[:1] == [ENGINES_DIR] and len(rel) == 2:
            return root, folder, name
    return None


def _json_str(s: str) -> str:
    """*s* as a JSON string (what json.dumps gives, ensure_ascii off, and
    surrogates from undecodable path bytes escaped so they come back)."""
    out = []
    for c in s:
        o = ord(c)
        if c in '"\\' or o < 0x20 or 0xD800 <= o < 0xE000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _load_into(src: str | os.PathLike, root: str, engine_dir: str, name: str) -> int:
    """``pffs fork SRC engines/E[/NAME]``: engine E pages SRC in itself; its page count."""
    s = os.path.abspath(src)
    if not os.path.isfile(os.path.join(s, MANIFEST_NAME)):
        raise PffsError(f"{src}: not a session (no manifest.json)")
    rel = _rel(s, root)
    if rel.startswith(".."):
        raise PffsError("fork needs SRC and DST on the same mounted pffs")
    name = name or os.path.basename(s)
    value = '{"session": %s, "name": %s}' % (_json_str(rel), _json_str(name))
    try:
        os.setxattr(engine_dir, LOAD_XATTR, value.encode())
    except OSError as e:
        raise PffsError(f"{engine_dir}/{name}: the engine refused {src}: {e.strerror}") from None
    try:
        return _count(os.path.join(s, PAGES_DIR))
    except (OSError, ValueError):
        return 0


def place_manifest(d: str | os.PathLike, data: bytes) -> None:
    """Make session folder *d* with an empty ``pages/``, then write its manifest.json.

    The close of the manifest validates it and, on a pffs mount, makes every
    listed page whose blob is stored appear (the metadata-only fork).  On any
    failure *d* is removed again.
    """
    _make_session(d, lambda: write_new(os.path.join(d, MANIFEST_NAME), data))


def write_new(path: str | os.PathLike, data: bytes) -> None:
    """Create file *path* (it must not exist) holding *data* (its close is where
    pffs checks a manifest.json)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _make_session(d: str | os.PathLike, give_manifest) -> None:
    """Make folder *d* and an empty ``d/pages/``, then ``give_manifest()``; on an
    OSError after *d* exists, *d* is removed again and PffsError says why."""
    os.mkdir(d)
    try:
        os.mkdir(os.path.join(d, PAGES_DIR))
        give_manifest()
    except OSError as e:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
        raise PffsError(f"{d}: {e.strerror}") from None
