"""The store behind a mounted pffs, for a client beside the mount: the API the
engine bridge may use (its direct data path), and the only door it has into
pffs's store.

A mount's ``.pffs/store.json`` (also the ``user.pffs.store`` xattr of its
root, pffs.fs.adoption.store_info) says where its store is and whether a
client may use it directly.  With that *info* a client:

- checks it may put and pin blobs in a local store folder
  (:func:`local_store_root`), then opens its blobs (:func:`local_blobs`: put,
  get, get_frame, header, batch) and takes its gc lock (:func:`gc_lock`:
  ``hold_shared()`` while it puts, ``pin()`` until a manifest names the
  blobs; the protocol is pffs.store.storedir.GcLock's);
- opens the bucket of an S3 store (:func:`open_bucket`), which reads frames
  from the mount's cache folder where this host sees it, and asks the bucket
  whether it holds a page before sending one over :data:`PUT_FIRST_MAX`
  bytes (a smaller one's conditional PUT says so).

Either refuses with :class:`NoDirectAccess`, whose message says why (the
client then goes through the mount).  ``tests/t1_module_graph.py`` checks
that the engine bridge imports nothing else of pffs's store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from pffs import codec as codec_mod
from pffs.errors import PffsError
from pffs.store.framecache import PeekCache
from pffs.store.local import VERIFY_MODES, LocalBlobStore
from pffs.store.s3 import PUT_FIRST_MAX, S3BlobStore
from pffs.store.s3config import url_of
from pffs.store.storedir import GC_INTENT_NAME, GC_LOCK_NAME, GcLock

__all__ = ["Blobs", "GcLock", "LocalBlobStore", "NoDirectAccess", "PUT_FIRST_MAX", "S3BlobStore",
           "gc_lock", "local_blobs", "local_store_root", "open_bucket", "verify_of"]

#: The blobs of a mount's store, as a client opens them.
Blobs = Union[LocalBlobStore, S3BlobStore]


class NoDirectAccess(Exception):
    """This process may not use a mount's store directly; the message says why."""


def local_store_root(info: dict) -> Path:
    """The folder of the local store *info* describes, if this process may put
    blobs there, pin them and take its gc lock (else NoDirectAccess)."""
    root = Path(info["root"])
    try:
        st = os.stat(root)
    except PermissionError:
        raise NoDirectAccess(f"cannot reach the store folder {root} as uid {os.getuid()} "
                             "(permission denied)") from None
    except OSError as e:
        raise NoDirectAccess(f"cannot reach the store folder {root} ({e.strerror}): "
                             "another host or namespace?") from None
    if (st.st_dev, st.st_ino) != (info.get("dev"), info.get("ino")):
        raise NoDirectAccess(f"cannot use {root}: not the folder the daemon uses (another host or namespace)")
    blobs = Path(info["blobs"])
    pins = Path(info["pins"])
    for what, p in (("blob folder", blobs), ("pin folder", pins)):
        if not os.access(p, os.R_OK | os.W_OK | os.X_OK):
            raise NoDirectAccess(f"cannot write the store's {what} {p} as uid {os.getuid()}")
    for name in (GC_LOCK_NAME, GC_INTENT_NAME):
        p = root / name
        if os.path.exists(p) and not os.access(p, os.R_OK | os.W_OK):
            raise NoDirectAccess(f"cannot take the store's gc lock {p} as uid {os.getuid()}")
        if not os.path.exists(p) and not os.access(root, os.W_OK):
            raise NoDirectAccess(f"cannot create the store's gc lock {p} as uid {os.getuid()}")
    some = blobs / "00"
    if not os.access(some, os.W_OK | os.X_OK):
        raise NoDirectAccess(f"cannot write the store's blob folders ({some}) as uid {os.getuid()}")
    return root


def local_blobs(root: str | os.PathLike, codec: str, verify: str = "crc32") -> LocalBlobStore:
    """The blobs of the local store folder *root*, new ones written with *codec*,
    each read checked as *verify* says (pffs.store.local.VERIFY_MODES)."""
    return LocalBlobStore(root, codec=codec, verify=verify)


def gc_lock(root: str | os.PathLike) -> GcLock:
    """The gc lock of the local store folder *root*."""
    return GcLock(root)


def open_bucket(info: dict) -> S3BlobStore:
    """The bucket of the S3 store *info* describes, once one request found it
    reachable with this process's credentials (else NoDirectAccess).

    Frames are read from the mount's cache folder where this host sees the
    daemon's (read only: the daemon alone keeps it), else downloaded.
    """
    url = url_of(info.get("url"))
    if url is None:
        raise NoDirectAccess(f"store.json names no s3:// URL ({info.get('url')!r})")
    options = {k: v for k, v in (info.get("options") or {}).items()
               if k in ("endpoint", "region", "addressing") and isinstance(v, str)}
    cache = Path(info.get("cache") or "/nonexistent")
    try:
        st = os.stat(cache)
        same = (st.st_dev, st.st_ino) == (info.get("dev"), info.get("ino"))
    except OSError:
        same = False
    peek = PeekCache(cache if same else Path("/nonexistent/pffs-cache"))
    try:
        bucket = S3BlobStore(cache, url, options=options, codec=info.get("codec") or codec_mod.DEFAULT_CODEC,
                             cache=peek)
        bucket.server_time()  # one request: reachable, with these credentials
    except PffsError as e:
        raise NoDirectAccess(f"cannot reach the bucket as uid {os.getuid()}: {e}") from None
    bucket.verify = verify_of(info)
    return bucket


def verify_of(info: dict) -> str:
    """What a client's reads of the store *info* (``.pffs/store.json``) describes
    check: what the mount's reads check; a daemon that does not say checks
    crc32 (sha256 for an S3 store: its default); a mode this client does not
    know, sha256."""
    v = info.get("verify")
    if v in VERIFY_MODES:
        return str(v)
    return "sha256" if v is not None or info.get("kind") == "s3" else "crc32"
