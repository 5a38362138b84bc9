"""``pffs wait PATH``: until a session an engine was asked to save is there, or
its save failed.

An engine's save completes on its own time, after the request that asked for
it has finished (docs/engines.md §10).  Its outcome is visible in the folder
the session goes to: the session ``PATH`` appears whole (its manifest.json
last, in one commit), or a file ``PATH.save-failed`` holding one line that
says why.  This polls for either, with a deadline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pffs.names import MANIFEST_NAME, SAVE_FAILED_SUFFIX

SAVED, FAILED, TIMED_OUT = 0, 1, 2


def failure_record(session: str | os.PathLike) -> Path:
    """Where a failed save of *session* leaves its reason."""
    p = Path(session)
    return p.with_name(p.name + SAVE_FAILED_SUFFIX)


def outcome(session: str | os.PathLike) -> tuple[int, str] | None:
    """(SAVED, "") or (FAILED, reason) if the save of *session* has ended, else None."""
    if os.path.exists(os.path.join(session, MANIFEST_NAME)):
        return SAVED, ""
    try:
        reason = failure_record(session).read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    return FAILED, reason.splitlines()[0] if reason else "the save failed"


def wait(session: str | os.PathLike, timeout: float | None = None) -> tuple[int, str]:
    """Poll :func:`outcome` (every 10 ms, up to every 250 ms) until the save
    ends or *timeout* seconds pass: (SAVED|FAILED|TIMED_OUT, reason)."""
    end = None if timeout is None else time.monotonic() + timeout
    pause = 0.01
    while True:
        got = outcome(session)
        if got is not None:
            return got
        if end is not None and time.monotonic() >= end:
            return TIMED_OUT, f"neither the session nor {failure_record(session).name} after {timeout:g} s"
        time.sleep(pause if end is None else max(0.0, min(pause, end - time.monotonic())))
        pause = min(pause * 2, 0.25)


def wait_command(session: str, timeout: float | None) -> int:
    """``pffs wait PATH [--timeout S]``: exit 0 saved, 1 failed (why on stderr), 2 timed out."""
    import sys
    code, why = wait(session, timeout)
    if code == SAVED:
        print(f"{session}: saved")
    else:
        print(f"pffs wait: {session}: {why}", file=sys.stderr)
    return code


def add_arguments(s) -> None:
    """``pffs wait``'s arguments (pffs.cli's parser)."""
    s.add_argument("session", help="where an engine was asked to save a session")
    s.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long (exit 2)")
    s.set_defaults(func=lambda args: wait_command(args.session, args.timeout))
