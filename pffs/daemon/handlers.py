"""The handlers of a mount, assembled: ``build`` is their composition root.
It makes every part of fs/ and live/ and hands each its collaborators, so
neither folder builds the other's parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyfuse3
import trio

from pffs import namespace as ns
from pffs.fs.blobcache import BlobCache, BlobReader
from pffs.fs.content import ContentStore
from pffs.fs.db import Database
from pffs.fs.files import NOFLUSH, Files
from pffs.fs.inodes import InodeTable, Invalidator
from pffs.fs.manifests import Manifests
from pffs.fs.namespace_tree import NamespaceTree
from pffs.fs.operations import COPY_RANGE, FALLOCATE, SPIN, Operations
from pffs.fs.prefetch import Prefetch
from pffs.fs.routing import ENGINES, NAMESPACE, PFFS, Tree
from pffs.fs.virtual import PffsTree
from pffs.live.engines import Registry
from pffs.live.handles import LiveStore
from pffs.live.numbering import KernelCache
from pffs.live.view import EnginesTree

log = logging.getLogger("pffs.fs")      # (what the handlers log, with fs/)


@dataclass
class Handlers:
    """The parts ``build`` made, for the daemon (and handler-level tests)."""

    ops: Operations
    inodes: InodeTable
    files: Files
    prefetch: Prefetch
    reader: BlobReader
    invalidate: Invalidator
    manifests: Manifests
    pffs: PffsTree
    engines: EnginesTree | None      # (with live_mount: its registry is the engine socket's)

    @property
    def db(self) -> Database:
        return self.files.db

    @property
    def content(self) -> ContentStore:
        return self.files.content

    @property
    def cache(self) -> BlobCache:
        return self.reader.cache

    def stop(self) -> None:
        self.prefetch.stop()


def build(db: Database, content: ContentStore, *, nursery: trio.Nursery | None, cache_size: int = 128 << 20,
          staging_memory: int = 128 << 20, journal_fsync: bool = True, live_mount: str | None = None,
          socket_path: str = "", store_root: str = "", store_json: bytes = b"{}\n",
          read_only: bool = False, prefix_cache_size: int = 4 << 30) -> Handlers:
    """The handlers of a mount of *db* and *content*, their work in the
    background going to *nursery* (the daemon's, opened before anything is
    built; None: none runs, as in handler tests without a daemon); with
    *live_mount* (where the mount is, for engines told of paths in it) they
    serve ``engines/`` too, which needs the nursery.  *read_only*: every
    change refused with EROFS.  *prefix_cache_size*: bytes the key-only prefix
    cache keeps (SPEC §7)."""
    if not (COPY_RANGE and NOFLUSH):
        log.info("pyfuse3 %s without third_party/pyfuse3's patch: copies within the mount move "
                 "their bytes (no copy_file_range), and a reader's close costs a FLUSH request",
                 getattr(pyfuse3, "__version__", "?"))
    elif not (SPIN and FALLOCATE):
        off = [what for on, what in ((SPIN, "a request sent just after a reply is waited for in trio's"
                                            " scheduler"),
                                     (FALLOCATE, "fallocate answers EOPNOTSUPP")) if not on]
        log.info("pyfuse3 %s built with an older third_party/pyfuse3 patch (PFFS_PATCH %s): %s",
                 getattr(pyfuse3, "__version__", "?"), getattr(pyfuse3, "PFFS_PATCH", "?"), "; ".join(off))
    inodes = InodeTable(db)
    reader = BlobReader(content, BlobCache(cache_size), inodes.path_of)
    prefetch = Prefetch(db, reader)
    invalidate = Invalidator(inodes)
    files = Files(db, content, inodes, reader, prefetch, invalidate, nursery,
                  staging_memory=staging_memory, journal_fsync=journal_fsync)
    manifests = Manifests(db, content, inodes, files, reader, invalidate)
    # The attached engines, told of what the kernel may keep of engines/.
    registry = None if live_mount is None else Registry(KernelCache(invalidate), mountpoint=live_mount)
    requests: dict[str, int] = {}
    pffs = PffsTree(db, reader, requests, socket_path, store_root, store_json, files.copies,
                    registry.counts if registry is not None else None, content.named,
                    content.publisher.counts if content.publisher is not None else None)
    trees: dict[str, Tree] = {
        NAMESPACE: NamespaceTree(db, content, inodes, files, manifests, prefetch, invalidate,
                                 store_json, prefix_cache_size),
        PFFS: pffs,
    }
    engines = None
    if registry is not None:
        assert nursery is not None, "engines/ runs work in the daemon's nursery"
        store = LiveStore(
            # A page named by its blob in a session being copied in: its bytes, when
            # something reads or changes them before the engine takes the session.
            fetch_blob=lambda digest: reader.blob(digest, ns.ROOT_INODE),
            # A live page copied out of engines/ is stored as a blob (ahead of the copy) ...
            store_blob=lambda data, digest=None: content.workers.call(content.store_bytes, data, digest),
            # ... or stored by the engine itself, straight into the store, and adopted.
            adopt_blobs=((lambda digests: content.workers.call(content.adopt_stored, digests))
                         if content.can_adopt_stored else None))
        engines = trees[ENGINES] = EnginesTree(registry, store, manifests, nursery)
    return Handlers(Operations(trees, requests, files.copies, read_only), inodes, files, prefetch, reader,
                    invalidate, manifests, pffs, engines)
