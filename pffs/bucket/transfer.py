"""Sessions and mounts that share one bucket: push, pull, ls-remote, rm-remote.

A mount's registration and lease are :mod:`pffs.bucket.lease`'s, bucket gc is
:mod:`pffs.bucket.sweep`'s; this module holds the commands and re-exports the
others' names.

``pffs push SESSION [NAME]`` publishes a manifest (the user's bytes) at
``PREFIX/manifests/NAME`` once every page it lists is in the bucket;
``pffs pull NAME DEST`` writes it into DEST/manifest.json of a mount with an
empty DEST/pages, and the mount's adoption makes every page appear at once:
page digests the namespace does not know are looked up in the bucket (HEADs
in parallel, in a content thread, outside the SQLite write lock) and get a
blob row each before the metadata-only fork runs.  No page bytes move.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from pffs import manifest as mf
from pffs.bucket.lease import (
    DEFAULT_LEASE,
    KEEP_UNMOUNTED,
    LEASE_CHECK,
    MEMORY_CACHE_MAX,
    MOUNT_ID_NAME,
    REGISTRATION_FORMAT,
    RemoteMount,
    attach,
    decode_registration,
    encode_registration,
    mount_id,
)
from pffs.bucket.sweep import BucketGcResult, bucket_references, collect, collect_cli
from pffs.errors import PffsError
from pffs.store.s3 import MANIFESTS, S3BlobStore, open_url, url_of

__all__ = ["DEFAULT_LEASE", "LEASE_CHECK", "KEEP_UNMOUNTED", "MEMORY_CACHE_MAX", "REGISTRATION_FORMAT",
           "MOUNT_ID_NAME", "mount_id", "encode_registration", "decode_registration", "RemoteMount",
           "attach", "BucketGcResult", "bucket_references", "collect", "collect_cli", "store_of",
           "check_name", "push", "pull", "Published", "ls_remote", "rm_remote"]

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._\-]*(/[A-Za-z0-9_][A-Za-z0-9._\-]*)*\Z")


# -- finding the bucket from the command line ---------------------------------------

def store_of(path: str | os.PathLike | None, store: str | None) -> S3BlobStore:
    """The S3 store named by --store (URL or cache folder), else the one the mount holding *path* uses."""
    from pffs.client.mounted import daemon_info, pffs_root
    from pffs.store.storedir import StoreDir
    if store:
        url = url_of(store)
        if url is not None:
            return open_url(url)
        sd = StoreDir(store)
        if not sd.blobs.remote:  # sd.url is None: its blobs are local
            raise PffsError(f"{store} is a local store; push, pull and ls-remote need an s3:// store")
        return sd.blobs
    where = Path(path or ".")
    mnt = pffs_root(where if where.exists() else where.parent)
    if mnt is None:
        raise PffsError(f"{where} is not in a mounted pffs (give --store s3://BUCKET/PREFIX)")
    folder = daemon_info(mnt).get("store")
    if not folder:
        raise PffsError(f"{mnt} is mounted from a local store, not from S3")
    sd = StoreDir(folder)
    if not sd.blobs.remote:  # sd.url is None: its blobs are local
        raise PffsError(f"{mnt} is mounted from a local store, not from S3")
    return sd.blobs


def check_name(name: str) -> str:
    if len(name) > 512 or not _NAME_RE.match(name) or any(p in (".", "..") for p in name.split("/")):
        raise PffsError(f"bad session name {name!r} (letters, digits, '.', '_', '-', '/' between parts)")
    return name


# -- push, pull, ls-remote, rm-remote --------------------------------------------

def push(session: str, name: str | None = None, *, store: str | None = None,
         force: bool = False) -> tuple[str, int]:
    """Publish SESSION's manifest.json as NAME; returns (name, pages)."""
    s = Path(session)
    try:
        data = (s / mf.MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise PffsError(f"{s}: not a session (no manifest.json)") from None
    except OSError as e:
        raise PffsError(f"{s / mf.MANIFEST_NAME}: {e.strerror}") from None
    try:
        m = mf.parse(data)
    except mf.ManifestError as e:
        raise PffsError(f"{s / mf.MANIFEST_NAME}: {e}") from None
    name = check_name(name or s.absolute().name)
    blobs = store_of(s, store)
    found = blobs.lookup_many(m.pages)
    missing = [i for i, d in enumerate(m.pages) if d not in found]
    if missing:
        raise PffsError(f"{s}: page {mf.page_name(missing[0])} ({m.pages[missing[0]]}) is not in"
                        f" {blobs.url} ({len(missing)} of {len(m.pages)} pages missing); nothing published")
    meta = {"pages": str(len(m.pages)), "source": urllib.parse.quote(str(s.absolute()))}
    if not blobs.put_object(MANIFESTS + name, data, meta, if_absent=not force):
        raise PffsError(f"{name} is already published in {blobs.url} (--force replaces it)")
    return name, len(m.pages)


def pull(name: str, dest: str, *, store: str | None = None) -> tuple[int, int]:
    """Make the published session NAME appear at DEST in a mount; returns (pages present, pages listed).

    The bucket is the one DEST's mount uses (its pages must be there); *store*,
    if given, must name that same bucket.
    """
    check_name(name)
    d = Path(dest)
    if d.exists() or d.is_symlink():
        raise PffsError(f"{d}: already exists")
    if not d.parent.is_dir():
        raise PffsError(f"{d.parent}: no such folder")
    blobs = store_of(d.parent, None)
    if store and store_of(None, store).url != blobs.url:
        raise PffsError(f"{d.parent} is in a mount of {blobs.url}, not of {store_of(None, store).url}")
    got = blobs.get_object(MANIFESTS + name)
    if got is None:
        raise PffsError(f"no session {name!r} is published in {blobs.url} (see pffs ls-remote)")
    data = got[0]
    try:
        m = mf.parse(data)
    except mf.ManifestError as e:
        raise PffsError(f"{blobs.url} {name}: {e}") from None
    from pffs.client.fork import place_manifest
    place_manifest(d, data)  # its close looks the pages up in the bucket and forks them
    present = sum(1 for i in range(len(m.pages)) if (d / mf.PAGES_DIR / mf.page_name(i)).exists())
    return present, len(m.pages)


@dataclass
class Published:
    name: str
    size: int
    modified: float
    pages: int | None


def ls_remote(blobs: S3BlobStore) -> list[Published]:
    items = [(n, size, t) for n, size, t in blobs.list_area(MANIFESTS)]

    def pages(name: str) -> int | None:
        try:
            r = blobs.client.head_object(Bucket=blobs.bucket, Key=blobs.prefix + MANIFESTS + name)
            return int(r.get("Metadata", {}).get("pages"))
        except Exception:  # a listing without the page count is still a listing
            return None
    counts = list(blobs.pool.map(pages, [n for n, _, _ in items])) if items else []
    return [Published(n, size, t, c) for (n, size, t), c in zip(items, counts)]


def rm_remote(blobs: S3BlobStore, name: str) -> None:
    check_name(name)
    if blobs.get_object(MANIFESTS + name) is None:
        raise PffsError(f"no session {name!r} is published in {blobs.url}")
    blobs.delete_object(MANIFESTS + name)


# -- command line -------------------------------------------------------------------------

def _cmd_push(args) -> int:
    name, n = push(args.session, args.name, store=args.store, force=args.force)
    print(f"{args.session}: published as {name} ({n} pages, metadata only)")
    return 0


def _cmd_pull(args) -> int:
    present, n = pull(args.name, args.dest, store=args.store)
    if present < n:
        print(f"pffs pull: {args.dest}: {n - present} of {n} pages are not in the bucket;"
              " the session is incomplete", file=sys.stderr)
        return 1
    print(f"{args.dest}: pulled {args.name} ({n} pages, metadata only)")
    return 0


def _cmd_ls_remote(args) -> int:
    blobs = store_of(args.path, args.store)
    items = ls_remote(blobs)
    if args.json:
        print(json.dumps([{"name": p.name, "pages": p.pages, "bytes": p.size,
                           "modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.modified))}
                          for p in items], indent=2))
        return 0
    for p in items:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.modified))
        pages = "?" if p.pages is None else str(p.pages)
        print(f"{p.name}\t{pages} pages\t{when}")
    return 0


def _cmd_rm_remote(args) -> int:
    blobs = store_of(args.path, args.store)
    rm_remote(blobs, args.name)
    print(f"{args.name}: no longer published in {blobs.url} (gc may now free its pages)")
    return 0
