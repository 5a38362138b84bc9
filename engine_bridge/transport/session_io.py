"""What the bridge writes a session into and reads one from: the sink and
source protocols every way bytes travel implements (folders, memory, a
mount's store), and base classes giving their optional members' defaults.

Every optional ability is a member of the protocol, so the bridge calls it
directly: a sink or source subclassing :class:`SinkBase` / :class:`SourceBase`
has the defaults and overrides what it can do better.  An object with only
the core methods (written against the protocols before these members, or
elsewhere) is wrapped by ``engine_bridge.transport.choose.as_sink`` /
``as_source`` in an adapter supplying the same defaults.
"""

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

    #: True: write_page may be called from several threads at once, pages in any order.
    concurrent: bool

    def expect_values(self, itemsize: int) -> None:
        """Each page's values are *itemsize* bytes (fp8 pages: 1): a sink that
        encodes pages may choose its codec by it (pffs.codec.for_itemsize)."""

    def write_page(self, ix: int, data: memoryview) -> Digest: ...

    def write_manifest(self, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class SessionSource(Protocol):
    """Gives one session's manifest and page bytes.

    ``read_page`` returns the exact bytes of a page file and raises
    FileNotFoundError for a missing one.  The rest let a source that can do
    better say so (:class:`SourceBase` has the defaults):

    - ``page_digest(ix)``: the page's digest without reading it (a filesystem
      that knows it), else None;
    - ``page_size(ix)``: the page's size without reading it (FileNotFoundError
      for a missing page), or None where the source cannot tell without
      reading: the bridge then skips its size and completeness pre-check;
    - ``read_page_into(ix, out)``: fill *out* when the page is exactly
      ``len(out)`` bytes; return the page's size either way;
    - ``read_page_into_checked(ix, out)``: as read_page_into, with the digest
      the bytes read are checked to have (a frame's name and crc32), or None
      when the bridge must hash them;
    - ``why_mismatch(ix)``: why a page whose sha256 differs from the
      manifest's is damaged, to refuse it with (DamagedPage), or None for the
      bridge's own refusal (DigestMismatch / SourceChanged).
    """

    def read_manifest(self) -> bytes: ...

    def read_page(self, ix: int) -> bytes: ...

    def page_digest(self, ix: int) -> Digest | None: ...

    def page_size(self, ix: int) -> int | None: ...

    def read_page_into(self, ix: int, out: memoryview) -> int: ...

    def read_page_into_checked(self, ix: int, out: memoryview) -> tuple[int, Digest | None]: ...

    def why_mismatch(self, ix: int) -> str | None: ...


@runtime_checkable
class PageSink(Protocol):
    """What ``Bridge.write_blocks`` needs: pages and no session (a
    :class:`~engine_bridge.transport.store_blobs.BlobSink`); ``concurrent``
    as a :class:`SessionSink`'s."""

    concurrent: bool

    def write_page(self, ix: int, data: memoryview) -> Digest: ...


@runtime_checkable
class CoreSink(Protocol):
    """The methods a sink cannot do without (as_sink wraps one with only these)."""

    def write_page(self, ix: int, data: memoryview) -> Digest: ...

    def write_manifest(self, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class CoreSource(Protocol):
    """The methods a source cannot do without (as_source wraps one with only these)."""

    def read_manifest(self) -> bytes: ...

    def read_page(self, ix: int) -> bytes: ...


class SinkBase:
    """A :class:`SessionSink`'s defaults: pages from one thread, in order."""

    concurrent: bool = False

    def expect_values(self, itemsize: int) -> None:
        """(the store's own codec for any values)"""


class SourceBase:
    """A :class:`SessionSource`'s defaults: nothing known without reading the
    page, and pages read with ``read_page`` (subclasses define
    ``read_manifest`` and ``read_page``)."""

    def read_page(self, ix: int) -> bytes:
        raise NotImplementedError

    def page_digest(self, ix: int) -> Digest | None:
        return None

    def page_size(self, ix: int) -> int | None:
        return None

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


#: What page_out takes: a sink (a foreign one with only the core methods too) or a path.
SinkLike = Union[SessionSink, CoreSink, str, os.PathLike]
#: What page_in takes: a source (a foreign one with only the core methods too) or a path.
SourceLike = Union[SessionSource, CoreSource, str, os.PathLike]
