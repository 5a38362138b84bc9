"""Which sink or source a path gets: the direct path where the mount's store
allows it (engine_bridge.transport.direct), else the folder through the
mount (engine_bridge.transport.folders); a sink or source given is used as is,
or, where it has only the core methods, wrapped in an adapter that supplies
the protocol's optional members with their defaults
(engine_bridge.transport.session_io).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine_bridge.transport.direct import DirectSink, DirectSource
from engine_bridge.transport.folders import DirSink, DirSource
from engine_bridge.transport.mountinfo import store_access
from engine_bridge.transport.session_io import (
    CoreSink,
    CoreSource,
    PageSink,
    SessionSink,
    SessionSource,
    SinkBase,
    SinkLike,
    SourceBase,
    SourceLike,
)
from pffs.types import Digest


def sink_for(dest: str | os.PathLike):
    """A sink writing a session at *dest*: direct where it can be, else a DirSink."""
    access = store_access(Path(dest).parent)
    if access is None:
        return DirSink(dest)
    return DirectSink(dest, access)


def source_for(path: str | os.PathLike):
    """A source reading the session at *path*: direct where it can be, else a DirSource."""
    access = store_access(path)
    if access is None:
        return DirSource(path)
    return DirectSource(path, access)


class PageSinkAdapter(SinkBase):
    """A sink of pages with only ``write_page``, as a :class:`PageSink` whose
    pages come from one thread, in order (``concurrent`` False: a sink that
    says otherwise has the member and is no foreign one)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def write_page(self, ix: int, data: memoryview) -> Digest:
        return self.inner.write_page(ix, data)


class SinkAdapter(PageSinkAdapter):
    """A sink with only the core methods, as a :class:`SessionSink` (pages
    from one thread, in order, as :class:`PageSinkAdapter`'s)."""

    def write_manifest(self, data: bytes) -> None:
        self.inner.write_manifest(data)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class SourceAdapter(SourceBase):
    """A source with only the core methods (and perhaps some of the optional
    ones), as a :class:`SessionSource`: each optional member the source has
    is its own, the others the defaults of :class:`SourceBase`."""

    def __init__(self, inner: Any):
        self.inner = inner
        for name in ("page_digest", "page_size", "read_page_into", "read_page_into_checked",
                     "why_mismatch"):
            own = getattr(inner, name, None)
            if callable(own):
                setattr(self, name, own)

    def read_manifest(self) -> bytes:
        return self.inner.read_manifest()

    def read_page(self, ix: int) -> bytes:
        return self.inner.read_page(ix)


def as_page_sink(sink: Any) -> PageSink:
    """A sink of pages (Bridge.write_blocks): itself if it says whether it is
    ``concurrent``, else in a :class:`PageSinkAdapter`."""
    if isinstance(sink, PageSink):
        return sink
    if callable(getattr(sink, "write_page", None)):
        return PageSinkAdapter(sink)
    raise TypeError(f"not a sink of pages: {sink!r}")


def as_sink(dest: SinkLike) -> SessionSink:
    """A sink for *dest*: itself if it is one (a foreign sink with only the
    core methods: in a :class:`SinkAdapter`); for a path a DirSink, or a
    :class:`DirectSink` in a pffs mount that allows it."""
    if isinstance(dest, (str, os.PathLike)):
        return sink_for(dest)
    if isinstance(dest, SessionSink):
        return dest
    if isinstance(dest, CoreSink):
        return SinkAdapter(dest)
    raise TypeError(f"not a session sink or path: {dest!r}")


def as_source(src: SourceLike) -> SessionSource:
    """A source for *src*: itself if it is one (a foreign source with only the
    core methods: in a :class:`SourceAdapter`); for a path a DirSource, or a
    :class:`DirectSource` in a pffs mount that allows it."""
    if isinstance(src, (str, os.PathLike)):
        return source_for(src)
    if isinstance(src, SessionSource):
        return src
    if isinstance(src, CoreSource):
        return SourceAdapter(src)
    raise TypeError(f"not a session source or path: {src!r}")
