"""Sessions straight into (and out of) an unmounted store, without FUSE.

:class:`StoreSessionSink` implements the engine bridge's sink protocol
(``write_page``, ``write_manifest``, ``commit``, ``abort``): pages become
blobs as they arrive (hashed and compressed by the caller's thread), and
``commit`` makes the whole session appear at once in one namespace
transaction, after the blobs are fsynced.  :class:`StoreSessionSource` reads
one back.  Both take the store's lock only while they touch the namespace, so
they refuse a store that a daemon has mounted (write through the mount then).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from pffs import manifest as mf
from pffs import namespace as ns
from pffs.errors import PffsError
from pffs.store.storedir import StoreDir
from pffs.types import Digest, digest_of

if TYPE_CHECKING:
    from pffs.store.base import BlobStore


def _split(path: str) -> list[bytes]:
    parts = [p for p in PurePosixPath("/" + path.strip("/")).parts[1:]]
    for p in parts:
        if p in (".", ".."):
            raise PffsError(f"{path!r}: '.' and '..' are not allowed in a session path")
    return [p.encode() for p in parts]


def _resolve(conn, parts: list[bytes]) -> int | None:
    ino: int = ns.ROOT_INODE
    for p in parts:
        nxt = ns.lookup(conn, ino, p)
        if nxt is None:
            return None
        ino = nxt
    return ino


class StoreSessionSink:
    """Write one session at PATH (relative to the store's root) of an unmounted store."""

    # write_page may be called from several threads at once (puts are thread-safe).
    concurrent = True

    def expect_values(self, itemsize: int) -> None:
        """(the store's own codec for any values)"""

    def __init__(self, store: str | os.PathLike | StoreDir | None, path: str, *,
                 uid: int | None = None, gid: int | None = None, codec: str | None = None):
        self.store = store if isinstance(store, StoreDir) else StoreDir(store, codec)
        self.parts = _split(path)
        if not self.parts:
            raise PffsError("a session needs a name below the store's root")
        self.path = path
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.store.create()
        self.batch = self.store.blobs.batch()
        self.pages: dict[int, ns.BlobRow] = {}
        self.manifest_bytes: bytes | None = None
        self.manifest: mf.Manifest | None = None

    def write_page(self, ix: int, data) -> Digest:
        d = digest_of(data)
        blobs: BlobStore = self.store.blobs  # either store, with a batch of its own
        r = blobs.put(data, d, batch=self.batch)
        self.pages[ix] = ns.BlobRow(d, r.raw_size, r.stored_size, r.codec)
        return d

    def write_manifest(self, data: bytes) -> None:
        self.manifest = mf.parse(data)
        self.manifest_bytes = bytes(data)

    def commit(self) -> None:
        manifest, man = self.manifest, self.manifest_bytes
        if manifest is None or man is None:  # write_manifest sets both
            raise PffsError("commit before write_manifest")
        for i, want in enumerate(manifest.pages):
            have = self.pages.get(i)
            if have is None or have.digest != want:
                raise PffsError(f"page {mf.page_name(i)} was not written as the manifest lists it")
        self.store.lock("pffs session writer")
        try:
            # gc may have swept pages put longer than its grace period ago:
            # under the gc lock, make sure every one is still stored.
            with self.store.gc_lock.shared():
                missing = self.batch.sync()
                missing += [Digest(r.digest) for r in self.pages.values()
                            if not self.store.blobs.contains(Digest(r.digest))]
                if missing:
                    raise PffsError(f"page blob {missing[0]} was removed by gc before the session"
                                    " was committed; write the session again")
                man_digest = digest_of(man)
                man_row = ns.BlobRow(man_digest, len(man), 0, "")
                r = self.store.blobs.put(man, man_digest)
                man_row.stored_size = r.stored_size
                man_row.codec = r.codec
                conn = ns.open_db(self.store.root)
                try:
                    with ns.transaction(conn):
                        self._commit(conn, manifest, man_row)
                finally:
                    conn.close()
        finally:
            self.store.unlock()

    def _commit(self, conn, manifest: mf.Manifest, man_row: ns.BlobRow) -> None:
        parent: int = ns.ROOT_INODE
        for p in self.parts[:-1]:
            nxt = ns.lookup(conn, parent, p)
            if nxt is None:
                nxt = ns.make_inode(conn, parent, p, stat.S_IFDIR | 0o755, self.uid, self.gid).id
            parent = nxt
        if ns.lookup(conn, parent, self.parts[-1]) is not None:
            raise FileExistsError(errno.EEXIST, "session already exists", self.path)
        sdir = ns.make_inode(conn, parent, self.parts[-1], stat.S_IFDIR | 0o755, self.uid, self.gid).id
        pdir = ns.make_inode(conn, sdir, mf.PAGES_DIR.encode(), stat.S_IFDIR | 0o755,
                             self.uid, self.gid).id
        rows = list(self.pages.values()) + [man_row]
        for ix in sorted(self.pages):
            row = self.pages[ix]
            f = ns.make_inode(conn, pdir, mf.page_name(ix).encode(), stat.S_IFREG | 0o644, self.uid, self.gid)
            ns.set_content(conn, f.id, row.raw_size, row.digest, [row.digest] if row.raw_size else [],
                           rows if ix == 0 else [], None)
        m = ns.make_inode(conn, sdir, mf.MANIFEST_NAME.encode(), stat.S_IFREG | 0o644, self.uid, self.gid)
        ns.set_content(conn, m.id, man_row.raw_size, man_row.digest, [man_row.digest], rows, None)
        ns.record_manifest(conn, m.id, manifest.pages, man_row.digest, ns.manifest_keys(manifest))

    def abort(self) -> None:
        # Blobs already written stay as garbage for gc; nothing names them.
        self.pages.clear()


class StoreSessionSource:
    """Read a session at PATH of an unmounted store (verified blob reads).

    It implements the engine bridge's source protocol whole, its optional
    members included (pffs does not import the bridge, so they are written
    out here, as engine_bridge.transport.session_io.SourceBase has them):
    pages are read with ``read_page`` and hashed by the bridge.
    """

    def __init__(self, store: str | os.PathLike | StoreDir | None, path: str):
        self.store = store if isinstance(store, StoreDir) else StoreDir(store)
        self.conn = ns.open_db(self.store.root, create_missing=False)
        ino = _resolve(self.conn, _split(path))
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "no such session", path)
        self.dir = ino
        self.path = path
        p = ns.lookup(self.conn, ino, mf.PAGES_DIR.encode())
        if p is not None and ns.is_folded(self.conn, p):
            with ns.transaction(self.conn):   # a fork nothing looked into yet: its files first
                ns.unfold(self.conn, p)
        self.pages_dir = p

    def _file(self, parent: int | None, name: str) -> int:
        ino = ns.lookup(self.conn, parent, name.encode()) if parent is not None else None
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "missing", f"{self.path}/{name}")
        return ino

    def read_manifest(self) -> bytes:
        return ns.read_file(self.conn, self.store.blobs, self._file(self.dir, mf.MANIFEST_NAME),
                            mf.MAX_MANIFEST_BYTES)

    def read_page(self, ix: int) -> bytes:
        return ns.read_file(self.conn, self.store.blobs, self._file(self.pages_dir, mf.page_name(ix)))

    def page_digest(self, ix: int) -> Digest | None:
        node = ns.get_inode(self.conn, self._file(self.pages_dir, mf.page_name(ix)))
        return Digest(node.digest) if node.digest else None

    def page_size(self, ix: int) -> int:
        return ns.get_inode(self.conn, self._file(self.pages_dir, mf.page_name(ix))).size

    def read_page_into(self, ix: int, out: memoryview) -> int:
        data = self.read_page(ix)
        out = memoryview(out).cast("B")
        if len(data) == out.nbytes:
            out[:] = data
        return len(data)

    def read_page_into_checked(self, ix: int, out: memoryview) -> tuple[int, Digest | None]:
        return self.read_page_into(ix, out), None

    def why_mismatch(self, ix: int) -> str | None:
        return None

    def close(self) -> None:
        self.conn.close()
