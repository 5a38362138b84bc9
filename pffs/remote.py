"""Sessions and mounts that share one bucket: push, pull, registrations, bucket gc.

A mount of an S3 store (pffs.store.s3) registers itself in the bucket at
``PREFIX/mounts/<ID>``: the digests its namespace references (every blob a
file holds, every page a manifest lists), written at mount, rewritten within
``LEASE_CHECK`` of a change and at least every third of its lease, and once
more at unmount.  A registration protects its digests from gc until it
expires: one lease (``-o lease=``, default 1 h) after its last write while
mounted, ``KEEP_UNMOUNTED`` after a clean unmount (the namespace still names
those blobs; a remount renews it).  The ID lives in the cache folder, so a
remount, even after a crash, takes over its own registration.

``pffs push SESSION [NAME]`` publishes a manifest (the user's bytes) at
``PREFIX/manifests/NAME`` once every page it lists is in the bucket;
``pffs pull NAME DEST`` writes it into DEST/manifest.json of a mount with an
empty DEST/pages, and the mount's adoption makes every page appear at once:
page digests the namespace does not know are looked up in the bucket (HEADs
in parallel, in a content thread, outside the SQLite write lock) and get a
blob row each before the metadata-only fork runs.  No page bytes move.

Bucket gc (``pffs gc`` on an S3 store) keeps every blob a published manifest
or an unexpired registration lists, and anything younger than the grace
period.  It deletes in two steps: an unreferenced blob is first moved to
``PREFIX/trash/`` (reads fall back to it and put it back), and only a trash
entry still unreferenced a grace period later is deleted.  So a reference
that appears while gc runs (a pull, a fork, a dedup hit in another mount) is
healed rather than lost: it reaches a registration within a lease check,
long before the grace period ends.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sqlite3
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zstandard

from . import manifest as mf
from . import namespace as ns
from .errors import PffsError, StoreUnavailable
from .store.s3 import BLOBS, MANIFESTS, MOUNTS, TRASH, S3BlobStore, open_url, url_of
from .types import Digest, is_digest

log = logging.getLogger("pffs.remote")

DEFAULT_LEASE = 3600.0
LEASE_CHECK = 60.0                 # a mount looks for new references at least this often
KEEP_UNMOUNTED = 30 * 86400.0      # a cleanly unmounted store's registration lasts this long
MEMORY_CACHE_MAX = 256 << 20       # decoded blobs kept in memory by an S3 mount
REGISTRATION_FORMAT = "pffs-mount-1"
MOUNT_ID_NAME = "mount-id"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._\-]*(/[A-Za-z0-9_][A-Za-z0-9._\-]*)*\Z")


# -- a mount's registration ----------------------------------------------------

def mount_id(root: Path) -> str:
    """This cache folder's registration id (made on first use)."""
    path = root / MOUNT_ID_NAME
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    ident = f"{socket.gethostname()[:40]}-{os.urandom(6).hex()}"
    ident = re.sub(r"[^A-Za-z0-9.\-]", "-", ident)
    tmp = root / f".{MOUNT_ID_NAME}.{os.getpid()}"
    tmp.write_text(ident + "\n")
    os.replace(tmp, path)
    return ident


def encode_registration(reg: dict) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(reg).encode())


def decode_registration(body: bytes) -> dict:
    data = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
    reg = json.loads(data)
    if not isinstance(reg, dict) or reg.get("format") != REGISTRATION_FORMAT:
        raise ValueError("not a pffs mount registration")
    return reg


