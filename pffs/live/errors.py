"""What an engine's requests fail with: the errno a reader or writer gets."""

from __future__ import annotations

import errno
import sys

if sys.version_info < (3, 11):  # a builtin from 3.11; trio brings the backport before it
    from exceptiongroup import BaseExceptionGroup


class EngineError(Exception):
    """A request the engine could not serve; ``errno`` is what the reader gets."""

    errno = errno.EIO


class EngineGone(EngineError):
    """The engine detached or crashed."""


class EngineRefused(EngineError):
    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err


def unwrap(eg: BaseExceptionGroup) -> BaseException:
    """The exception to raise for a nursery's group: an EngineError if it holds one."""
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            e = unwrap(e)
        if isinstance(e, EngineError):
            return e
    return eg
