"""Which sink or source a path gets: the direct path where the mount's store
allows it (engine_bridge.transport.direct), else the folder through the
mount (engine_bridge.transport.folders); a sink or source given is used as is.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine_bridge.transport.direct import DirectSink, DirectSource
from engine_bridge.transport.folders import DirSink, DirSource
from engine_bridge.transport.mountinfo import store_access
from engine_bridge.transport.session_io import SessionSink, SessionSource, SinkLike, SourceLike


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


def as_sink(dest: SinkLike) -> SessionSink:
    """A sink for *dest*: itself if it is one; for a path a DirSink, or a
    :class:`DirectSink` in a pffs mount that allows it."""
    if isinstance(dest, (str, os.PathLike)):
        return sink_for(dest)
    if isinstance(dest, SessionSink):
        return dest
    raise TypeError(f"not a session sink or path: {dest!r}")


def as_source(src: SourceLike) -> SessionSource:
    """A source for *src*: itself if it is one; for a path a DirSource, or a
    :class:`DirectSource` in a pffs mount that allows it."""
    if isinstance(src, (str, os.PathLike)):
        return source_for(src)
    if isinstance(src, SessionSource):
        return src
    raise TypeError(f"not a session source or path: {src!r}")
