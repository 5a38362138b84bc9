"""Finding the pffs mount that holds a path, and its store, if this process
may use the store directly (the direct data path: engine_bridge.transport.direct).

A path inside a pffs mount (``/proc/self/mountinfo``, no request to any
filesystem) whose daemon offers the direct path (``.pffs/store.json``, one
xattr request) and whose store this process may read and write (a local
store folder with its blob and pin folders and gc lock, or an S3 bucket
reachable with this process's own credentials: pffs.client.access) is
served beside the FUSE loop.  Anything else (not a pffs mount,
``engines/``, a store limit, another host, a uid without access to the
store folder, a bucket this process cannot reach, ``PFFS_DIRECT=0``) goes
through the mount; a reason worth knowing is logged once per mount.
Reads beside the mount check what the mount's reads check (``verify`` in
``.pffs/store.json``: :attr:`StoreAccess.verify`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pffs import codec as codec_mod
from pffs.client.access import (
    Blobs,
    NoDirectAccess,
    S3BlobStore,
    local_blobs,
    local_store_root,
    open_bucket,
    verify_of,
)
from pffs.names import CONTROL_DIR, DIRECT_PROTOCOL, ENGINES_DIR, FSTYPE, STORE_XATTR

log = logging.getLogger("engine_bridge.transport.mountinfo")


@dataclass
class StoreAccess:
    """A mounted pffs whose store this process may use directly."""
    mountpoint: str
    root: Path
    codec: str
    info: dict = field(default_factory=dict)
    #: The bucket of an S3 store (None: a local store folder at *root*).
    bucket: "S3BlobStore | None" = None

    @property
    def kind(self) -> str:
        return "local" if self.bucket is None else "s3"

    @property
    def verify(self) -> str:
        """What a read of the store checks: what the mount's reads check (its
        ``-o verify=``, said in ``.pffs/store.json``; pffs.client.access.verify_of)."""
        return verify_of(self.info)

    def blobs(self) -> Blobs:
        if self.bucket is not None:
            return self.bucket
        return local_blobs(self.root, codec=self.codec, verify=self.verify)


_lock = threading.Lock()
_found: dict[tuple[str, str], StoreAccess | str] = {}
_said: set[tuple[str, str]] = set()


def _unescape(field_: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1:i + 4].isdigit() and i + 4 <= len(field_):
            out.append(chr(int(field_[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def pffs_mount_of(path: str | os.PathLike) -> tuple[str, str, str] | None:
    """(mount point, its device as 'major:minor', path inside it) of the pffs
    mount holding *path*, from ``/proc/self/mountinfo`` (no request to any
    filesystem), or None."""
    p = os.path.abspath(os.fspath(path))
    best = None
    dev = ""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        parts = left.split()
        if len(parts) < 5 or right.split()[0] != FSTYPE:
            continue
        mp = _unescape(parts[4])
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best)):
            best, dev = mp, parts[2]
    if best is None:
        return None
    return best, dev, os.path.relpath(p, best)


def _load_getxattr() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).getxattr
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_ssize_t
        return fn
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None


_c_getxattr = _load_getxattr()


def getxattr(path: str | os.PathLike, name: str) -> bytes:
    """An xattr's value in one request (os.getxattr asks with a small buffer first)."""
    if _c_getxattr is None:
        return os.getxattr(path, name)
    buf = ctypes.create_string_buffer(1 << 16)
    n = _c_getxattr(os.fsencode(path), name.encode(), buf, len(buf))
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    return buf.raw[:n]


def _say(mp: str, reason: str, level=logging.INFO) -> None:
    with _lock:
        if (mp, reason) in _said:
            return
        _said.add((mp, reason))
    log.log(level, "%s: pages go through the mount: %s", mp, reason)


def store_access(path: str | os.PathLike) -> StoreAccess | None:
    """Direct access to the store of the pffs mount holding *path*, or None (use the mount)."""
    if os.environ.get("PFFS_DIRECT", "1") == "0":
        return None
    found = pffs_mount_of(path)
    if found is None:
        return None
    mp, dev, rel = found
    first = rel.split("/", 1)[0]
    if first in (ENGINES_DIR, CONTROL_DIR):
        return None  # the live view pages into the engine itself
    key = (mp, dev)  # a new mount at the same place is another device
    with _lock:
        got = _found.get(key)
    if got is None:
        got = _probe(mp)
        with _lock:
            _found[key] = got
    if isinstance(got, str):
        _say(mp, got, logging.WARNING if got.startswith("cannot") else logging.INFO)
        return None
    return got


def _probe(mp: str) -> StoreAccess | str:
    """The store of mount *mp* if this process may use it, else why not."""
    try:
        # .pffs/store.json's bytes, in one request.
        info = json.loads(getxattr(mp, STORE_XATTR))
    except (OSError, ValueError) as e:
        return f"no usable .pffs/store.json ({e})"
    if info.get("protocol") != DIRECT_PROTOCOL:
        return f"the daemon speaks direct protocol {info.get('protocol')!r}, this bridge {DIRECT_PROTOCOL}"
    if not info.get("direct"):
        return info.get("reason") or "the daemon does not offer the direct path"
    try:
        if info.get("kind") == "s3":
            # The bucket, reading frames from the mount's cache folder where this host sees it.
            bucket = open_bucket(info)
            return StoreAccess(mp, bucket.root, bucket.codec.name, info, bucket)
        if info.get("kind") != "local":
            return f"a store of kind {info.get('kind')!r}"
        root = local_store_root(info)
    except NoDirectAccess as e:
        return str(e)
    return StoreAccess(mp, root, info.get("codec") or codec_mod.DEFAULT_CODEC, info)


def mounted_store(path: str | os.PathLike) -> tuple[str, str] | None:
    """(mount point, the identity of its store) of the pffs mount holding *path*
    (``/proc/self/mountinfo`` and one xattr request), None where no pffs mount
    holds it; OSError where the mount does not answer (a daemon killed).

    The identity (a local store's folder device and inode, an S3 store's URL)
    is the same for every mount of one store, whatever its daemon or device.
    """
    found = pffs_mount_of(path)
    if found is None:
        return None
    mp = found[0]
    try:
        info = json.loads(getxattr(mp, STORE_XATTR))
    except ValueError:
        info = {}
    ident = [str(info.get(k)) for k in ("kind", "url", "dev", "ino") if info.get(k) is not None]
    return mp, ":".join(ident) or "?"
