"""Sessions in memory: a sink that, once committed, is also a source."""

from __future__ import annotations

import errno

from engine_bridge.transport.session_io import SinkBase, SourceBase
from pffs.manifest import page_name
from pffs.names import MANIFEST_NAME
from pffs.types import Digest, digest_of


class MemorySession(SinkBase, SourceBase):
    """A session held in memory: a sink that, once committed, is also a source.

    It knows each page's digest from when it was written, and its bytes
    cannot change, so it offers them as :meth:`page_digest`.
    """

    concurrent = True

    def __init__(self) -> None:
        self.pages: dict[int, bytes] = {}
        self.digests: dict[int, Digest] = {}
        self.manifest: bytes | None = None
        self.committed = False
        self._staged: dict[int, tuple[bytes, Digest]] = {}
        self._manifest: bytes | None = None

    def write_page(self, ix: int, data: memoryview) -> Digest:
        b = bytes(data)
        d = digest_of(b)
        self._staged[ix] = (b, d)
        return d

    def write_manifest(self, data: bytes) -> None:
        self._manifest = bytes(data)

    def commit(self) -> None:
        if self.committed:
            raise FileExistsError(errno.EEXIST, "session exists", "<memory>")
        self.pages = {ix: b for ix, (b, _) in self._staged.items()}
        self.digests = {ix: d for ix, (_, d) in self._staged.items()}
        self.manifest, self.committed = self._manifest, True
        self._staged = {}

    def abort(self) -> None:
        self._staged, self._manifest = {}, None

    def read_manifest(self) -> bytes:
        if self.manifest is None:
            raise FileNotFoundError(errno.ENOENT, "no manifest", MANIFEST_NAME)
        return self.manifest

    def read_page(self, ix: int) -> bytes:
        try:
            return self.pages[ix]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "no such page", page_name(ix)) from None

    def page_size(self, ix: int) -> int:
        return len(self.read_page(ix))

    def page_digest(self, ix: int) -> Digest | None:
        return self.digests.get(ix)