class RemoteMount:
    """A mounted S3 store's registration in the bucket, and its adoption of known pages.

    The registration is renewed by a plain thread with its own read
    connection to the namespace, so neither the event loop nor the writer
    thread waits on the network for it.
    """

    def __init__(self, root: Path, blobs: S3BlobStore, db, lease: float = DEFAULT_LEASE):
        self.root = root
        self.blobs = blobs
        self.db = db
        self.lease = lease
        self.check = min(LEASE_CHECK, lease / 4)
        self.id = mount_id(root)
        self.key = MOUNTS + self.id
        self._pinned: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written: tuple[frozenset, float] | None = None  # (digests, monotonic time) of the last write
        self._reachable = True
        self._conn: sqlite3.Connection | None = None
        self._local = threading.local()  # a read connection per content thread

    def _references(self) -> tuple[set[str], set[str]]:
        """(every digest to list, the pinned ones among them)."""
        if self._conn is None:
            self._conn = ns.connect(self.db.path)
        with self._lock:
            pinned = set(self._pinned)
        return set(ns.iter_referenced_blobs(self._conn)) | pinned, pinned

    def _write(self, digests: set[str], state: str, ttl: float) -> None:
        reg = {"format": REGISTRATION_FORMAT, "id": self.id, "host": socket.gethostname(),
               "pid": os.getpid(), "cache": str(self.root), "state": state, "ttl": ttl,
               "written": time.time(), "digests": sorted(digests)}
        self.blobs.put_object(self.key, encode_registration(reg),
                              {"state": state, "ttl": str(int(ttl)), "digests": str(len(digests))},
                              background=True)

    def renew(self, force: bool = False) -> bool:
        """Rewrite the registration if the references changed or a third of the lease passed."""
        digests, pinned = self._references()
        refs = frozenset(digests)
        last = self._written
        if not force and last is not None and last[0] == refs \
                and time.monotonic() - last[1] < self.lease / 3:
            return False
        self._write(digests, "mounted", self.lease)
        self._written = (refs, time.monotonic())
        with self._lock:
            self._pinned -= pinned
        return True

    def start(self) -> None:
        self.renew(force=True)  # before the mount answers: fails the mount if the bucket does not
        self._thread = threading.Thread(target=self._loop, name="pffs-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.check)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.renew()
            except StoreUnavailable as e:
                if self._reachable:
                    log.warning("registration not renewed, bucket unreachable: %s", e)
                    self._reachable = False
                continue
            except (sqlite3.Error, OSError) as e:
                log.warning("registration not renewed: %s", e)
                continue
            if not self._reachable:
                log.info("bucket reachable again; registration %s renewed", self.key)
                self._reachable = True

    def stop(self) -> None:
        """At unmount: the registration stays, as an unmounted store's, for KEEP_UNMOUNTED."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        try:
            self._write(self._references()[0], "unmounted", KEEP_UNMOUNTED)
        except (StoreUnavailable, sqlite3.Error, OSError) as e:
            log.warning("unmount: registration %s not updated (%s); it expires with its lease",
                        self.key, e)
        if self._conn is not None:
            self._conn.close()
        self.blobs.close()

    def known(self, digest: str) -> bool:
        """Whether the namespace has a blob row for *digest* (from any thread)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = ns.connect(self.db.path, readonly=True)
        return conn.execute("SELECT 1 FROM blobs WHERE digest=?", (digest,)).fetchone() is not None

    def adopt(self, pages: list[str]) -> int:
        """Give the pages a manifest lists that the namespace lacks a blob row each, if the bucket has them.

        Runs in a content thread, before the transaction that forks them.
        Rows of blobs nothing here references any more are checked too: the
        bucket's gc may have removed them since (our registration no longer
        listed them), and a fork must not bring back a page without bytes.
        The lookups run outside the SQLite write lock; the registration is
        nudged so that what was found is listed in it within moments.
        """
        want = {p for p in pages if is_digest(p)}
        if not want:
            return 0
        with self.db.rw_lock:
            known = ns.known_blobs(self.db.rw, want)
            held = _referenced(self.db.rw, known.keys())
        unknown = want - known.keys()
        unheld = set(known) - held
        if not unknown and not unheld:
            return 0
        rows = self.blobs.lookup_many(unknown | unheld)
        gone = unheld - rows.keys()
        new = [r for d, r in rows.items() if d in unknown]
        if rows:
            with self._lock:
                self._pinned |= rows.keys()
            self._wake.set()
        if new or gone:
            self.db.run_in_transaction(_update_blob_rows, new, sorted(gone))
        if unknown:
            log.info("looked up %d pages in %s: %d found%s", len(unknown), self.blobs.url, len(new),
                     "" if len(new) == len(unknown) else f", {len(unknown) - len(new)} missing")
        if gone:
            log.info("%d pages listed by a manifest are no longer in %s (gc removed them)",
                     len(gone), self.blobs.url)
        return len(new)


def _referenced(conn: sqlite3.Connection, digests) -> set[str]:
    """Which of *digests* a file holds or a manifest lists in this namespace."""
    out: set[str] = set()
    uniq = list(digests)
    for k in range(0, len(uniq), 400):
        chunk = uniq[k:k + 400]
        marks = ",".join("?" * len(chunk))
        out.update(d for (d,) in conn.execute(
            f"SELECT blob FROM blocks WHERE blob IN ({marks}) AND via IS NULL"
            f" UNION SELECT digest FROM manifest_pages WHERE digest IN ({marks})", chunk + chunk))
    return out


def _update_blob_rows(conn: sqlite3.Connection, new: list[ns.BlobRow], gone: list[str]) -> None:
    ns.insert_blob_rows(conn, new)
    for d in gone:
        # Only if still unreferenced: a commit since may have named it (and
        # then its own put or lookup found it stored).
        conn.execute("DELETE FROM blobs WHERE digest=?"
                     " AND NOT EXISTS (SELECT 1 FROM blocks WHERE blob=? AND via IS NULL)"
                     " AND NOT EXISTS (SELECT 1 FROM manifest_pages WHERE digest=?)", (d, d, d))


def attach(daemon) -> RemoteMount:
    """Set up a daemon of an S3 store: cache sizes, adoption, the registration."""
    from .gc import parse_duration
    st, opts = daemon.store, daemon.opts
    logging.getLogger("botocore").setLevel(logging.WARNING)  # credentials and endpoint notes each start
    blobs: S3BlobStore = st.blobs
    blobs.set_cache_limit(opts.cache_size)
    daemon.ops.cache.limit = min(daemon.ops.cache.limit, MEMORY_CACHE_MAX)
    # A close of an S3 store mostly waits on the network: let as many closes
    # run at once as there are upload threads (the CPU work in them is small).
    content = daemon.ops.content
    content.set_width(max(content.width, blobs.threads))
    lease = parse_duration(opts.remote["lease"]) if opts.remote.get("lease") else DEFAULT_LEASE
    if lease < 1:
        raise PffsError("lease must be at least 1s")
    rm = RemoteMount(st.root, blobs, daemon.db, lease)
    rm.start()
    daemon.ops.content.adopt = rm.adopt
    daemon.ops.content.remote = True
    blobs.likely_stored = rm.known
    log.info("blobs in %s (cache %s, up to %d bytes); registered as %s, lease %.0f s",
             blobs.url, st.root, blobs.cache.limit, rm.key, lease)
    return rm


# -- finding the bucket from the command line ---------------------------------------

def store_of(path: str | os.PathLike | None, store: str | None) -> S3BlobStore:
    """The S3 store named by --store (URL or cache folder), else the one the mount holding *path* uses."""
    from .storedir import StoreDir
    from .tools import daemon_info, pffs_root
    if store:
        url = url_of(store)
        if url is not None:
            return open_url(url)
        sd = StoreDir(store)
        if sd.url is None:
            raise PffsError(f"{store} is a local store; push, pull and ls-remote need an s3:// store")
        return sd.blobs
    where = Path(path or ".")
    mnt = pffs_root(where if where.exists() else where.parent)
    if mnt is None:
        raise PffsError(f"{where} is not in a mounted pffs (give --store s3://BUCKET/PREFIX)")
    folder = daemon_info(mnt).get("store")
    sd = StoreDir(folder) if folder else None
    if sd is None or sd.url is None:
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
    from .tools import place_manifest
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


# -- bucket gc ---------------------------------------------------------------------------

@dataclass
class BucketGcResult:
    dry_run: bool
    manifests: int = 0
    registrations: int = 0          # unexpired registrations honoured
    expired: list[str] = field(default_factory=list)  # registrations that no longer protect anything
    blobs: int = 0
    live: int = 0
    young: int = 0
    trashed: int = 0
    trashed_bytes: int = 0
    restored: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    trash_kept: int = 0
    deleted_digests: list[str] = field(default_factory=list)
    trashed_digests: list[str] = field(default_factory=list)

    def summary(self) -> str:
        would = "would " if self.dry_run else ""
        parts = [f"{self.live} of {self.blobs} blobs referenced by {self.manifests} published manifests"
                 f" and {self.registrations} registered stores",
                 f"{would}set aside {self.trashed} unreferenced blobs ({self.trashed_bytes} bytes)",
                 f"{would}delete {self.deleted} set aside a grace period ago ({self.deleted_bytes} bytes)"]
        if self.restored:
            parts.append(f"{would}put back {self.restored} set-aside blobs that are referenced again")
        if self.young:
            parts.append(f"{self.young} unreferenced blobs younger than the grace period kept")
        if self.trash_kept:
            parts.append(f"{self.trash_kept} set-aside blobs kept until their grace period ends")
        if self.expired:
            parts.append(f"{would}drop {len(self.expired)} expired registrations")
        return ", ".join(parts)


def bucket_references(blobs: S3BlobStore, now: float, r: BucketGcResult) -> set[str]:
    """Digests listed by published manifests and unexpired registrations."""
    refs: set[str] = set()
    names = [n for n, _, _ in blobs.list_area(MANIFESTS)]
    for name, got in zip(names, blobs.pool.map(lambda n: blobs.get_object(MANIFESTS + n), names)):
        if got is None:
            continue
        try:
            refs.update(mf.parse(got[0]).pages)
        except mf.ManifestError as e:
            log.warning("published manifest %s is not valid (%s); it protects nothing", name, e)
            continue
        r.manifests += 1
    for ident, _size, _mtime in list(blobs.list_area(MOUNTS)):
        got = blobs.get_object(MOUNTS + ident)
        if got is None:
            continue
        body, meta = got
        try:
            reg = decode_registration(body)
            ttl = float(reg["ttl"])
        except (ValueError, KeyError, TypeError, zstandard.ZstdError) as e:
            log.warning("registration %s is unreadable (%s); it protects nothing", ident, e)
            continue
        if meta["last_modified"] + ttl < now:
            r.expired.append(ident)
            continue
        refs.update(d for d in reg.get("digests", ()) if is_digest(d))
        r.registrations += 1
    return refs


def collect_cli(store: str, **kw) -> BucketGcResult:
    """``pffs gc --store s3://…`` (the bucket alone) or ``--store CACHE_FOLDER`` (its namespace too)."""
    from .storedir import StoreDir
    url = url_of(store)
    if url is not None:
        return collect(open_url(url), **kw)
    sd = StoreDir(store)
    return collect(sd.blobs, namespace_root=sd.root if sd.exists() else None, **kw)


def collect(blobs: S3BlobStore, *, grace: float, dry_run: bool = False,
            progress: Callable[[int, int], None] | None = None,
            namespace_root: Path | None = None) -> BucketGcResult:
    """gc of the bucket, safe while mounts use it (see the module's docstring)."""
    r = BucketGcResult(dry_run=dry_run)
    now = blobs.server_time()
    cutoff = now - grace
    refs = bucket_references(blobs, now, r)
    if namespace_root is not None:
        # A cache folder's own namespace counts, mounted or not.
        conn = ns.open_db(namespace_root, create_missing=False)
        try:
            refs.update(ns.iter_referenced_blobs(conn))
        finally:
            conn.close()
    listed = list(blobs.iter_blobs(BLOBS))
    trash = list(blobs.iter_blobs(TRASH))
    present = {d for d, _, _ in listed}
    r.blobs = len(listed)
    total, done = len(listed) + len(trash), 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    for d, size, mtime in trash:
        tick()
        if d in present:
            if not dry_run:
                blobs.delete_object(_rel(blobs, d, TRASH))  # already back in place
        elif d in refs:
            r.restored += 1
            if not dry_run and blobs.copy_object(_rel(blobs, d, TRASH), _rel(blobs, d, BLOBS)):
                blobs.delete_object(_rel(blobs, d, TRASH))
        elif mtime <= cutoff:
            r.deleted += 1
            r.deleted_bytes += size
            r.deleted_digests.append(d)
            if not dry_run:
                blobs.delete_object(_rel(blobs, d, TRASH))
        else:
            r.trash_kept += 1
    for d, size, mtime in listed:
        tick()
        if d in refs:
            r.live += 1
        elif mtime > cutoff:
            r.young += 1
        else:
            r.trashed += 1
            r.trashed_bytes += size
            r.trashed_digests.append(d)
            if not dry_run and blobs.copy_object(_rel(blobs, d, BLOBS), _rel(blobs, d, TRASH)):
                blobs.delete_object(_rel(blobs, d, BLOBS))
    if not dry_run:
        for ident in r.expired:
            blobs.delete_object(MOUNTS + ident)
    return r


def _rel(blobs: S3BlobStore, d: Digest, area: str) -> str:
    """A blob's key relative to the prefix."""
    return blobs.key(d, area)[len(blobs.prefix):]


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
