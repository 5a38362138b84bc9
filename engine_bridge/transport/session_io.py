"""What the bridge writes a session into and reads one from: the sink and
source protocols every way bytes travel implements (folders, memory, a
mount's store)."""

from __future__ import annotations

import os
from typing import Protocol, Union, runtime_checkable

from pffs.types import Digest


@runtime_checkable
class SessionSink(Protocol):
    """Receives one session: pages (any order), then the manifest, then commit.

    ``write_page`` must consume *data* before it returns (the buffer is the
    bridge's staging memory and is reused) and return the page's digest.
    ``commit`` makes the session visible at once and raises FileExistsError
    if the name is taken; ``abort`` discards everything written.  Pages are
    written from one thread, in order, unless the sink sets
    ``concurrent = True``: then several pages may be written at once.
    """

    def write_page(self, ix: int, data: memoryview) -> Digest: ...

    def write_manifest(self, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class SessionSource(Protocol):
    """Gives one session's manifest and page bytes.

    ``read_page`` returns the exact bytes of a page file and raises
    FileNotFoundError for a missing one.  ``page_digest`` may return the
    digest of a page without reading it (a filesystem that knows it), else
    None.  Sources may also offer ``page_size(ix) -> int`` and
    ``read_page_into(ix, out) -> int`` (fill *out* when the page is exactly
    ``len(out)`` bytes; return the page's size); the bridge uses them when
    present to check sizes without reading and to read without copying.
    """

    def read_manifest(self) -> bytes: ...

    def read_page(self, ix: int) -> bytes: ...

    def page_digest(self, ix: int) -> Digest | None: ...


SinkLike = Union[SessionSink, str, os.PathLike]
SourceLike = Union[SessionSource, str, os.PathLike]
